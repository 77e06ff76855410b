"""Where each runbook signal comes from, and what it reads before and after a change.

Every signal a runbook may read (`vllm_runbook.rules.signals`, the one
registry of signal names) has one source (`SOURCES`, its `reading` there):
the collector inside the engine (`/v1/state` of the engine's
agent), NVML through the same agent for GPU signals, or vLLM's API server
`/metrics` for what only the API server knows (HTTP statuses: a request it
answers with an error may never reach the engine). `signals_from_state`
reads the agent's from one `/v1/state` answer, `api_signals` the API
server's from its `/metrics` text; `unavailable(state)` names each signal
that cannot be read on this engine and why, so a check, a guard or a
verification is never silently empty. `unreadable(runbooks, why)` lists,
per runbook, each check, verification signal and guard that cannot be read.

Two kinds of signal matter to a verification:
- *windowed* signals (rates, ratios, percentiles over finished requests) are
  measured before a change over the collector's trailing window and after it
  only from the step the change took effect at (`since_signals`, from
  `/v1/state?since_step=N`): a trailing window that straddles the change
  cannot tell a fix from no fix;
- *instant* signals (gauges of the latest step, knobs) read the same way
  before and after.

A check reads the episode, not only the instant: for the gauges the agent
samples once a second (`EPISODE_SIGNALS`: KV usage and capacity, the queues,
the longest sequence, fragmentation, budget fill, the GPUs), `/v1/state`'s
`episode` gives their peak and mean over the finding's span, which
`check_episode` turns into what the journal keeps beside the value now (or
why it could not: an agent older than the field, an idle span).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from vllm_runbook.collector.agent_api import (
    EPISODE_SIGNALS,
    AgentState,
    Episode,
    SettledSince,
    Stats,
)
from vllm_runbook.collector.episode import kv_capacity_seqs as capacity_at
from vllm_runbook.rules.signals import API, READABLE, Reading

# Where each signal comes from and over what time is part of the one signal registry.
SOURCES: Final[Mapping[str, Reading]] = {
    name: s.reading for name, s in READABLE.items() if s.reading is not None
}

WINDOWED: Final = frozenset(name for name, s in SOURCES.items() if s.windowed)

NO_GPU: Final = "no NVIDIA GPU on this engine (NVML not available)"
# Signals only vLLM's API server knows (read from its /metrics when its URL is configured).
API_SIGNALS: Final = frozenset(n for n, s in SOURCES.items() if s.source.startswith(API))
NO_API_URL: Final = "no vLLM API server URL configured (inventory `vllm:`, or --vllm)"
SLO_BURN_RATE: Final = "slo_burn_rate"  # read by SignalReader, for an SLO's execution only
NO_SLO: Final = "no SLO burn-rate alert started this execution"
HTTP_REQUESTS: Final = "http_requests_total"  # prometheus-fastapi-instrumentator, in vLLM's server


def _p99_from_histogram(bounds: Sequence[float], cumulative: Sequence[int]) -> float | None:
    total = cumulative[-1] if cumulative else 0
    if not total:
        return None
    target = 0.99 * total
    for bound, count in zip(bounds, cumulative, strict=False):
        if count >= target:
            return bound
    return None  # in the +Inf bucket: above the largest bound


def _oom_rate(preemptions: Any, finished: Any) -> float | None:
    if preemptions is None or not finished:
        return None
    return float(preemptions) / float(finished)


def kv_capacity_seqs(stats: Stats) -> int | None:
    """Sequences the KV cache holds at the running requests' current average footprint
    (collector/episode.py's kv_capacity_seqs: the agent samples it the same way).
    None when nothing runs or holds blocks: there is no footprint to scale."""
    return capacity_at(stats.kv_blocks_used, stats.kv_blocks_free, stats.requests_running)


NO_EPISODE: Final = "the engine's agent is older than the episode (no samples to read)"


def check_episode(episode: Episode | None, signal: str) -> dict[str, Any]:
    """A check's peak and mean over the episode, as the journal keeps them beside its
    value: {"episode": {peak, mean, seconds, samples[, kept_seconds]}}, or
    {"episode_unavailable": why}; {} for a signal the agent does not sample (knobs,
    windowed rates: they are over a window already)."""
    if signal not in EPISODE_SIGNALS:
        return {}
    if episode is None:
        return {"episode_unavailable": NO_EPISODE}
    extent = getattr(episode, signal)
    if extent is None:
        span = f"in the last {episode.seconds:g} s"
        if not episode.samples:
            why = f"no scheduler step {span} (the engine was idle)"
        elif signal.startswith("gpu_"):
            why = NO_GPU
        elif signal == "kv_capacity_seqs":
            why = f"no request running at any sample {span}"
        else:
            why = f"not sampled {span}"
        return {"episode_unavailable": why}
    read: dict[str, Any] = {
        "peak": extent.peak,
        "mean": extent.mean,
        "seconds": episode.seconds,
        "samples": episode.samples,
    }
    if episode.kept_seconds < episode.seconds:
        read["kept_seconds"] = episode.kept_seconds
    return {"episode": read}


# The signals the agent's `/v1/state` "stats" carry under their own names (one
# name per quantity, from the rules' vocabulary to the wire).
_IN_STATS: Final = tuple(name for name in SOURCES if name in Stats.model_fields)


def signals_from_state(state: AgentState) -> dict[str, Any]:
    """Every known signal from one `/v1/state` answer (None where not readable:
    `unavailable(state)` says why)."""
    stats, knobs = state.stats, state.knobs
    signals: dict[str, Any] = dict.fromkeys(SOURCES)
    for name in _IN_STATS:
        signals[name] = getattr(stats, name)
    signals["oom_rate"] = _oom_rate(
        stats.preemptions_per_minute * stats.window_seconds / 60.0, stats.requests_finished
    )
    histogram = state.schedule_histogram
    signals["schedule_time_p99"] = _p99_from_histogram(histogram.bounds, histogram.cumulative)
    signals["kv_capacity_seqs"] = kv_capacity_seqs(stats)
    signals["max_num_batched_tokens"] = knobs.max_num_batched_tokens
    signals["max_num_seqs"] = knobs.max_num_seqs
    signals["scheduler_policy"] = knobs.policy
    signals["engine_uptime"] = max(0.0, time.time() - state.engine.started_at)
    signals["finish_reasons"] = stats.finished_by_reason
    tiers = state.tiers.now
    if tiers:
        signals["tier_requests_waiting_hot"] = tiers["hot"].waiting
        signals["tier_oldest_waiting_max"] = max(t.oldest_waiting_seconds for t in tiers.values())
    signals["tensor_parallel_size"] = state.engine.parallel.tensor_parallel_size
    gpus = state.gpus.per_gpu
    if gpus:
        utilization = [g.utilization_ratio for g in gpus.values()]
        memory = [g.memory_used_bytes for g in gpus.values()]
        signals["gpu_utilization_max"] = max(utilization)
        signals["gpu_memory_used_max"] = max(memory)
        signals["gpu_utilization_spread"] = max(utilization) - min(utilization)
        signals["gpu_memory_used_spread_ratio"] = (
            (max(memory) - min(memory)) / max(memory) if max(memory) > 0 else 0.0
        )
    return signals


def since_signals(since: SettledSince | None) -> dict[str, Any]:
    """The windowed signals measured only from a change's first step on
    (`since` of `/v1/state?since_step=N`); {} when the agent has no such mark."""
    if since is None:
        return {}
    return {
        "preemptions_per_minute": since.preemptions_per_minute,
        "scheduled_tokens_per_second": since.scheduled_tokens_per_second,
        "kv_hit_ratio": since.kv_hit_ratio,
        "engine_e2e_latency_p99": since.engine_e2e_latency_p99,
        "engine_queue_time_p99": since.engine_queue_time_p99,
        "error_rate": since.error_rate,
        "oom_rate": _oom_rate(since.preemptions, since.requests_finished),
        # Not windowed: of the requests starving at the change, those still waiting.
        "starving_waiting": since.starving_waiting,
    }


def api_signals(metrics_text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The API-server-only signals from vLLM's `/metrics` text, and why any is None.

    http_error_rate: POST requests (completions, chat, embeddings…) the
    server answered with a 5xx status over all POST requests it answered,
    from prometheus-fastapi-instrumentator's `http_requests_total{handler,
    method, status}` (statuses grouped 2xx/4xx/5xx), since it started."""
    from prometheus_client.parser import text_string_to_metric_families

    posts = errors = 0.0
    seen = False
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name != HTTP_REQUESTS:
                continue
            seen = True
            if sample.labels.get("method") != "POST":
                continue
            posts += sample.value
            if str(sample.labels.get("status", "")).startswith("5"):
                errors += sample.value
    if not seen:
        return {"http_error_rate": None}, {
            "http_error_rate": f"the API server's /metrics has no {HTTP_REQUESTS}"
        }
    if not posts:
        return {"http_error_rate": None}, {
            "http_error_rate": "no request answered by the API server yet"
        }
    return {"http_error_rate": errors / posts}, {}


def unavailable(
    state: AgentState, signals: Mapping[str, Any], api: str | None = None
) -> dict[str, str]:
    """Signal → why it cannot be read now on this engine (only the unread ones).
    `api`: why the API server's signals are missing (default: no URL configured)."""
    why: dict[str, str] = {}
    window = state.stats.window_seconds
    no_requests = (
        f"no request finished in the last {window:g} s" if window else "no request finished yet"
    )
    for name, value in signals.items():
        if value is not None:
            continue
        if name in API_SIGNALS:
            why[name] = api or NO_API_URL
        elif name.startswith("gpu_"):
            why[name] = NO_GPU if not state.gpus.nvml_up else "NVML returned no GPU"
        elif name in ("engine_e2e_latency_p99", "engine_queue_time_p99", "error_rate", "oom_rate"):
            why[name] = no_requests
        elif name == "kv_hit_ratio":
            why[name] = "no prefix-cache lookup in the window"
        elif name == "long_prompt_ratio":
            why[name] = f"no request reached the engine in the last {window:g} s"
        elif name == "kv_capacity_seqs":
            why[name] = "no request running: no KV footprint to scale"
        elif name == "scheduled_tokens_per_second":
            why[name] = "needs two reads"
        elif name == "schedule_time_p99":
            why[name] = "no schedule() call yet"
        elif name in ("tier_requests_waiting_hot", "tier_oldest_waiting_max"):
            why[name] = "the agent could not read its queues (scheduler busy for 1 s)"
        else:
            why[name] = "the engine's agent did not report it"
    return why


def runbook_readings(runbook: Any) -> list[tuple[str, str, str]]:
    """(role, name, signal) for each check, the verification signal and each
    guard of a runbook; role is check | verification | guard | required guard."""
    rows = [("check", c.name, c.signal) for c in runbook.checks]
    v = runbook.verification
    if v is not None:
        rows.append(("verification", v.signal, v.signal))
        for g in v.rollback_if_worse:
            rows.append(("required guard" if g in v.required_guards else "guard", g, g))
    return rows


def unreadable(runbooks: Mapping[str, Any], why: Mapping[str, str]) -> list[str]:
    """One line per runbook check, verification signal or guard whose signal
    is in `why` (signal → reason): `runbook: role name (signal): reason`."""
    lines = []
    for name, runbook in runbooks.items():
        for role, item, signal in runbook_readings(runbook):
            if signal in why:
                label = item if item == signal else f"{item} ({signal})"
                lines.append(f"{name}: {role} {label}: {why[signal]}")
    return lines


def autopilot_position(state: AgentState | None) -> dict[str, Any] | None:
    """The autopilot's position in `state` (where it left max_num_seqs, its
    target and changes), when it is on: what a verification reports."""
    if state is None or not state.autopilot.enabled:
        return None
    pilot = state.autopilot.model_dump(mode="json")
    return {
        "max_num_seqs": state.knobs.max_num_seqs,
        "target": pilot["target"],
        "changes": pilot["changes"],
        "last_change": pilot["last_change"],
    }
