"""The engine agent's wire format: its requests and answers as models.

One description for both sides: the agent (inside the engine) serializes
its answers with these models and validates the commands it receives with
them; the `runbook` client (vllm_runbook.runbooks.engine.client) parses the answers
with them and builds its commands with them. docs/agent-api.schema.json is
generated from them (`python -m tools.docs`), for other
tools that speak to the agent.

    GET  /v1/state[?since_step=N]   → AgentState
         [&episode_seconds=S]       (the checks' gauges over S seconds: `episode`)
    POST /v1/knobs    KnobsCommand  → ChangeResult   (bearer token)
    POST /v1/restore  RestoreCommand → ChangeResult  (bearer token)
    any refusal                     → ErrorAnswer   (400, 401, 411, 413, 422, 503, 504)

The models are built in the agent's HTTP thread only, never in the
scheduler's step (the step keeps plain numbers; see collector/hook.py).
Answers ignore fields they do not know (a newer agent may add some);
commands refuse them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from vllm_runbook.collector.metrics import POLICIES

Policy = Literal["fcfs", "priority", "tiered"]
assert get_args(Policy) == POLICIES  # the policy gauge's label values are the same
KNOBS: Final[tuple[str, ...]] = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "policy",
    "autopilot",
    "autopilot_target",
)
# A share of something, 0 excluded: a scale factor or a target usage.
Fraction = Annotated[float, Field(strict=True, gt=0, le=1)]
Count = Annotated[int, Field(ge=0)]


# The knobs a bound is checked on, in order: max_num_batched_tokens' floor follows
# the new max_num_seqs.
CHECKED_KNOBS: Final = ("max_num_seqs", "max_num_batched_tokens")


def knob_target(
    before: dict[str, Any],
    values: dict[str, Any],
    check: Callable[[str, int, dict[str, Any], dict[str, Any]], int],
) -> dict[str, Any]:
    """The knob values after a change of `values` (a command's, as
    `KnobsCommand.values` gives them) on `before`: the agent's rule, which the
    service's advisory mode computes the same way. `scale_max_num_batched_tokens`
    scales the budget in force; setting max_num_seqs by hand turns the autopilot
    off. `check(knob, value, target, requested)` returns each of CHECKED_KNOBS
    within its bounds (or raises), in that order; `requested`: what was asked
    for, the scale resolved (a knob missing from it moved through the other)."""
    target = dict(before)
    requested = dict(values)
    if "scale_max_num_batched_tokens" in requested:
        scale = requested.pop("scale_max_num_batched_tokens")
        budget = max(1, int(before["max_num_batched_tokens"] * scale))
        requested["max_num_batched_tokens"] = budget
    target.update(requested)
    if "max_num_seqs" in requested and "autopilot" not in requested:
        target["autopilot"] = False  # set by hand: the operator takes over
    for knob in CHECKED_KNOBS:
        target[knob] = check(knob, target[knob], target, requested)
    return target


class _Answer(BaseModel):
    """What the agent sends: read leniently (unknown fields ignored)."""

    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True, extra="ignore")


def _was(name: str, old: str) -> Any:
    """A field named as its signal is (rules/signals.py: one name per quantity
    from the rules' and runbooks' vocabulary to the wire), read under `old` too:
    the name an agent of an earlier version sends."""
    return Field(validation_alias=AliasChoices(name, old))


# -- commands --------------------------------------------------------------------


class _Command(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True, extra="forbid")

    clamp: Annotated[bool, Field(strict=True)] = False
    """Clamp a value outside its bounds to the bound instead of refusing the command (422)."""
    dry_run: Annotated[bool, Field(strict=True)] = False
    """Answer what would change; change nothing."""


class KnobsCommand(_Command):
    """POST /v1/knobs: new values for some knobs (at least one), applied
    together between two scheduler steps, never above the startup values."""

    max_num_batched_tokens: Annotated[int, Field(strict=True)] | None = None
    """The token budget per step."""
    scale_max_num_batched_tokens: Fraction | None = None
    """The token budget times this factor (instead of max_num_batched_tokens)."""
    max_num_seqs: Annotated[int, Field(strict=True)] | None = None
    """The admission limit (running sequences); setting it turns the autopilot off."""
    policy: Policy | None = None
    """The scheduling policy."""
    autopilot: bool | None = None
    """The autopilot on or off (also "on"/"off")."""
    autopilot_target: Fraction | None = None
    """The autopilot's target peak KV cache usage."""

    @field_validator("autopilot", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("on", "true", "1", "yes"):
            return True
        if text in ("off", "false", "0", "no"):
            return False
        raise ValueError(f"autopilot must be on or off, got {value!r}")

    @model_validator(mode="after")
    def _one_budget_and_something_to_change(self) -> KnobsCommand:
        if (
            self.max_num_batched_tokens is not None
            and self.scale_max_num_batched_tokens is not None
        ):
            raise ValueError("give max_num_batched_tokens or its scale, not both")
        if not self.values():
            raise ValueError(f"nothing to change: give one of {', '.join(KNOBS)}")
        return self

    def values(self) -> dict[str, Any]:
        """The knobs asked for (knob → value), without the flags."""
        return self.model_dump(exclude_none=True, exclude={"clamp", "dry_run"})


class RestoreCommand(_Command):
    """POST /v1/restore: every knob back to its startup value (the autopilot turns off)."""


def command_error(exc: ValidationError) -> str:
    """A refused command's reason, as one line (the agent's 400, the CLI's stderr)."""
    errors = exc.errors(include_url=False)
    unknown = [str(e["loc"][-1]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return f"unknown field(s): {', '.join(sorted(unknown))}"
    error = errors[0]
    kind, loc, value = error["type"], error["loc"], error.get("input")
    field = str(loc[-1]) if loc else ""
    if not loc:
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return "request body must be a JSON object"
        return _value_error(error)
    if kind == "value_error":
        return _value_error(error)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{field} must be an integer, got {value!r}"
    if kind in ("bool_type", "bool_parsing"):
        return f"{field} must be true or false"
    if kind == "literal_error":
        return f"{field} must be one of {', '.join(POLICIES)}, got {value!r}"
    if kind in ("float_type", "float_parsing"):
        return f"{field} must be a number in (0, 1], got {value!r}"
    if kind in ("greater_than", "less_than_equal", "finite_number"):
        return f"{field} must be in (0, 1], got {value!r}"
    return f"{field}: {error['msg']}"


def answer_error(exc: ValidationError) -> str:
    """Where an answer departs from the agent's model, as one short phrase."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def _value_error(error: Any) -> str:
    cause = (error.get("ctx") or {}).get("error")
    return str(cause) if cause is not None else str(error["msg"])


# -- answers: pieces -----------------------------------------------------------


class Knobs(_Answer):
    """The live knobs: what the scheduler uses now (or started with)."""

    max_num_batched_tokens: int
    """Token budget per step."""
    max_num_seqs: int
    """Admission limit: sequences running at once."""
    policy: Policy
    """Scheduling policy."""
    autopilot: bool
    """Whether the autopilot adjusts max_num_seqs."""
    autopilot_target: float
    """The autopilot's target peak KV cache usage."""


class Bound(_Answer):
    min: int
    """The lowest value accepted now."""
    max: int
    """The highest value accepted (the startup value)."""
    min_reason: str
    """Why the minimum is what it is."""
    max_reason: str
    """Why the maximum is what it is."""


class Bounds(_Answer):
    """The bounds of the numeric knobs now (the budget's floor follows max_num_seqs)."""

    max_num_batched_tokens: Bound
    max_num_seqs: Bound


class KnobChange(_Answer):
    knob: str
    before: int | float | bool | str
    after: int | float | bool | str


class Clamped(_Answer):
    knob: str
    requested: int | float
    """The value asked for."""
    applied: int | float
    """The bound applied instead."""


class ChangeResult(_Answer):
    """The answer to POST /v1/knobs and /v1/restore."""

    seq: int = 0
    """Order in which the agent applied the command."""
    dry_run: bool
    changes: list[KnobChange]
    """Each knob whose value changed (would change, in a dry run)."""
    clamped: list[Clamped]
    before: Knobs
    after: Knobs
    """The knobs after the command (as before, in a dry run)."""
    would_be: Knobs | None = None
    """In a dry run: the knobs the command would have set."""
    effective_from_step: int
    """The first scheduler step that runs with the new values."""


class ErrorAnswer(_Answer):
    """Any refusal: one line, and for a value out of bounds the bound."""

    error: str
    knob: str | None = None
    """Out of bounds (422): the knob refused ..."""
    value: int | None = None
    """... the value asked for ..."""
    bound: int | None = None
    """... and the bound it crossed."""


# -- answers: /v1/state ------------------------------------------------------------


class ParallelConfig(_Answer):
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int


class EngineInfo(_Answer):
    model_name: str
    """The served model name (label `model_name`)."""
    engine: str
    """The data-parallel rank (label `engine`); the agent listens on the base port + this."""
    pid: int
    """The EngineCore process."""
    started_at: float
    """Unix time the scheduler started."""
    step: int
    """Scheduler steps so far."""
    vllm_version: str
    scheduler_class: str
    """Which scheduler vLLM picked, with the hook mixed in (RunbookAsyncScheduler on GPU)."""
    parallel: ParallelConfig


class AutopilotChanges(_Answer):
    up: int
    down: int


class AutopilotChange(_Answer):
    step: int
    max_num_seqs: int
    reason: str
    """preemption | failed probe | peak over target | room"""


class AutopilotState(_Answer):
    enabled: bool
    target: float
    """Target peak KV cache usage."""
    high: float
    """The band's upper edge: a peak above it cuts max_num_seqs."""
    limit: int | None
    """The max_num_seqs it set (null while off); in advisory mode the one it would set."""
    epoch_steps: int
    """Steps per epoch: one request lifetime."""
    epoch_peak_kv_usage: float
    changes: AutopilotChanges
    last_change: AutopilotChange | None
    error: str | None
    """Why it turned itself off, if it did."""
    ceiling: int
    """The highest max_num_seqs it may set now."""
    advisory: bool = False
    """Advisory mode (VLLM_RUNBOOK_AUTOPILOT=advisory): it decides and changes nothing."""


# The statistics, split per concern the way vLLM's v1 stats are
# (vllm/v1/metrics/stats.py: PrefixCacheStats, SchedulerStats, IterationStats,
# FinishedRequestStats): one base model per concern, and `Stats` inheriting them
# all, so the JSON stays one flat object. Counters (`_total`) count since the
# engine started; "the window" is the trailing VLLM_RUNBOOK_WINDOW_SECONDS
# (`window_seconds`); a ratio is a share in 0..1.


class CollectorStats(_Answer):
    """The collector itself."""

    collector_up: float
    """1 while the collector hook works; 0 after it failed and disabled itself
    (the engine keeps serving)."""
    engine_start_time: Annotated[float, _was("engine_start_time", "engine_start_time_seconds")]
    """Unix time (seconds) at which the scheduler, and so the engine, started."""


class WarmupStats(_Answer):
    """The warm-up at engine start (VLLM_RUNBOOK_WARMUP): zeros when off or skipped.
    An agent of an earlier version sends none of these: read as zeros."""

    warmup_requests_planned: Count = 0
    """Requests the warm-up sends through the engine before it reports ready."""
    warmup_requests_done: Count = 0
    """Warm-up requests finished so far."""
    warmup_steps: Count = 0
    """Scheduler steps the warm-up ran so far."""
    warmup_tokens: Count = 0
    """Tokens the warm-up's steps scheduled (prefill and decode), included in
    scheduled_tokens_total."""
    warmup_seconds: float = 0.0
    """Wall time of the warm-up: so far while it runs, in total after."""
    warmup_done: float = 0.0
    """1 once every planned warm-up request finished; 0 otherwise (off, skipped,
    running, failed or cut short: the engine started cold)."""


class PrefixCacheStats(_Answer):
    """Prefix-cache lookups at admission (vLLM: PrefixCacheStats), counted whatever
    vLLM's log_stats."""

    prefix_cache_queries_total: Count
    """Tokens looked up in the prefix cache at admission."""
    prefix_cache_hits_total: Count
    """Tokens found in the prefix cache at admission."""
    kv_hit_ratio: float | None
    """Prefix cache hits / queries (tokens) over the window; null: no lookup in the window."""


class KvCacheStats(_Answer):
    """The KV cache's blocks and how well the running requests fill them
    (vLLM: SchedulerStats.kv_cache_usage)."""

    kv_blocks_used: Count
    """KV cache blocks held by requests now (vLLM's null block and free cached
    blocks excluded)."""
    kv_blocks_free: Count
    """KV cache blocks free now (evictable prefix-cached blocks included)."""
    kv_cache_usage: Annotated[float, _was("kv_cache_usage", "kv_cache_usage_ratio")]
    """KV blocks used / usable blocks now (vLLM's own definition)."""
    kv_cache_usage_peak: Annotated[float, _was("kv_cache_usage_peak", "kv_cache_usage_peak_ratio")]
    """The highest KV cache usage over the window, sampled at the start of each step
    (before the scheduler allocates or preempts: a preemption frees blocks, so the
    usage after the step hides the pressure that caused it)."""
    block_fragmentation: Annotated[float, _was("block_fragmentation", "block_fragmentation_ratio")]
    """After the latest step: the share of the running requests' KV block slots that
    hold no token, 1 - Σ computed tokens / Σ (blocks held × block size); 0 when none run."""
    block_fragmentation_at_block_size: dict[str, float] = {}
    """After the latest step: what block_fragmentation would be at another block
    size, by block size in tokens ("8", "16", "32", "64", "128"): the block-size sweep
    without a restart."""
    max_sequence_tokens: Count
    """After the latest step: the longest context among the running requests (computed
    prompt + generated tokens); 0 when none run."""


class IterationStats(_Answer):
    """The scheduler's steps: tokens scheduled against the budget, and the padding
    of the batches executed (vLLM: IterationStats)."""

    steps_total: Count
    """Scheduler steps (schedule() calls)."""
    scheduled_tokens_total: Count
    """Tokens scheduled over all steps (prefill and decode)."""
    token_budget_total: Count
    """Tokens of budget offered over all steps (each step's effective
    max_num_batched_tokens): scheduled_tokens_total / this is the budget fill."""
    step_tokens: Count
    """Tokens scheduled in the latest step."""
    budget_fill: Annotated[float, _was("budget_fill", "budget_fill_ratio")]
    """Latest step: tokens scheduled / effective token budget."""
    padded_tokens_total: Count
    """Tokens executed, cudagraph padding included (equal to unpadded_tokens_total
    where nothing is padded)."""
    unpadded_tokens_total: Count
    """Tokens executed, without padding."""
    padding_ratio: float
    """Σ (padded - unpadded) / Σ padded tokens executed over the window: the cudagraph
    padding (0 on CPU and with enforce_eager)."""
    length_padding_ratio: float
    """Latest step: 1 - Σ length / (n × longest length) over the scheduled requests'
    context lengths (tokens): the padding a static batcher would need."""


class SchedulerStats(_Answer):
    """The queues, preemptions and admissions (vLLM: SchedulerStats)."""

    requests_running: Annotated[Count, _was("requests_running", "num_requests_running")]
    """Requests in the running queue now."""
    requests_waiting: Annotated[Count, _was("requests_waiting", "num_requests_waiting")]
    """Requests waiting to be scheduled now (preempted ones included)."""
    oldest_waiting: Annotated[float, _was("oldest_waiting", "oldest_waiting_seconds")]
    """Seconds the oldest request still waiting for its first schedule has been in the
    engine's queue; 0 when none waits. Grows without bound while a request starves."""
    preemptions_total: Count
    """Requests preempted (their KV blocks freed, the request sent back to waiting)."""
    preemptions_per_minute: float
    """Preemptions over the window, per minute."""
    admitted_before_time: float
    """Unix time (seconds) before which every request the engine received was scheduled
    at least once (now when none waits); it stands still while a request starves."""
    starving_waiting: int = 0
    """Requests waiting for their first schedule, the oldest 8 at most (what a change
    marks as starving)."""
    admitted_per_second: float | None = None
    """Requests scheduled for the first time, per second over the window."""
    last_step_age: float = 0.0
    """The heartbeat: seconds since the scheduler last started or finished a step
    (read without the scheduler lock; it grows while the engine idles too)."""
    engine_stalled: float = 0.0
    """1 while the engine makes no progress with requests waiting or running."""
    stall_reason: str | None = None
    """Why (collector/stall.py): step_hung, no_steps or admission_stalled; null
    while the engine progresses or idles."""


class KnobStats(_Answer):
    """The knobs as the scheduler uses them now, and their startup values (the ceilings)."""

    max_num_batched_tokens: int
    """Effective token budget per step now (tokens)."""
    max_num_seqs: int
    """Effective admission limit now (running sequences)."""
    startup_max_num_batched_tokens: int
    """The token budget the engine started with (tokens): the ceiling of any change."""
    startup_max_num_seqs: int
    """The max_num_seqs the engine started with (sequences): the ceiling of any change."""


class AutopilotStats(_Answer):
    """The autopilot as gauges (its whole state is AgentState.autopilot)."""

    autopilot_enabled: float
    """1 while the autopilot adjusts max_num_seqs; 0 when off (by hand, by a restore,
    or after an error)."""
    autopilot_kv_target_ratio: float
    """The autopilot's target peak KV cache usage: it raises max_num_seqs while the
    peak stays below."""
    autopilot_kv_high_ratio: float
    """The upper edge of the autopilot's band (target + 0.05, at most 1): a peak above
    it cuts max_num_seqs."""
    autopilot_advised_max_num_seqs: float | None = None
    """In advisory mode (VLLM_RUNBOOK_AUTOPILOT=advisory): the max_num_seqs it would set
    now, nothing applied; null otherwise."""


class FinishedRequestStats(_Answer):
    """The requests that finished over the window, and since start (vLLM:
    FinishedRequestStats). Times run from the request's arrival in the engine
    (its add_request), on the collector's wall clock. null: none finished in the
    window."""

    window_seconds: float
    """The trailing window of the windowed values, seconds (VLLM_RUNBOOK_WINDOW_SECONDS)."""
    requests_finished: Count
    """Requests finished in the window."""
    finished_by_reason: dict[str, int]
    """Requests finished in the window, by vLLM's finish reason (stop, length, abort,
    error, repetition)."""
    error_rate: float | None
    """Requests finished with reason `error` / requests finished, in the window."""
    engine_e2e_latency_p99: Annotated[
        float | None, _was("engine_e2e_latency_p99", "p99_latency_seconds")
    ]
    """End-to-end time (arrival in the engine → finish), seconds, P99 over the window."""
    engine_queue_time_p99: Annotated[
        float | None, _was("engine_queue_time_p99", "waiting_seconds_p99")
    ]
    """Queue time (arrival in the engine → first schedule; → finish if never scheduled),
    seconds, P99 over the window."""
    requests_finished_by_reason_total: dict[str, int]
    """Requests finished since the engine started, by vLLM's finish reason."""


class WorkloadStats(_Answer):
    """The prompts that reached the engine in the window (the whole summary is
    AgentState.workload). null: none arrived in the window."""

    prompt_length_spread_ratio: float | None = None
    """P90 / P10 of the prompt lengths (tokens, nearest rank); 4 or more is the spread
    that hurts batching."""
    long_prompt_ratio: float | None = None
    """Share of the prompts above 8192 tokens."""


class Stats(
    # pydantic orders the fields from the last base to the first: the JSON
    # reads from the collector's own state to the workload.
    WorkloadStats,
    FinishedRequestStats,
    AutopilotStats,
    KnobStats,
    SchedulerStats,
    IterationStats,
    KvCacheStats,
    PrefixCacheStats,
    WarmupStats,
    CollectorStats,
):
    """The collector's metrics now (each named after its Prometheus series without
    the `vllm_runbook_` prefix; counters end in `_total`), then the windowed
    request outcomes. null: not defined now (no lookup, no finished request).
    One flat object: its fields are declared per concern by the bases above."""


class GpuReading(_Answer):
    memory_used_bytes: float
    memory_total_bytes: float
    utilization_ratio: float


class GpuHardware(_Answer):
    """One GPU's hardware, read from NVML once at the first poll (metrics'
    GPU_HARDWARE_LABELS are these fields). null: NVML did not give it (`unread` says why)."""

    compute_capability: str | None = None
    """CUDA compute capability, "major.minor" (7.5 is Turing, 8.0 Ampere)."""
    pcie_link_generation: int | None = None
    """PCIe link generation at the first poll (NVML lowers an idle link's)."""
    pcie_link_generation_max: int | None = None
    """The most the link reaches with this GPU and system (the slot included)."""
    pcie_link_generation_gpu_max: int | None = None
    """The most the GPU itself supports."""
    pcie_link_width: int | None = None
    """PCIe lanes at the first poll."""
    unread: dict[str, str] = {}
    """Field name -> NVML's error, for each field NVML did not give."""


class Gpus(_Answer):
    nvml_up: bool
    """NVML answered and sees a GPU (False where there is no NVIDIA driver)."""
    per_gpu: dict[str, GpuReading]
    """By NVML index, at the latest poll."""
    hardware: dict[str, GpuHardware] = {}
    """By NVML index, read once at the first poll; empty from an agent older than it."""


class ScheduleHistogram(_Answer):
    """schedule() wall time since the engine started."""

    bounds: list[float]
    """Upper bounds (le) of the buckets; +Inf is the last count."""
    cumulative: list[int]
    """Cumulative counts, one per bound and one for +Inf."""
    sum_seconds: float = 0.0
    """schedule()'s wall time summed (seconds): its increase over an interval in
    which requests ran is the share of the engine's time spent scheduling."""


class _Since(_Answer):
    from_step: int
    """The step asked about (a change's effective_from_step)."""


class DrainingSince(_Since):
    """A lower admission limit not in effect yet: more requests run than it admits."""

    settled: Literal[False]
    requests_running: Annotated[int, _was("requests_running", "num_requests_running")]
    max_num_seqs: int


class Before(_Answer):
    """The same counters over as long a time just before the change (as far
    back as the agent's history holds): what the circuit breaker compares
    the time after a change with, so a fix is never blamed for the storm it
    answered."""

    seconds: float
    """How long the window before the change is (as close to `seconds` after it
    as the history's one-second samples allow; shorter where it does not reach back)."""
    preemptions: int
    requests_finished: int
    errors: int
    """Requests finished with reason `error`."""
    engine_e2e_latency_p99: float | None
    """Over the requests that finished in that window (None: none did)."""


class SettledSince(_Since):
    """What happened from the step the change took effect on (counter deltas and
    the requests finished since)."""

    settled: Literal[True]
    effective_step: int
    """The first step with the change in effect (later than from_step while it drained)."""
    from_time: float
    """Unix time of that step."""
    seconds: float
    steps: int
    preemptions: int
    preemptions_per_minute: float | None
    scheduled_tokens: int
    scheduled_tokens_per_second: Annotated[
        float | None, _was("scheduled_tokens_per_second", "throughput_tokens_per_second")
    ]
    kv_hit_ratio: float | None
    requests_finished: int
    finished_by_reason: dict[str, int]
    error_rate: float | None
    engine_e2e_latency_p99: Annotated[
        float | None, _was("engine_e2e_latency_p99", "p99_latency_seconds")
    ]
    engine_queue_time_p99: Annotated[
        float | None, _was("engine_queue_time_p99", "waiting_seconds_p99")
    ]
    starving_at_change: int = 0
    """The oldest requests (at most 8) waiting for their first schedule when the
    change took effect: the starving ones a starvation fix is for."""
    starving_oldest_seconds: float = 0.0
    """How long the oldest of them had waited then."""
    starving_waiting: int = 0
    """How many of them still wait for their first schedule."""
    admitted: int = 0
    """Requests scheduled for the first time since."""
    admitted_per_second_before: float | None = None
    """Requests scheduled for the first time per second over the window before the change."""
    before: Before | None = None
    """The same length of time before the change (None: no history before it)."""


Since = SettledSince | DrainingSince


class Extent(_Answer):
    """One gauge over the episode: its highest and its mean one-second sample."""

    peak: float
    mean: float


class Episode(_Answer):
    """The gauges a runbook's checks read, over a span ending now: what the
    finding's episode looked like, not only the instant of the read (a burst
    in waves read between two shows zeros). The agent samples them after a
    step, at most once a second (the same tick as the breaker's counters):
    an idle engine takes no sample, so peak and mean are over the seconds
    the engine stepped. A gauge is null where no sample in the span defines
    it (no sample at all, kv_capacity_seqs with nothing running, the GPU
    gauges without NVML)."""

    seconds: float
    """The span, seconds back from now: ?episode_seconds=N, at least the collector's
    window (`stats.window_seconds`, also the span without N), at most what the agent
    keeps (1800 s)."""
    kept_seconds: float
    """How far back the agent's samples reach now (the oldest one's age; 0: none):
    below `seconds`, the span starts before the history does."""
    samples: int
    """One-second samples in the span."""
    kv_cache_usage: Extent | None = None
    """KV blocks used / usable blocks."""
    kv_capacity_seqs: Extent | None = None
    """Sequences the KV cache holds at the running requests' average footprint then
    (usable blocks × running // used blocks), over the samples with a request running."""
    requests_running: Extent | None = None
    requests_waiting: Extent | None = None
    oldest_waiting: Extent | None = None
    """Seconds the oldest request waiting for its first schedule had waited then."""
    max_sequence_tokens: Extent | None = None
    """The longest context among the running requests (0 when none ran)."""
    block_fragmentation: Extent | None = None
    budget_fill: Extent | None = None
    length_padding_ratio: Extent | None = None
    gpu_utilization_max: Extent | None = None
    """The busiest GPU's utilisation at the latest NVML poll before each sample."""
    gpu_memory_used_max: Extent | None = None
    """The fullest GPU's memory used (bytes) at the latest NVML poll before each sample."""


# The signals an Episode carries (its Extent fields), by their signals' names.
EPISODE_SIGNALS: Final[tuple[str, ...]] = tuple(
    name for name in Episode.model_fields if name not in ("seconds", "kept_seconds", "samples")
)


class TierSettings(_Answer):
    boundaries: list[int]
    """Prompt tokens: hot < first ≤ warm < second ≤ cold."""
    limits: dict[str, int]
    """Running requests per tier at the current max_num_seqs."""
    shares: dict[str, float]
    """Share of the step's token budget per tier."""
    aging_seconds: float
    """A request waiting this long moves up one tier."""
    deadlines: dict[str, float | None] | None = None
    """Per tier: seconds waiting for a first schedule before a demotion (or an
    abort where the client asked); null for none. null from an agent older
    than this field."""


class TierNow(_Answer):
    waiting: int
    running: int
    oldest_waiting_seconds: float


class Tiers(_Answer):
    config: TierSettings
    now: dict[str, TierNow] | None
    """Per tier (hot, warm, cold); null when the scheduler lock was busy for 1 s."""


class QueuedRequest(_Answer):
    request_id: str
    tier: str
    prompt_tokens: int
    priority: int
    status: str
    waited_seconds: float


class Queues(_Answer):
    running: int
    waiting: int
    kv_holding_waiting: int
    pause_state: str | None
    oldest_waiting: list[QueuedRequest]
    """The requests waiting longest for their first schedule."""


class EngineConfig(_Answer):
    """The engine's configuration as vLLM resolved it at start (the same as the
    `vllm_runbook_engine_config_info` series). null: not set, or not applicable
    here (the device fields on CPU; `device_reason` says why). The collector
    builds it once, at start (collector/engine_config.py's read_engine_config)."""

    block_size: int
    """KV cache block size, tokens."""
    num_gpu_blocks: int
    """KV cache blocks allocated (usable; on CPU: in RAM)."""
    num_cpu_blocks: int | None
    gpu_memory_utilization: float
    """As vLLM sizes the KV cache with it (vLLM 0.34: resolved when not set)."""
    max_model_len: int
    max_num_seqs: int
    """At start (the live value is in `knobs`)."""
    max_num_active_seqs: int | None
    """vLLM's own admission limit below max_num_seqs, if set."""
    max_num_batched_tokens: int
    """At start (the live value is in `knobs`)."""
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    """0: no per-step chunk cap for long prompts."""
    enable_prefix_caching: bool
    enforce_eager: bool
    cudagraph_mode: str
    cudagraph_capture_sizes: list[int]
    kv_cache_dtype: str
    dtype: str
    quantization: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    speculative_method: str | None
    num_speculative_tokens: int | None
    scheduling_policy: str
    """The policy vLLM started with (the live one is in `knobs`)."""
    vllm_version: str
    platform: str
    """vLLM's platform device type: cuda, rocm, cpu, ..."""
    device_name: str | None
    sm_count: int | None
    """Streaming multiprocessors of the first GPU."""
    device_reason: str | None
    """Why device_name or sm_count is null."""
    extensible_kv_cache: bool = False
    """vLLM >= 0.34's extensible KV cache: sized from the memory free after
    warm-up; gpu_memory_utilization is then 1.0 unless set."""


class LengthSummary(_Answer):
    count: int
    p10: int | None
    p50: int | None
    p90: int | None
    p99: int | None
    max: int | None


class Workload(_Answer):
    """The workload as the engine sees it over the window (nearest-rank percentiles).
    vLLM's own vllm:request_prompt_tokens / vllm:request_generation_tokens
    histograms hold the same lengths since start, on the API server's /metrics."""

    window_seconds: float
    requests_arrived: int
    prompt_tokens: LengthSummary
    """Of the requests that reached the engine in the window."""
    output_tokens: LengthSummary
    """Of the requests that finished in the window."""
    prompt_length_spread_ratio: float | None
    """P90 / P10 of the prompt lengths (4 or more hurts batching)."""
    long_prompt_ratio: float | None
    """Share of prompts above 8192 tokens."""
    requests_in_engine_peak: int | None = None
    """The most requests in the engine at once (arrived, not finished) over the
    window; null from an agent older than this field."""
    requests_in_engine_mean: float | None = None
    """Requests in the engine over the window, time-weighted mean (Little's L)."""


class AgentState(_Answer):
    """GET /v1/state: the engine, its knobs and their bounds, and its statistics."""

    engine: EngineInfo
    collector_up: bool
    """False after the collector failed and disabled itself (the engine keeps serving)."""
    knobs: Knobs
    """Effective now."""
    startup: Knobs
    """At engine start: the ceilings, and what a restore returns to."""
    bounds: Bounds
    autopilot: AutopilotState
    stats: Stats
    gpus: Gpus
    schedule_histogram: ScheduleHistogram
    since: Since | None = None
    """With ?since_step=N: what happened from that step on (null: no change took effect there)."""
    tiers: Tiers
    queues: Queues | None
    """null when the scheduler lock was busy for 1 s."""
    config: EngineConfig | None = None
    """null from an agent older than this field."""
    workload: Workload | None = None
    """null from an agent older than this field."""
    episode: Episode | None = None
    """The checks' gauges over the collector's window, or ?episode_seconds=N (peak
    and mean beside the values now); null from an agent older than this field."""


# -- the schema ------------------------------------------------------------------

MODELS: Final[dict[str, type[BaseModel]]] = {
    "AgentState": AgentState,
    "KnobsCommand": KnobsCommand,
    "RestoreCommand": RestoreCommand,
    "ChangeResult": ChangeResult,
    "ErrorAnswer": ErrorAnswer,
}


def json_schema() -> dict[str, Any]:
    """One JSON Schema document with every request and answer under `$defs`."""
    from pydantic.json_schema import models_json_schema

    _, schema = models_json_schema(
        [(model, _mode(model)) for model in MODELS.values()],
        title="vllm-runbook engine agent API",
        description=(
            "GET /v1/state answers AgentState; POST /v1/knobs takes KnobsCommand and "
            "POST /v1/restore RestoreCommand (bearer token), both answer ChangeResult; "
            "every refusal is an ErrorAnswer. Generated from vllm_runbook.collector.agent_api."
        ),
    )
    return schema


def _mode(model: type[BaseModel]) -> Literal["validation", "serialization"]:
    # An answer is described as the agent sends it, a command as the agent accepts it.
    return "serialization" if issubclass(model, _Answer) else "validation"


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"
