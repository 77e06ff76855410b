"""Every signal a rule or a runbook may name, declared once: one name per quantity.

A rule's condition and a runbook's check, `when`, verification and guards
name signals from `SIGNALS`; the docs' signal table is generated from it.
Each entry says what the quantity is (`help`, `unit`, `type`) and how each
side reads it:

- `metric`: the exact Prometheus series a rule queries (the collector's
  names come from `vllm_runbook.collector.metrics`, so a rename there breaks
  here, loudly). None: not a series, rules cannot name it.
- `reading`: where a runbook reads it on one engine (the engine's agent, NVML
  through it, or vLLM's API server) and over what time. None: rules only.

Derived measurements are named by one rule (docs/signals.md): the base
signal's name, then what was done to it (`of` + ``_`` + `how`):

    preemptions_per_minute   rate of the counter `preemptions`, per minute (_per_second)
    schedule_time_p99        99th percentile of the histogram `schedule_time`
    schedule_time_sum/_count the histogram's sum and count, as counters
    gpu_utilization_max      highest over the base's `per` label (its GPUs, its tiers)
    gpu_utilization_spread   highest minus lowest over it; _spread_ratio: that / highest
    tier_requests_waiting_hot  one value of the `per` label

Where a signal comes from (`Signal.source`) says what a rule reading it needs
on the engine: vLLM's own /metrics ("vllm"), the plugin's collector
("plugin") or its NVML poller ("nvml": the plugin and an NVIDIA GPU). A
collector signal that vLLM also measures names vLLM's series as its stand-in
(`vllm`, or `vllm_ratio` for a ratio of two counters' rates): on an engine
without the plugin the rules read that instead (vllm_runbook.rules.needs).

A name not in SIGNALS is an UnknownSignalError (a rule) or a validation
error (a runbook) at load time; a name in RENAMED says what it is called now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from vllm_runbook.collector import metrics as M

SignalType = Literal["gauge", "counter", "histogram"]
Source = Literal["vllm", "plugin", "nvml"]  # what an engine must run for the series to exist

VLLM_PREFIX: Final = "vllm:"  # vLLM's own series
_NVML_SERIES: Final = frozenset(m.series_name for m in M.NVML_METRICS)
# The collector's sliding window (VLLM_RUNBOOK_WINDOW_SECONDS' default): a ratio
# gauge's stand-in measures over the same span.
COLLECTOR_WINDOW_SECONDS: Final = 60.0

# Labels that identify one engine. Prometheus adds `instance` at scrape; our
# scraper sets it to the inventory name. vLLM and the collector both set
# model_name and engine (the DP rank).
ENGINE_LABELS: tuple[str, ...] = ("instance", "model_name", "engine")

# Where a runbook reads a signal.
AGENT: Final = "collector (engine agent /v1/state)"
NVML: Final = "NVML (engine agent /v1/state)"
API: Final = "vLLM API server /metrics"
# Over what time.
NOW: Final = "latest step"
WINDOW: Final = "trailing window (VLLM_RUNBOOK_WINDOW_SECONDS) before; from the change's step after"
READS: Final = "between two reads before; from the change's step after"
NVML_POLL: Final = "latest NVML poll"
AT_READ: Final = "at the read"

# How a derived signal is measured from its base (`of`): the suffix of its name.
RATES: Final = ("per_second", "per_minute")  # of a counter
HISTOGRAM_PARTS: Final = ("p99", "sum", "count")  # of a histogram
OVER_LABEL: Final = ("max", "spread", "spread_ratio")  # over the base's `per` label


@dataclass(frozen=True)
class Reading:
    """How a runbook reads a signal on one engine."""

    source: str
    window: str
    # Measured over a window: after a change, read only from the change's step on.
    windowed: bool = False


@dataclass(frozen=True)
class Signal:
    name: str
    type: SignalType  # a derived value read by runbooks is a gauge: one number now
    unit: str
    help: str
    metric: str | None = None  # exact series (histograms: without _bucket/_sum/_count)
    per: str | None = None  # extra label that splits one engine's series (GPUs, tiers)
    reading: Reading | None = None
    of: str | None = None  # derived: the base signal...
    # ...and what was done to it: RATES, HISTOGRAM_PARTS, OVER_LABEL or a value of its label
    how: str | None = None
    higher_is_worse: bool = False  # the circuit breaker's direction for a guard
    # vLLM's own series for the same quantity: what rules read without the plugin
    vllm: str | None = None
    # or: the ratio of two signals' rates over COLLECTOR_WINDOW_SECONDS (for a ratio gauge)
    vllm_ratio: tuple[str, str] | None = None

    @property
    def source(self) -> Source | None:
        """What an engine must run for `metric` to exist (None: not a series)."""
        if self.metric is None:
            return None
        if self.metric.startswith(VLLM_PREFIX):
            return "vllm"
        # the histogram parts (_sum, _count) of an NVML series would be NVML too
        return "nvml" if self.metric in _NVML_SERIES else "plugin"


def _collector(
    name: str,
    spec: M.MetricSpec,
    unit: str,
    help_: str,
    reading: Reading | None = None,
    *,
    higher_is_worse: bool = False,
    vllm: str | None = None,
    vllm_ratio: tuple[str, str] | None = None,
) -> Signal:
    per = next((label for label in ("gpu", "tier", "policy") if label in spec.extra_labels), None)
    return Signal(
        name,
        spec.type,
        unit,
        help_,
        spec.series_name,
        per,
        reading,
        higher_is_worse=higher_is_worse,
        vllm=vllm,
        vllm_ratio=vllm_ratio,
    )


def _derived(
    of: str,
    how: str,
    unit: str,
    help_: str,
    reading: Reading,
    *,
    higher_is_worse: bool = False,
) -> Signal:
    return Signal(
        f"{of}_{how}",
        "gauge",
        unit,
        help_,
        reading=reading,
        of=of,
        how=how,
        higher_is_worse=higher_is_worse,
    )


def _runbooks_only(
    name: str, unit: str, help_: str, reading: Reading, *, higher_is_worse: bool = False
) -> Signal:
    return Signal(name, "gauge", unit, help_, reading=reading, higher_is_worse=higher_is_worse)


_LATEST = Reading(AGENT, NOW)
_WINDOWED = Reading(AGENT, WINDOW, windowed=True)

_BASE: tuple[Signal, ...] = (
    # --- KV cache --------------------------------------------------------------------
    _collector(
        "kv_cache_usage",
        M.KV_CACHE_USAGE,
        "ratio",
        "KV blocks used / usable blocks",
        _LATEST,
        higher_is_worse=True,
        vllm="vllm:kv_cache_usage_perc",
    ),
    _collector(
        "kv_cache_usage_peak",
        M.KV_CACHE_USAGE_PEAK,
        "ratio",
        "peak KV usage at step start over the window",
        # vLLM samples after the step, at the scrape: at most the peak
        vllm="vllm:kv_cache_usage_perc",
    ),
    _collector(
        "kv_blocks_free", M.KV_BLOCKS_FREE, "blocks", "free KV blocks in the block pool", _LATEST
    ),
    _runbooks_only(
        "kv_capacity_seqs",
        "sequences",
        "sequences the KV cache holds at the running requests' current average footprint "
        "(usable blocks / average blocks per running request)",
        _LATEST,
    ),
    _collector(
        "kv_hit_ratio",
        M.KV_HIT_RATIO,
        "ratio",
        "prefix-cache hits / queries over the collector's window (NaN without lookups)",
        Reading(AGENT + ": prefix-cache counters", WINDOW, windowed=True),
        vllm_ratio=("prefix_cache_hits", "prefix_cache_queries"),
    ),
    _collector(
        "prefix_cache_queries",
        M.PREFIX_CACHE_QUERIES,
        "tokens",
        "tokens looked up in the prefix cache",
        vllm="vllm:prefix_cache_queries_total",
    ),
    _collector(
        "prefix_cache_hits",
        M.PREFIX_CACHE_HITS,
        "tokens",
        "tokens found in the prefix cache",
        vllm="vllm:prefix_cache_hits_total",
    ),
    _collector(
        "block_fragmentation",
        M.BLOCK_FRAGMENTATION,
        "ratio",
        "after the latest step: 1 - computed tokens / (blocks held x block_size) over the "
        "running requests",
        _LATEST,
        higher_is_worse=True,
    ),
    # vLLM's sampled KV block residency (`--kv-cache-metrics`, 1 % of the blocks by
    # default): observed when a block is evicted (reallocated to other content);
    # a "reuse" is a prefix-cache hit on the block. Absent without the flag.
    Signal(
        "kv_block_lifetime",
        "histogram",
        "seconds",
        "vLLM's KV block lifetime, from allocation to eviction (--kv-cache-metrics)",
        "vllm:kv_block_lifetime_seconds",
    ),
    Signal(
        "kv_block_idle_before_evict",
        "histogram",
        "seconds",
        "vLLM's time from a KV block's last use (its allocation or latest prefix-cache hit) "
        "to its eviction (--kv-cache-metrics)",
        "vllm:kv_block_idle_before_evict_seconds",
    ),
    Signal(
        "kv_block_reuse_gap",
        "histogram",
        "seconds",
        "vLLM's time between two prefix-cache hits on the same KV block, observed at its "
        "eviction (--kv-cache-metrics)",
        "vllm:kv_block_reuse_gap_seconds",
    ),
    _collector(
        "preemptions",
        M.PREEMPTIONS,
        "requests",
        "requests preempted",
        vllm="vllm:num_preemptions_total",
    ),
    _derived(
        "preemptions",
        "per_minute",
        "requests/min",
        "requests preempted per minute",
        _WINDOWED,
        higher_is_worse=True,
    ),
    _runbooks_only(
        "oom_rate",
        "ratio",
        "preemptions per finished request (vLLM V1's out-of-memory is a preemption)",
        Reading(AGENT + ": preemptions / finished requests", WINDOW, windowed=True),
        higher_is_worse=True,
    ),
    # --- queues and admission -----------------------------------------------------------
    _collector(
        "requests_running",
        M.REQUESTS_RUNNING,
        "requests",
        "requests in the running queue",
        _LATEST,
        vllm="vllm:num_requests_running",
    ),
    _collector(
        "requests_waiting",
        M.REQUESTS_WAITING,
        "requests",
        "requests waiting to be scheduled, preempted ones included (queue depth)",
        _LATEST,
        higher_is_worse=True,
        vllm="vllm:num_requests_waiting",
    ),
    _collector(
        "oldest_waiting",
        M.OLDEST_WAITING,
        "seconds",
        "how long the oldest request still waiting for its first schedule has been in the "
        "engine's queue (0 when none waits)",
        _LATEST,
        higher_is_worse=True,
    ),
    _collector(
        "last_step_age",
        M.LAST_STEP_AGE,
        "seconds",
        "the scheduler's heartbeat: seconds since it last started or finished a step "
        "(read without the scheduler lock; grows while the engine idles too)",
        _LATEST,
        higher_is_worse=True,
    ),
    _collector(
        "engine_stalled",
        M.ENGINE_STALLED,
        "boolean",
        "1 while the engine makes no progress with requests waiting or running (a hung "
        "step, no step, or nothing admitted while KV is free); its /health may still say 200",
        _LATEST,
        higher_is_worse=True,
    ),
    _runbooks_only(
        "admitted_before_time",
        "Unix time",
        "Unix time before which every request the engine received has been scheduled at least "
        "once (the oldest waiting request's arrival in the engine, or now when none waits); "
        "never decreases, stands still while a request starves",
        _LATEST,
    ),
    _runbooks_only(
        "starving_waiting",
        "requests",
        "the requests starving: the oldest waiting for their first schedule (8 at most); "
        "after a change, how many of those starving when it took effect still wait",
        Reading(AGENT, "latest step before; the change's starving requests after"),
        higher_is_worse=True,
    ),
    _collector(
        "tier_requests_waiting",
        M.TIER_REQUESTS_WAITING,
        "requests",
        "requests waiting, per prompt-length tier",
    ),
    _derived(
        "tier_requests_waiting",
        "hot",
        "requests",
        "hot-tier (short-prompt) requests waiting to be scheduled",
        Reading(AGENT + ": per-tier queues", AT_READ),
    ),
    _collector(
        "tier_requests_running",
        M.TIER_REQUESTS_RUNNING,
        "requests",
        "requests running, per prompt-length tier",
    ),
    _collector(
        "tier_oldest_waiting",
        M.TIER_OLDEST_WAITING,
        "seconds",
        "age of the oldest request waiting for its first schedule, per tier",
    ),
    _derived(
        "tier_oldest_waiting",
        "max",
        "seconds",
        "the longest wait, over the prompt-length tiers, of a request still waiting for its "
        "first schedule (0 when none waits)",
        Reading(AGENT + ": per-tier queues", AT_READ),
    ),
    # --- knobs and the step ------------------------------------------------------------
    _collector(
        "max_num_batched_tokens",
        M.MAX_NUM_BATCHED_TOKENS,
        "tokens",
        "effective token budget per step",
        _LATEST,
    ),
    _collector("max_num_seqs", M.MAX_NUM_SEQS, "sequences", "effective admission limit", _LATEST),
    _collector(
        "scheduler_policy",
        M.SCHEDULER_POLICY,
        "policy",
        "active scheduling policy (fcfs | priority | tiered); as a series, 1 for the active one",
        _LATEST,
    ),
    _collector("scheduled_tokens", M.SCHEDULED_TOKENS, "tokens", "tokens scheduled"),
    _derived(
        "scheduled_tokens",
        "per_second",
        "tokens/s",
        "tokens scheduled per second (prefill and decode)",
        Reading(AGENT + ": scheduled tokens counter", READS, windowed=True),
    ),
    _collector("token_budget", M.TOKEN_BUDGET, "tokens", "token budget offered"),
    _collector(
        "budget_fill",
        M.BUDGET_FILL,
        "ratio",
        "latest step: scheduled tokens / token budget",
        _LATEST,
    ),
    _collector(
        "max_sequence_tokens",
        M.MAX_SEQUENCE_TOKENS,
        "tokens",
        "longest context (prompt + generated) among running requests",
        _LATEST,
        higher_is_worse=True,
    ),
    _collector(
        "long_prompt_ratio",
        M.LONG_PROMPT_RATIO,
        "ratio",
        "share of the requests that reached the engine in the window with a prompt above "
        "8192 tokens (the field reports' 8k; NaN when none arrived)",
        Reading(AGENT + ": prompts that arrived", "trailing window (VLLM_RUNBOOK_WINDOW_SECONDS)"),
    ),
    _collector(
        "length_padding_ratio",
        M.LENGTH_PADDING_RATIO,
        "ratio",
        "latest step: 1 - sum(len) / (n x max len) over the scheduled requests' context "
        "lengths (the length spread a static batcher would pad: the field reports' padding "
        "ratio); 0 when none run",
        _LATEST,
    ),
    _collector(
        "padding_ratio",
        M.PADDING_RATIO,
        "ratio",
        "cudagraph padding: padded - unpadded over padded tokens, over the window (0 on CPU "
        "and with enforce_eager: no graphs)",
        Reading(AGENT, "trailing window (VLLM_RUNBOOK_WINDOW_SECONDS)"),
    ),
    _collector("schedule_time", M.SCHEDULE_SECONDS, "seconds", "wall time of schedule()"),
    _derived(
        "schedule_time",
        "p99",
        "seconds",
        "P99 wall time of scheduler.schedule()",
        Reading(AGENT + ": schedule() histogram", "since engine start"),
        higher_is_worse=True,
    ),
    # --- requests ----------------------------------------------------------------------
    Signal(
        "e2e_latency",
        "histogram",
        "seconds",
        "vLLM's end-to-end request latency (from the API server's arrival)",
        "vllm:e2e_request_latency_seconds",
    ),
    Signal(
        "time_to_first_token",
        "histogram",
        "seconds",
        "vLLM's time to first token",
        "vllm:time_to_first_token_seconds",
    ),
    _collector(
        "engine_e2e_latency",
        M.REQUEST_E2E_SECONDS,
        "seconds",
        "per finished request: from its arrival in the engine to its finish",
    ),
    _derived(
        "engine_e2e_latency",
        "p99",
        "seconds",
        "P99 end-to-end latency of the requests finished in the window (as the engine saw it)",
        Reading(AGENT + ": end-to-end time of finished requests", WINDOW, windowed=True),
        higher_is_worse=True,
    ),
    _collector(
        "engine_queue_time",
        M.REQUEST_QUEUE_SECONDS,
        "seconds",
        "per finished request: from its arrival in the engine to its first schedule",
        vllm="vllm:request_queue_time_seconds",
    ),
    _derived(
        "engine_queue_time",
        "p99",
        "seconds",
        "P99 time the requests finished in the window waited before their first schedule",
        Reading(AGENT + ": queue time of finished requests", WINDOW, windowed=True),
        higher_is_worse=True,
    ),
    Signal(
        "generation_tokens",
        "counter",
        "tokens",
        "vLLM's generated tokens",
        "vllm:generation_tokens_total",
    ),
    Signal(
        "prompt_tokens", "counter", "tokens", "vLLM's prompt tokens", "vllm:prompt_tokens_total"
    ),
    Signal(
        "requests_finished",
        "counter",
        "requests",
        "vLLM's finished requests, label finished_reason",
        "vllm:request_success_total",
    ),
    Signal(
        "spec_decode_draft_tokens",
        "counter",
        "tokens",
        "vLLM's draft tokens proposed by speculative decoding",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    Signal(
        "spec_decode_accepted_tokens",
        "counter",
        "tokens",
        "vLLM's draft tokens the target model accepted",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
    _runbooks_only(
        "error_rate",
        "ratio",
        "finished requests with finish reason 'error' / finished requests",
        Reading(AGENT + ": finish reason 'error' / finished", WINDOW, windowed=True),
        higher_is_worse=True,
    ),
    _runbooks_only(
        "finish_reasons",
        "requests by reason",
        "requests finished over the window, by vLLM's finish reason",
        Reading(AGENT + ": finished requests", "trailing window"),
    ),
    _runbooks_only(
        "http_error_rate",
        "ratio",
        "share of the API server's POST requests answered with a server error (HTTP 5xx), "
        "including those that never reached the engine",
        Reading(
            API + ": http_requests_total, POST answered 5xx / POST", "since the API server started"
        ),
    ),
    _runbooks_only(
        "slo_burn_rate",
        "ratio",
        "the triggering SLO's error ratio / its error budget (1 - target): how many times "
        "faster than sustainable the budget burns; read only in an execution an SLO "
        "burn-rate alert started (its verification signal)",
        Reading(
            API + ": the SLO's histogram bucket le=threshold and _count (availability: "
            "request_success_total by finished_reason)",
            "the alert's burn rate before; from the change's step after",
            windowed=True,
        ),
        higher_is_worse=True,
    ),
    # --- GPUs and the engine ----------------------------------------------------------------
    _collector("gpu_memory_used", M.GPU_MEMORY_USED, "bytes", "GPU memory in use, per GPU (NVML)"),
    _derived(
        "gpu_memory_used",
        "max",
        "bytes",
        "GPU memory in use on the engine's fullest GPU (NVML)",
        Reading(NVML, NVML_POLL),
        higher_is_worse=True,
    ),
    _derived(
        "gpu_memory_used",
        "spread_ratio",
        "ratio",
        "(highest - lowest) / highest GPU memory in use among the engine's GPUs",
        Reading(NVML, NVML_POLL),
    ),
    _collector(
        "gpu_memory_used_peak",
        M.GPU_MEMORY_USED_PEAK,
        "bytes",
        "highest GPU memory in use at any NVML poll over the collector's window, per GPU",
    ),
    _collector(
        "gpu_memory_total", M.GPU_MEMORY_TOTAL, "bytes", "GPU memory in total, per GPU (NVML)"
    ),
    _collector(
        "gpu_utilization",
        M.GPU_UTILIZATION,
        "ratio",
        "GPU compute utilisation, per GPU (NVML)",
    ),
    _derived(
        "gpu_utilization",
        "max",
        "ratio",
        "GPU compute utilisation of the engine's busiest GPU (NVML)",
        Reading(NVML, NVML_POLL),
    ),
    _derived(
        "gpu_utilization",
        "spread",
        "ratio",
        "highest minus lowest GPU utilisation among the engine's GPUs",
        Reading(NVML, NVML_POLL),
    ),
    _collector(
        "gpu_dram_utilization",
        M.GPU_DRAM_UTILIZATION,
        "ratio",
        "share of time the GPU's memory controller was busy (DRAM read or written), per GPU (NVML)",
    ),
    _runbooks_only(
        "tensor_parallel_size",
        "GPUs",
        "GPUs one model replica is split over (tensor parallel)",
        Reading(AGENT + ": the engine's parallel config", "at start"),
    ),
    _collector(
        "engine_start_time", M.ENGINE_START_TIME, "Unix time", "Unix time the engine started"
    ),
    _runbooks_only("engine_uptime", "seconds", "seconds since the engine started", _LATEST),
    _collector(
        "warmup_done",
        M.WARMUP_DONE,
        "flag",
        "1 once the warm-up at engine start finished every planned request; 0 when it was "
        "off, skipped, failed or cut short (the engine started cold)",
        _LATEST,
    ),
)


def _with_histogram_parts(signals: tuple[Signal, ...]) -> dict[str, Signal]:
    """Each histogram also offers its _sum and _count as counters (for means)."""
    out: dict[str, Signal] = {}
    for s in signals:
        out[s.name] = s
        if s.type == "histogram" and s.metric is not None:
            for part in ("sum", "count"):
                out[f"{s.name}_{part}"] = Signal(
                    f"{s.name}_{part}",
                    "counter",
                    s.unit if part == "sum" else "observations",
                    f"{s.help} ({part})",
                    f"{s.metric}_{part}",
                    s.per,
                    of=s.name,
                    how=part,
                    vllm=f"{s.vllm}_{part}" if s.vllm else None,
                )
    return out


SIGNALS: Final[Mapping[str, Signal]] = _with_histogram_parts(_BASE)

# Old names, and what each is called now: a catalog that still uses one is
# told the new name (no aliases: one quantity, one name).
RENAMED: Final[Mapping[str, str]] = {
    "kv_cache_usage_ratio": "kv_cache_usage",
    "num_requests_running": "requests_running",
    "num_requests_waiting": "requests_waiting",
    "block_fragmentation_ratio": "block_fragmentation",
    "budget_fill_ratio": "budget_fill",
    "oldest_waiting_seconds": "oldest_waiting",
    "hot_requests_waiting": "tier_requests_waiting_hot",
    "tier_oldest_waiting_seconds": "tier_oldest_waiting_max",
    "throughput_tokens_per_second": "scheduled_tokens_per_second",
    "p99_latency_seconds": "engine_e2e_latency_p99",
    "waiting_seconds_p99": "engine_queue_time_p99",
    "schedule_seconds": "schedule_time",
    "schedule_seconds_sum": "schedule_time_sum",
    "schedule_seconds_count": "schedule_time_count",
    "schedule_seconds_p99": "schedule_time_p99",
    "gpu_utilization_ratio": "gpu_utilization_max",
    "gpu_memory_used_bytes": "gpu_memory_used_max",
    "gpu_memory_spread_ratio": "gpu_memory_used_spread_ratio",
    "engine_uptime_seconds": "engine_uptime",
}

# What runbooks can read: every signal with a reading, in the registry's order.
READABLE: Final[Mapping[str, Signal]] = {n: s for n, s in SIGNALS.items() if s.reading}


def unknown_signal(name: str, *, readable: bool = False) -> str | None:
    """Why `name` cannot be named here (None: it can). `readable`: by a runbook,
    which reads the engine; else by a rule, which queries Prometheus series."""
    if name in RENAMED:
        return f"signal {name!r} was renamed {RENAMED[name]!r}"
    signal = SIGNALS.get(name)
    if signal is None:
        return f"unknown signal {name!r}"
    if readable and signal.reading is None:
        hint = _derived_hint(name)
        return f"signal {name!r} is a Prometheus series for rules; a runbook cannot read it{hint}"
    if not readable and signal.metric is None:
        base = f"; it is derived from {signal.of!r}" if signal.of else ""
        return f"signal {name!r} is read by runbooks from the engine, not a Prometheus series{base}"
    return None


def _derived_hint(name: str) -> str:
    readable = [n for n, s in READABLE.items() if s.of == name]
    return f" (runbooks read {', '.join(readable)})" if readable else ""
