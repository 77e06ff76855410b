"""The signals a rule may name, mapped to exact metric series.

Rules say ``preemptions`` or ``e2e_latency``; this registry knows that the
first is the collector's counter ``vllm_runbook_preemptions_total`` and the
second vLLM's histogram ``vllm:e2e_request_latency_seconds``. Collector names
come from ``vllm_runbook.collector.metrics`` so a rename there breaks here, loudly.
A name not in SIGNALS is an UnknownSignalError at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_runbook.collector import metrics as M

SignalType = Literal["gauge", "counter", "histogram"]

# Labels that identify one engine. Prometheus adds `instance` at scrape; our
# scraper sets it to the inventory name. vLLM and the collector both set
# model_name and engine (the DP rank).
ENGINE_LABELS: tuple[str, ...] = ("instance", "model_name", "engine")


@dataclass(frozen=True)
class Signal:
    name: str
    metric: str  # exact series name (histograms: without _bucket/_sum/_count)
    type: SignalType
    help: str
    per: str | None = None  # extra label that splits one engine's series (GPUs)


def _collector(name: str, spec: M.MetricSpec, help_: str) -> Signal:
    per = next((label for label in ("gpu", "tier") if label in spec.extra_labels), None)
    return Signal(name, spec.series_name, spec.type, help_, per)


_BASE: tuple[Signal, ...] = (
    _collector(
        "kv_hit_ratio",
        M.KV_HIT_RATIO,
        "prefix cache hit ratio over the collector's window (NaN without lookups)",
    ),
    _collector(
        "prefix_cache_queries", M.PREFIX_CACHE_QUERIES, "tokens looked up in the prefix cache"
    ),
    _collector("prefix_cache_hits", M.PREFIX_CACHE_HITS, "tokens found in the prefix cache"),
    _collector(
        "block_fragmentation", M.BLOCK_FRAGMENTATION, "KV block fragmentation after the latest step"
    ),
    _collector("padding_ratio", M.PADDING_RATIO, "cudagraph padding share of executed tokens"),
    _collector(
        "length_padding_ratio", M.LENGTH_PADDING_RATIO, "padding a static batcher would need"
    ),
    _collector("schedule_seconds", M.SCHEDULE_SECONDS, "wall time of schedule()"),
    _collector("scheduled_tokens", M.SCHEDULED_TOKENS, "tokens scheduled"),
    _collector("token_budget", M.TOKEN_BUDGET, "token budget offered"),
    _collector("budget_fill", M.BUDGET_FILL, "latest step: scheduled / budget"),
    _collector("requests_running", M.REQUESTS_RUNNING, "requests running"),
    _collector("requests_waiting", M.REQUESTS_WAITING, "requests waiting (incl. preempted)"),
    _collector("preemptions", M.PREEMPTIONS, "requests preempted"),
    _collector(
        "tier_requests_waiting", M.TIER_REQUESTS_WAITING, "requests waiting, per prompt-length tier"
    ),
    _collector(
        "tier_requests_running", M.TIER_REQUESTS_RUNNING, "requests running, per prompt-length tier"
    ),
    _collector(
        "tier_oldest_waiting",
        M.TIER_OLDEST_WAITING,
        "age of the oldest request waiting for its first schedule, per tier",
    ),
    _collector("kv_cache_usage", M.KV_CACHE_USAGE, "KV blocks used / usable"),
    _collector(
        "kv_cache_usage_peak", M.KV_CACHE_USAGE_PEAK, "peak KV usage at step start over the window"
    ),
    _collector("engine_start_time", M.ENGINE_START_TIME, "unix time the engine started"),
    _collector("gpu_memory_used", M.GPU_MEMORY_USED, "GPU memory in use, per GPU"),
    _collector("gpu_memory_total", M.GPU_MEMORY_TOTAL, "GPU memory in total, per GPU"),
    _collector("gpu_utilization", M.GPU_UTILIZATION, "GPU compute utilisation, per GPU"),
    Signal(
        "e2e_latency",
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "vLLM end-to-end request latency",
    ),
    Signal(
        "time_to_first_token",
        "vllm:time_to_first_token_seconds",
        "histogram",
        "vLLM time to first token",
    ),
    Signal("generation_tokens", "vllm:generation_tokens_total", "counter", "vLLM generated tokens"),
    Signal("prompt_tokens", "vllm:prompt_tokens_total", "counter", "vLLM prompt tokens"),
    Signal(
        "requests_finished",
        "vllm:request_success_total",
        "counter",
        "vLLM finished requests, label finished_reason",
    ),
)


def _with_histogram_parts(signals: tuple[Signal, ...]) -> dict[str, Signal]:
    """Each histogram also offers its _sum and _count as counters (for means)."""
    out: dict[str, Signal] = {}
    for s in signals:
        out[s.name] = s
        if s.type == "histogram":
            for part in ("sum", "count"):
                out[f"{s.name}_{part}"] = Signal(
                    f"{s.name}_{part}", f"{s.metric}_{part}", "counter", f"{s.help} ({part})", s.per
                )
    return out


SIGNALS: dict[str, Signal] = _with_histogram_parts(_BASE)
