"""Every metric the collector exports, declared once.

Dashboards, rules and tests import these names instead of retyping strings.
Each metric carries vLLM's own labels, `model_name` and `engine` (the DP
rank), plus the extra labels listed with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "vllm_runbook_"
BASE_LABELS = ("model_name", "engine")

MetricType = Literal["counter", "gauge", "histogram"]

# schedule() on a busy engine takes tens of µs to a few ms; 1 s means trouble.
SCHEDULE_SECONDS_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

# Per-request queue and end-to-end times: tens of ms on an idle engine to
# minutes in a storm (vLLM's own request histograms span the same range).
REQUEST_SECONDS_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full exposition name without the `_total` suffix of counters
    type: MetricType
    help: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = field(default=())
    gpu_only: bool = False  # series exist only where NVML finds a GPU
    # series exist only in an advisory mode (VLLM_RUNBOOK_AUTOPILOT=advisory)
    advisory_only: bool = False

    @property
    def series_name(self) -> str:
        """The name a PromQL query uses (counters gain `_total`)."""
        return self.name + "_total" if self.type == "counter" else self.name


def _spec(name: str, type_: MetricType, help_: str, **kw: object) -> MetricSpec:
    return MetricSpec(PREFIX + name, type_, help_, **kw)  # type: ignore[arg-type]


COLLECTOR_UP = _spec(
    "collector_up",
    "gauge",
    "1 while the collector hook works; 0 after it failed and disabled itself (the engine keeps serving).",
)
ENGINE_START_TIME = _spec(
    "engine_start_time_seconds",
    "gauge",
    "Unix time at which the scheduler (and so the engine) started.",
)
# The warm-up at engine start (collector/warmup.py, VLLM_RUNBOOK_WARMUP): zeros when off.
WARMUP_REQUESTS_PLANNED = _spec(
    "warmup_requests_planned",
    "gauge",
    "Requests the warm-up at engine start sends through the engine before it reports ready "
    "(VLLM_RUNBOOK_WARMUP; 0 when off or skipped).",
)
WARMUP_REQUESTS_DONE = _spec(
    "warmup_requests_done",
    "gauge",
    "Warm-up requests finished so far (of warmup_requests_planned).",
)
WARMUP_STEPS = _spec(
    "warmup_steps", "gauge", "Scheduler steps (schedule() calls) the warm-up ran so far."
)
WARMUP_TOKENS = _spec(
    "warmup_tokens",
    "gauge",
    "Tokens the warm-up's steps scheduled (prefill and decode), included in "
    "scheduled_tokens_total: subtract them for the throughput after the warm-up.",
)
WARMUP_SECONDS = _spec(
    "warmup_seconds",
    "gauge",
    "Wall time of the warm-up at engine start: so far while it runs, in total after.",
)
WARMUP_DONE = _spec(
    "warmup_done",
    "gauge",
    "1 once every planned warm-up request finished; 0 while it runs, and when it is off, "
    "skipped, failed or cut short by VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS (the engine is cold).",
)
PREFIX_CACHE_QUERIES = _spec(
    "prefix_cache_queries", "counter", "Tokens looked up in the prefix cache at admission."
)
PREFIX_CACHE_HITS = _spec(
    "prefix_cache_hits", "counter", "Tokens found in the prefix cache at admission."
)
KV_HIT_RATIO = _spec(
    "kv_hit_ratio",
    "gauge",
    "Prefix cache hits / queries over the sliding window (VLLM_RUNBOOK_WINDOW_SECONDS, default 60 s).",
)
BLOCK_FRAGMENTATION = _spec(
    "block_fragmentation_ratio",
    "gauge",
    "After the latest step: 1 - sum(num_computed_tokens) / sum(blocks held x block_size) over running requests; 0 when none run.",
)
# The block sizes the what-if fragmentation is computed for (vLLM's usual choices).
WHAT_IF_BLOCK_SIZES = (8, 16, 32, 64, 128)
BLOCK_FRAGMENTATION_AT = _spec(
    "block_fragmentation_at_block_size",
    "gauge",
    "After the latest step, what the fragmentation would be at another block size: "
    "1 - sum(num_computed_tokens) / sum(ceil(num_computed_tokens / block_size) x block_size) "
    "over running requests (equal to block_fragmentation_ratio at the engine's own size); "
    "0 when none run. The block-size sweep without a restart.",
    extra_labels=("block_size",),
)
PADDING_RATIO = _spec(
    "padding_ratio",
    "gauge",
    "sum(padded - unpadded) / sum(padded) tokens executed over the sliding window (cudagraph padding; 0 on CPU/eager).",
)
LENGTH_PADDING_RATIO = _spec(
    "length_padding_ratio",
    "gauge",
    "Latest step: 1 - sum(len) / (n x max len) over the scheduled requests' context lengths (padding a static batcher would need).",
)
SCHEDULE_SECONDS = _spec(
    "schedule_seconds",
    "histogram",
    "Wall time of one scheduler.schedule() call.",
    buckets=SCHEDULE_SECONDS_BUCKETS,
)
STEPS = _spec("steps", "counter", "Scheduler steps (schedule() calls).")
SCHEDULED_TOKENS = _spec(
    "scheduled_tokens", "counter", "Tokens scheduled over all steps (prefill and decode)."
)
TOKEN_BUDGET = _spec(
    "token_budget",
    "counter",
    "Token budget offered over all steps (effective max_num_batched_tokens per step); rate(scheduled)/rate(budget) is the budget fill.",
)
STEP_TOKENS = _spec("step_tokens", "gauge", "Tokens scheduled in the latest step.")
BUDGET_FILL = _spec(
    "budget_fill_ratio", "gauge", "Latest step: scheduled tokens / effective token budget."
)
PADDED_TOKENS = _spec(
    "padded_tokens",
    "counter",
    "Tokens executed including padding (cudagraph sizes); equals unpadded where nothing is padded.",
)
UNPADDED_TOKENS = _spec("unpadded_tokens", "counter", "Tokens executed without padding.")
REQUESTS_RUNNING = _spec("num_requests_running", "gauge", "Requests in the running queue.")
REQUESTS_WAITING = _spec(
    "num_requests_waiting", "gauge", "Requests waiting to be scheduled (including preempted ones)."
)
OLDEST_WAITING = _spec(
    "oldest_waiting_seconds",
    "gauge",
    "Seconds the oldest request still waiting for its first schedule has been in the engine's "
    "queue; 0 when none waits. Grows without bound while a request starves.",
)
LAST_STEP_AGE = _spec(
    "last_step_age_seconds",
    "gauge",
    "The scheduler's heartbeat: seconds since it last started or finished a step, read at "
    "scrape time without the scheduler lock (grows while an engine is idle, too).",
)
ENGINE_STALLED = _spec(
    "engine_stalled",
    "gauge",
    "1 while the engine makes no progress with requests waiting or running (a step "
    "hung, no step at all, or nothing admitted while KV is free: engine_stall_reason "
    "says which); 0 otherwise. Its /health may still answer 200.",
)
ENGINE_STALL_REASON = _spec(
    "engine_stall_reason",
    "gauge",
    "1 for the reason the engine makes no progress now (step_hung, no_steps, "
    "admission_stalled), 0 for the others.",
    extra_labels=("reason",),
)
PREEMPTIONS = _spec(
    "preemptions", "counter", "Requests preempted (KV blocks freed, request sent back to waiting)."
)
MAX_SEQUENCE_TOKENS = _spec(
    "max_sequence_tokens",
    "gauge",
    "After the latest step: the longest context (computed prompt + generated tokens) among running requests; 0 when none run.",
)
REQUESTS_FINISHED = _spec(
    "requests_finished",
    "counter",
    "Requests the engine finished, by vLLM's finish reason (stop, length, abort, error, repetition).",
    extra_labels=("reason",),
)
REQUEST_QUEUE_SECONDS = _spec(
    "request_queue_seconds",
    "histogram",
    "Per finished request: seconds from its arrival in the engine to its first schedule "
    "(to its finish if never scheduled), recorded when it finishes.",
    buckets=REQUEST_SECONDS_BUCKETS,
)
REQUEST_E2E_SECONDS = _spec(
    "request_e2e_seconds",
    "histogram",
    "Per finished request: seconds from its arrival in the engine to its finish, "
    "recorded when it finishes.",
    buckets=REQUEST_SECONDS_BUCKETS,
)
KV_BLOCKS_USED = _spec(
    "kv_blocks_used",
    "gauge",
    "KV cache blocks held by requests (excludes the null block and free cached blocks).",
)
KV_BLOCKS_FREE = _spec(
    "kv_blocks_free", "gauge", "KV cache blocks free (including evictable prefix-cached blocks)."
)
KV_CACHE_USAGE = _spec(
    "kv_cache_usage_ratio",
    "gauge",
    "KV blocks used / usable blocks (vLLM's own definition, available without stats logging).",
)
KV_CACHE_USAGE_PEAK = _spec(
    "kv_cache_usage_peak_ratio",
    "gauge",
    "Highest KV cache usage over the window, sampled at the start of each step (before the scheduler allocates or preempts): a preemption frees blocks, so the usage after the step hides the pressure that caused it.",
)
MAX_NUM_BATCHED_TOKENS = _spec(
    "max_num_batched_tokens", "gauge", "Effective token budget per step now."
)
MAX_NUM_SEQS = _spec("max_num_seqs", "gauge", "Effective admission limit (running sequences) now.")
STARTUP_MAX_NUM_BATCHED_TOKENS = _spec(
    "startup_max_num_batched_tokens",
    "gauge",
    "Token budget the engine started with (the ceiling for any runtime change).",
)
STARTUP_MAX_NUM_SEQS = _spec(
    "startup_max_num_seqs",
    "gauge",
    "max_num_seqs the engine started with (the ceiling for any runtime change).",
)
SCHEDULER_POLICY = _spec(
    "scheduler_policy",
    "gauge",
    "1 for the active scheduling policy, 0 for the others.",
    extra_labels=("policy",),
)
TIER_REQUESTS_WAITING = _spec(
    "tier_requests_waiting",
    "gauge",
    "Requests waiting (preempted included), by prompt-length tier: hot < 256 prompt tokens, "
    "warm < 1024, cold (VLLM_RUNBOOK_TIER_BOUNDARIES), whatever the policy.",
    extra_labels=("tier",),
)
TIER_REQUESTS_RUNNING = _spec(
    "tier_requests_running",
    "gauge",
    "Requests in the running queue, by prompt-length tier.",
    extra_labels=("tier",),
)
TIER_OLDEST_WAITING = _spec(
    "tier_oldest_waiting_seconds",
    "gauge",
    "Per tier: seconds the oldest request still waiting for its first schedule has been in the "
    "engine; 0 when none waits.",
    extra_labels=("tier",),
)
TIER_QUEUE_SECONDS = _spec(
    "tier_queue_seconds",
    "histogram",
    "Per tier: seconds from a request's arrival in the engine to its first schedule, "
    "recorded at the first schedule.",
    extra_labels=("tier",),
    buckets=REQUEST_SECONDS_BUCKETS,
)
TIER_DEADLINE_DEMOTIONS = _spec(
    "tier_deadline_demotions",
    "counter",
    "Under the tiered policy: requests demoted one tier because they waited for their first "
    "schedule past the deadline of `tier` (VLLM_RUNBOOK_TIER_DEADLINES, default hot 0.1 s, "
    "warm 1 s, cold none).",
    extra_labels=("tier",),
)
TIER_DEADLINE_ABORTS = _spec(
    "tier_deadline_aborts",
    "counter",
    "Under the tiered policy: requests aborted at the deadline of `tier` because their client "
    "asked (extra_args / vllm_xargs vllm_runbook_on_deadline=abort); finish_reason abort, the "
    "reason in stop_reason.",
    extra_labels=("tier",),
)
AUTOPILOT_ENABLED = _spec(
    "autopilot_enabled",
    "gauge",
    "1 while the autopilot adjusts max_num_seqs; 0 when off (by hand, by a restore, or after an error).",
)
AUTOPILOT_ADVISED_MAX_NUM_SEQS = _spec(
    "autopilot_advised_max_num_seqs",
    "gauge",
    "In advisory mode (VLLM_RUNBOOK_AUTOPILOT=advisory): the max_num_seqs the autopilot would "
    "set now; it changes nothing. Absent otherwise.",
    advisory_only=True,
)
AUTOPILOT_KV_TARGET = _spec(
    "autopilot_kv_target_ratio",
    "gauge",
    "The autopilot's target peak KV cache usage (VLLM_RUNBOOK_AUTOPILOT_TARGET or `runbook set autopilot_target=`): it climbs while the peak stays below.",
)
AUTOPILOT_KV_HIGH = _spec(
    "autopilot_kv_high_ratio",
    "gauge",
    "The upper edge of the autopilot's band (target + 0.05, at most 1): a peak above it cuts max_num_seqs.",
)
AUTOPILOT_CHANGES = _spec(
    "autopilot_changes",
    "counter",
    "max_num_seqs changes the autopilot made, by direction (up, down).",
    extra_labels=("direction",),
)
# The engine's configuration (collector/engine_config.py): one info series
# with the string fields as labels, and numeric gauges for what rules compare.
CONFIG_INFO_LABELS = (
    "block_size",
    "num_gpu_blocks",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
    "enforce_eager",
    "cudagraph_mode",
    "kv_cache_dtype",
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "speculative_method",
    "num_speculative_tokens",
    "scheduling_policy",
    "vllm_version",
    "platform",
    "device_name",
    "sm_count",
)
ENGINE_CONFIG_INFO = _spec(
    "engine_config_info",
    "gauge",
    "Always 1; the labels are the engine's configuration as vLLM resolved it at start "
    "(empty where not set or not applicable, e.g. device_name and sm_count on CPU).",
    extra_labels=CONFIG_INFO_LABELS,
)
CONFIG_BLOCK_SIZE = _spec("config_block_size", "gauge", "KV cache block size (tokens per block).")
CONFIG_NUM_GPU_BLOCKS = _spec(
    "config_num_gpu_blocks", "gauge", "KV cache blocks the engine allocated (usable ones)."
)
CONFIG_GPU_MEMORY_UTILIZATION = _spec(
    "config_gpu_memory_utilization",
    "gauge",
    "--gpu-memory-utilization: the share of device memory vLLM may use (on CPU: of RAM for KV); "
    "vLLM 0.34: as resolved when not set, 1.0 with its extensible KV cache.",
)
CONFIG_MAX_MODEL_LEN = _spec("config_max_model_len", "gauge", "Longest context the engine accepts.")
CONFIG_CHUNKED_PREFILL = _spec(
    "config_chunked_prefill", "gauge", "1 when chunked prefill is on, 0 when off."
)
CONFIG_GPU_SM_COUNT = _spec(
    "config_gpu_sm_count",
    "gauge",
    "Streaming multiprocessors of the engine's first GPU (NVML cores / cores per SM).",
    gpu_only=True,
)
# The workload as the engine sees it, over the window: what vLLM's own
# vllm:request_prompt_tokens / vllm:request_generation_tokens histograms do not give.
PROMPT_LENGTH_SPREAD = _spec(
    "prompt_length_spread_ratio",
    "gauge",
    "P90 / P10 of the prompt lengths (tokens) of requests that reached the engine in the "
    "window (nearest rank; NaN when none arrived). 4 or more is the spread that hurts batching.",
)
LONG_PROMPT_RATIO = _spec(
    "long_prompt_ratio",
    "gauge",
    "Share of requests that reached the engine in the window with a prompt above 8192 tokens "
    "(NaN when none arrived).",
)
NVML_UP = _spec(
    "nvml_up",
    "gauge",
    "1 when NVML answered at the latest poll; 0 where there is no NVIDIA driver (no GPU series then).",
)
GPU_MEMORY_USED = _spec(
    "gpu_memory_used_bytes",
    "gauge",
    "GPU memory in use (NVML), per GPU.",
    extra_labels=("gpu",),
    gpu_only=True,
)
GPU_MEMORY_TOTAL = _spec(
    "gpu_memory_total_bytes",
    "gauge",
    "GPU memory in total (NVML), per GPU.",
    extra_labels=("gpu",),
    gpu_only=True,
)
GPU_UTILIZATION = _spec(
    "gpu_utilization_ratio",
    "gauge",
    "GPU compute utilisation over NVML's last sample period, 0..1, per GPU.",
    extra_labels=("gpu",),
    gpu_only=True,
)
GPU_DRAM_UTILIZATION = _spec(
    "gpu_dram_utilization_ratio",
    "gauge",
    "Share of NVML's last sample period during which device memory (DRAM) was read or "
    "written (nvmlDeviceGetUtilizationRates().memory), 0..1, per GPU: the memory "
    "controller's busy time, NVML's nearest figure to DRAM bandwidth utilisation.",
    extra_labels=("gpu",),
    gpu_only=True,
)
GPU_MEMORY_USED_PEAK = _spec(
    "gpu_memory_used_peak_bytes",
    "gauge",
    "Highest GPU memory in use at any NVML poll (VLLM_RUNBOOK_NVML_INTERVAL, default 1 s) "
    "over the window (VLLM_RUNBOOK_WINDOW_SECONDS, default 60 s), per GPU: a short peak "
    "between two scrapes stays visible for a window.",
    extra_labels=("gpu",),
    gpu_only=True,
)
# Per GPU, read once at the first poll (they do not change while the engine runs):
# what `runbook check`'s hardware line judges. The label names are the fields of
# /v1/state's `gpus.hardware` (collector/agent_api.py's GpuHardware).
GPU_HARDWARE_LABELS = (
    "compute_capability",
    "pcie_link_generation",
    "pcie_link_generation_max",
    "pcie_link_generation_gpu_max",
    "pcie_link_width",
)
GPU_HARDWARE_INFO = _spec(
    "gpu_hardware_info",
    "gauge",
    "Always 1, per GPU; the labels are read from NVML once, at the first poll: the CUDA "
    "compute capability (7.5 is Turing), the PCIe link generation at that poll (an idle "
    "link may run slower), the most the link reaches with this GPU and system, the most "
    "the GPU supports, and the link width (lanes). Empty where NVML did not give one.",
    extra_labels=("gpu", *GPU_HARDWARE_LABELS),
    gpu_only=True,
)

ALL_METRICS: tuple[MetricSpec, ...] = tuple(
    v for v in globals().values() if isinstance(v, MetricSpec)
)
# Written by the NVML poller thread into real gauges; everything else is
# produced at scrape time from the hook's plain counters.
NVML_METRICS = (
    NVML_UP,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_UTILIZATION,
    GPU_DRAM_UTILIZATION,
    GPU_MEMORY_USED_PEAK,
    GPU_HARDWARE_INFO,
)
# The configuration series: in /v1/state's `config`, not in its `stats`.
CONFIG_METRICS = (
    ENGINE_CONFIG_INFO,
    CONFIG_BLOCK_SIZE,
    CONFIG_NUM_GPU_BLOCKS,
    CONFIG_GPU_MEMORY_UTILIZATION,
    CONFIG_MAX_MODEL_LEN,
    CONFIG_CHUNKED_PREFILL,
    CONFIG_GPU_SM_COUNT,
)
LONG_PROMPT_TOKENS = 8192
METRICS_BY_NAME = {m.name: m for m in ALL_METRICS}

POLICIES = ("fcfs", "priority", "tiered")
TIERS = ("hot", "warm", "cold")


def build(spec: MetricSpec, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """Create the prometheus_client object for `spec` on `registry`.

    Gauges use multiprocess_mode="mostrecent" so that, when vLLM runs with
    PROMETHEUS_MULTIPROC_DIR, its own /metrics shows the latest value.
    """
    labels = BASE_LABELS + spec.extra_labels
    if spec.type == "counter":
        return Counter(spec.name, spec.help, labels, registry=registry)
    if spec.type == "histogram":
        return Histogram(spec.name, spec.help, labels, registry=registry, buckets=spec.buckets)
    return Gauge(spec.name, spec.help, labels, registry=registry, multiprocess_mode="mostrecent")


def build_gauge(spec: MetricSpec, registry: CollectorRegistry) -> Gauge:
    assert spec.type == "gauge", spec.name
    gauge = build(spec, registry)
    assert isinstance(gauge, Gauge)
    return gauge
