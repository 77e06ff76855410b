"""The metrics a dashboard may query: the collector's, the service's, vLLM's.

The collector (`vllm_runbook.collector.metrics`) and the service
(`vllm_runbook.runbooks.service.metric_specs`) declare theirs; vLLM's are declared
by vLLM in `vllm/v1/metrics/loggers.py`.
The dashboards use a handful of vLLM's, named once here as MetricSpecs; the
tests check them against the names parsed from the installed vLLM's source
(`vllm_metric_types`), so a rename in vLLM fails the tests.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.metrics import MetricSpec
from vllm_runbook.rules import slo as SLO
from vllm_runbook.runbooks.service.metric_specs import SERVICE_METRICS


def _vllm(name: str, type_: str, help_: str, *labels: str) -> MetricSpec:
    return MetricSpec("vllm:" + name, type_, help_, extra_labels=labels)  # type: ignore[arg-type]


GENERATION_TOKENS = _vllm("generation_tokens", "counter", "Generated (output) tokens.")
PROMPT_TOKENS = _vllm("prompt_tokens", "counter", "Prompt tokens processed (prefill).")
REQUEST_SUCCESS = _vllm(
    "request_success",
    "counter",
    "Finished requests, by finished_reason (stop|length|abort|error).",
    "finished_reason",
)
TIME_TO_FIRST_TOKEN = _vllm(
    "time_to_first_token_seconds", "histogram", "Time from arrival to the first output token."
)
INTER_TOKEN_LATENCY = _vllm(
    "inter_token_latency_seconds", "histogram", "Time between two output tokens of a request."
)
REQUEST_PROMPT_TOKENS = _vllm(
    "request_prompt_tokens", "histogram", "Prompt length of each finished request, tokens."
)
REQUEST_GENERATION_TOKENS = _vllm(
    "request_generation_tokens", "histogram", "Output length of each finished request, tokens."
)
E2E_REQUEST_LATENCY = _vllm(
    "e2e_request_latency_seconds", "histogram", "Time from arrival to the request's end."
)
# With --kv-cache-metrics: vLLM's sampled KV block residency, observed at eviction.
KV_BLOCK_LIFETIME = _vllm(
    "kv_block_lifetime_seconds", "histogram", "KV block lifetime, allocation to eviction."
)
KV_BLOCK_IDLE_BEFORE_EVICT = _vllm(
    "kv_block_idle_before_evict_seconds",
    "histogram",
    "Time from a KV block's last use (allocation or prefix-cache hit) to its eviction.",
)
KV_BLOCK_REUSE_GAP = _vllm(
    "kv_block_reuse_gap_seconds",
    "histogram",
    "Time between two prefix-cache hits on the same KV block.",
)
# With speculative decoding (declared in vllm/v1/spec_decode/metrics.py).
SPEC_DECODE_DRAFT_TOKENS = _vllm("spec_decode_num_draft_tokens", "counter", "Draft tokens.")
SPEC_DECODE_ACCEPTED_TOKENS = _vllm(
    "spec_decode_num_accepted_tokens", "counter", "Draft tokens the target model accepted."
)
# vLLM's series that exist only where an option of vLLM is on, and the option:
# their panels stay empty elsewhere (like the collector's GPU-only series).
VLLM_OPTIONAL: dict[MetricSpec, str] = {
    KV_BLOCK_LIFETIME: "--kv-cache-metrics",
    KV_BLOCK_IDLE_BEFORE_EVICT: "--kv-cache-metrics",
    KV_BLOCK_REUSE_GAP: "--kv-cache-metrics",
    SPEC_DECODE_DRAFT_TOKENS: "--speculative-config",
    SPEC_DECODE_ACCEPTED_TOKENS: "--speculative-config",
}

# What Prometheus makes of the configuration's SLOs (vllm_runbook.rules.slo's
# recording rules) and its own ALERTS series: present where those rules are loaded.
SLO_BUDGET_LEFT = MetricSpec(
    SLO.BUDGET_LEFT,
    "gauge",
    "Share of the SLO window's error budget left (negative: overspent).",
    extra_labels=("slo",),
)
SLO_BURN_RATE = MetricSpec(
    SLO.BURN_RATE,
    "gauge",
    "Error ratio over a burn-rate pair's long window / the error budget.",
    extra_labels=("slo", "window"),
)
ALERTS = MetricSpec(
    "ALERTS",
    "gauge",
    "Prometheus' pending and firing alerts (the SLO burn-rate alerts' labels).",
    extra_labels=(
        "alertname", "alertstate", "severity", "slo", "long_window", "short_window",
        "burn_rate", "notify", "runbook",
    ),
)  # fmt: skip
SLO_SERIES: tuple[MetricSpec, ...] = (SLO_BUDGET_LEFT, SLO_BURN_RATE, ALERTS)

VLLM_METRICS: tuple[MetricSpec, ...] = (
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    KV_BLOCK_LIFETIME,
    KV_BLOCK_IDLE_BEFORE_EVICT,
    KV_BLOCK_REUSE_GAP,
    SPEC_DECODE_DRAFT_TOKENS,
    SPEC_DECODE_ACCEPTED_TOKENS,
)

# vLLM's metrics carry model_name and engine like the collector's; the
# service's carry only their extra_labels.
BASE_LABELS: dict[str, tuple[str, ...]] = {
    "collector": M.BASE_LABELS,
    "vllm": M.BASE_LABELS,
    "service": (),
    "slo rules": M.BASE_LABELS,
}

# Which exporter a series comes from: the live test starts each of them.
SOURCES: dict[str, tuple[MetricSpec, ...]] = {
    "collector": M.ALL_METRICS,
    "vllm": VLLM_METRICS,
    "service": SERVICE_METRICS,
    "slo rules": SLO_SERIES,
}

_VLLM_METRIC = re.compile(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[A-Za-z0-9_:]+)\"")
# spec_decode/metrics.py declares its counters as (name, documentation) pairs.
_VLLM_COUNTER_PAIR = re.compile(r"\(\s*\"(vllm:[A-Za-z0-9_:]+)\",\s*\"")


def series_names(spec: MetricSpec) -> set[str]:
    """Every series name `spec` produces in the exposition."""
    if spec.type == "histogram":
        return {spec.name + part for part in ("_bucket", "_sum", "_count")}
    return {spec.series_name}


def known_series(specs: Iterable[MetricSpec]) -> dict[str, MetricSpec]:
    return {name: spec for spec in specs for name in series_names(spec)}


def all_known_series() -> dict[str, MetricSpec]:
    return known_series(spec for specs in SOURCES.values() for spec in specs)


def source_of(series: str) -> str:
    for source, specs in SOURCES.items():
        if series in known_series(specs):
            return source
    raise KeyError(series)


def labels_of(series: str) -> tuple[str, ...]:
    """The labels the exporter puts on `series` (Prometheus adds instance and job)."""
    source = source_of(series)
    spec = known_series(SOURCES[source])[series]
    extra = ("le",) if series.endswith("_bucket") and spec.type == "histogram" else ()
    return BASE_LABELS[source] + spec.extra_labels + extra


def vllm_loggers_path() -> Path | None:
    """vLLM's loggers.py in this environment, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    return path if path.is_file() else None


def vllm_spec_decode_path() -> Path | None:
    """vLLM's spec_decode/metrics.py (its speculative-decoding counters), beside loggers.py."""
    loggers = vllm_loggers_path()
    if loggers is None:
        return None
    path = loggers.parents[1] / "spec_decode" / "metrics.py"
    return path if path.is_file() else None


def vllm_metric_types(source: str) -> Mapping[str, str]:
    """{"vllm:name": "counter"|"gauge"|"histogram"} declared in loggers.py's text."""
    return {name: kind for kind, name in _VLLM_METRIC.findall(source)}


def vllm_spec_decode_counters(source: str) -> Mapping[str, str]:
    """{"vllm:name": "counter"} of the (name, documentation) pairs in spec_decode/metrics.py."""
    return dict.fromkeys(_VLLM_COUNTER_PAIR.findall(source), "counter")
