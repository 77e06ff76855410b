"""`runbook check`'s configuration checks: the engine's resolved configuration
(`/v1/state` `config`) against the field reports' advice, given the workload
the engine measured (`workload`, the what-if fragmentation).

Each check prints the reports' reason, the measured value and pass / warn /
fail / n/a (n/a says why: no GPU, no request arrived in the window). A warn
never fails `runbook check`; a fail does.

    token budget       2048 the reports' safe threshold (warn above), 2000-3000 their best range
    block size         8 for 50-300-token chat, 16 over 32 (fragmentation), 32 for documents
                       over 3k tokens, 64 for 32k contexts (about 5 % more memory), 128
                       beyond 64k; the what-if fragmentation < 15 %
    chunked prefill    on when prompts of 8k+ tokens arrive; the reports' A/B figures in the
                       note (8k/32k prefill faster, about 5 % of short-prompt throughput)
    memory headroom    gpu_memory_utilization <= 0.85 (the reports' critical point),
                       > 0.90 an OOM risk (at least 10 % headroom); 0.05 lower at block 64
    max_num_seqs       on an A100 the reports' measurement (72 best, above 80 L1 hit rate
                       falls), elsewhere about SMs x 1.5
    policy             tiered when the prompt length spread P90/P10 is 4:1 or more and more
                       than 20 requests are in the engine at once
    hardware           compute capability above 7.5 (Turing) and a PCIe link above 3.0
                       (rules/hardware_check.py)

Block size by measurement, both ways (`block_size_direction`, the throughput-drop
runbook's advice): smaller blocks when the what-if fragmentation says the KV
slots are wasted, larger ones when schedule() (block management included) takes
a large share of the engine's time; and the reports' sweep (`block_size_sweep`,
`runbook tune`'s step 2): from 16 down, the first size with GPU utilisation
above 90 % and fragmentation below 15 %.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from vllm_runbook.collector.agent_api import AgentState, EngineConfig, Workload
from vllm_runbook.collector.metrics import WHAT_IF_BLOCK_SIZES
from vllm_runbook.rules.checklist import CheckResult, Status
from vllm_runbook.rules.hardware_check import check_hardware

BUDGET_SAFE, BUDGET_BEST = 2048, (2000, 3000)
FRAGMENTATION_GOAL = 0.15
# The production checklist's fragmentation limit (rules/checklist.py: < 20 %).
FRAGMENTATION_LIMIT = 0.20
HEADROOM_CRITICAL, HEADROOM_RISK = 0.85, 0.90
SEQS_PER_SM = 1.5
# The reports' A100 measurement: 72 gave 11 % more throughput than 64, above 80
# the L1 cache hit rate fell.
A100_SEQS_BEST, A100_SEQS_LIMIT = 72, 80
SPREAD_TIERED = 4.0
# The reports' hybrid policy: about +2 ms of scheduling a step against 15-30 ms of
# computation saved, a gain that shows above 20 concurrent requests.
CONCURRENCY_TIERED = 20
LONG_PROMPT = 8192
# Documents over 3k tokens: the reports' summarisation service ran block size 32.
DOCUMENT_PROMPT = 3000
# Block size 64 over 32: about 5 % more memory (the reports), kept as headroom.
BLOCK_64_MEMORY = 0.05
# schedule()'s share of the engine's time: 3 % normally, 15 % where the block
# manager's cost took over (the reports, batches above 24).
SCHEDULE_SHARE_HIGH = 0.15
# The reports' sweep: `for block_size in [16, 12, 8, 4]`, stop at the first with
# gpu_util > 90 % and frag_rate < 15 %. vLLM takes 16 and 8 of those sizes, and
# the what-if series has them.
SWEEP_START = 16
SWEEP_UTILIZATION = 0.90


def _result(
    name: str, limit: str, status: Status, value: float | None, shown: str, note: str
) -> CheckResult:
    return CheckResult(name, limit, status, value, shown, note)


def recommended_block_size(p50_prompt: int, p99_context: int) -> int:
    """The reports' block size for a length mix (tokens)."""
    if p99_context > 65_536:
        return 128
    if p99_context >= 32_768:
        return 64
    if p50_prompt > DOCUMENT_PROMPT:
        return 32
    if p50_prompt <= 300 and p99_context <= 1_024:
        return 8
    return 16


def valid_block_sizes(platform: str) -> tuple[int, ...]:
    """The what-if block sizes vLLM takes on `platform` (on the CPU: multiples of 32)."""
    if platform == "cpu":
        return tuple(b for b in WHAT_IF_BLOCK_SIZES if b % 32 == 0)
    return WHAT_IF_BLOCK_SIZES


def block_64_memory_note(util: float) -> str:
    """The reports' side effect of block size 64, as the utilisation to restart with."""
    lower = round(min(util, HEADROOM_CRITICAL) - BLOCK_64_MEMORY, 2)
    return (
        f"block size 64 costs about {100 * BLOCK_64_MEMORY:.0f}% more memory (the reports): "
        f"keep it as headroom, --gpu-memory-utilization {lower:g}"
    )


def context_fragmentation(tokens: int, block_size: int) -> float:
    """The share of a request's blocks left empty: 1 - tokens / (blocks x block size)."""
    blocks = -(-tokens // block_size)
    return 1.0 - tokens / (blocks * block_size) if blocks else 0.0


def block_size_advice(config: EngineConfig, workload: Workload) -> tuple[int, str]:
    """The block size to restart with for the window's length mix, and the reports'
    reason (`runbook check` and `runbook tune` both give this advice)."""
    p50 = int(workload.prompt_tokens.p50 or 0)
    p99 = int(workload.prompt_tokens.p99 or p50) + int(workload.output_tokens.p99 or 0)
    advice = recommended_block_size(p50, p99)
    reason = (
        f"the reports: 8 for 50-300-token chat, 16 over 32, 32 for documents over 3k "
        f"tokens, 64 for 32k contexts, 128 beyond 64k; this mix (P50 prompt {p50}, "
        f"P99 context {p99}) → {advice}"
    )
    if config.platform == "cpu" and advice % 32:
        reason += "; on CPU vLLM takes multiples of 32 only"
        advice = 32
    return advice, reason


def _pct(ratio: float) -> str:
    return f"{100 * ratio:.0f}%"


@dataclass(frozen=True)
class BlockSizeEvidence:
    """What was measured on the engine to choose a block size by."""

    block_size: int
    platform: str
    fragmentation: Mapping[int, float]
    """What-if fragmentation by block size (mean over reads with requests running);
    empty when no request ran."""
    schedule_share: float | None
    """schedule()'s seconds per second of the engine's time while requests ran."""
    schedule_seconds_per_step: float | None = None
    gpu_utilization: float | None = None
    """Highest GPU utilisation (NVML), None without a GPU."""


@dataclass(frozen=True)
class BlockSizeDirection:
    direction: Literal["smaller", "larger", "keep"]
    block_size: int | None
    """The size to restart with; None: keep the engine's, or none vLLM takes here."""
    text: str


def block_size_direction(e: BlockSizeEvidence) -> BlockSizeDirection:
    """Smaller blocks when fragmentation wastes the KV slots, larger ones when
    schedule() (block management) takes the engine's time: each the reports'
    (16 over 32 against fragmentation; "too small blocks add management cost",
    and exception 3: throughput down → a larger block size), chosen by which one
    was measured high."""
    own = e.fragmentation.get(e.block_size)
    if own is None:
        return BlockSizeDirection(
            "keep", None, "no request ran while measuring: no fragmentation to judge by"
        )
    share = e.schedule_share
    measured = f"fragmentation {_pct(own)} at {e.block_size} (goal < {_pct(FRAGMENTATION_GOAL)})"
    if share is None:
        measured += ", schedule() share not measured (no requests ran between two reads)"
    else:
        per_step = e.schedule_seconds_per_step
        measured += f", schedule() {_pct(share)} of the engine's time" + (
            f" ({1000 * per_step:.2f} ms a step)" if per_step is not None else ""
        )
        measured += (
            f" (the reports: 3% normal, {_pct(SCHEDULE_SHARE_HIGH)} when block management "
            "dominates)"
        )
    if e.gpu_utilization is not None:
        measured += f", GPU utilisation {_pct(e.gpu_utilization)}"
    fragmented = own >= FRAGMENTATION_GOAL
    scheduling = share is not None and share >= SCHEDULE_SHARE_HIGH
    valid = valid_block_sizes(e.platform)
    restriction = "; vLLM on the CPU takes multiples of 32 only" if e.platform == "cpu" else ""
    if fragmented and scheduling:
        return BlockSizeDirection(
            "keep", None,
            f"{measured}: both high, and a block size trades one for the other; keep "
            f"{e.block_size} and look at the batch (max_num_seqs) first",
        )  # fmt: skip
    if scheduling:
        larger = sorted(b for b in e.fragmentation if b > e.block_size)
        if not larger:
            return BlockSizeDirection(
                "keep", None, f"{measured}: {e.block_size} is the largest size measured"
            )
        size = larger[0]
        at = e.fragmentation[size]
        if at >= FRAGMENTATION_LIMIT:
            return BlockSizeDirection(
                "keep", None,
                f"{measured}: larger blocks would help scheduling, but at {size} the "
                f"fragmentation would be {_pct(at)} (the checklist's limit "
                f"{_pct(FRAGMENTATION_LIMIT)}); keep {e.block_size}",
            )  # fmt: skip
        if size not in valid:
            return BlockSizeDirection(
                "larger", None, f"{measured}: larger blocks; {size} is not a size vLLM takes here"
            )
        return BlockSizeDirection(
            "larger", size,
            f"{measured}: larger blocks, fewer to manage: restart with --block-size {size} "
            f"(fragmentation there {_pct(at)})",
        )  # fmt: skip
    if fragmented:
        smaller = sorted((b for b in e.fragmentation if b < e.block_size), reverse=True)
        if not smaller:
            return BlockSizeDirection(
                "keep", None, f"{measured}: {e.block_size} is the smallest size measured"
            )
        # The largest smaller size that meets the goal (least management cost),
        # else the smallest measured.
        size = next((b for b in smaller if e.fragmentation[b] < FRAGMENTATION_GOAL), smaller[-1])
        at = e.fragmentation[size]
        if size not in valid:
            fits = [b for b in smaller if b in valid]
            if not fits:
                return BlockSizeDirection(
                    "smaller", None,
                    f"{measured}: smaller blocks (at {size} the fragmentation would be "
                    f"{_pct(at)}), but none smaller than {e.block_size} here{restriction}",
                )  # fmt: skip
            size, at = fits[-1], e.fragmentation[fits[-1]]
        return BlockSizeDirection(
            "smaller", size,
            f"{measured}: smaller blocks, fewer empty slots: restart with --block-size {size} "
            f"(fragmentation there {_pct(at)})",
        )  # fmt: skip
    return BlockSizeDirection(
        "keep", None,
        f"{measured}: neither is high; the block size is not what costs throughput here",
    )  # fmt: skip


@dataclass(frozen=True)
class SweepPoint:
    block_size: int
    fragmentation: float
    utilization: float | None
    """Measured only at the engine's own size (the others need a restart)."""
    meets: bool


@dataclass(frozen=True)
class BlockSizeSweep:
    points: tuple[SweepPoint, ...]
    block_size: int | None
    """The sweep's size, a size vLLM takes here; None: no what-if measured."""
    text: str


def sweep_sizes(start: int = SWEEP_START) -> tuple[int, ...]:
    """The what-if sizes from `start` down to 8, largest first."""
    return tuple(sorted((b for b in WHAT_IF_BLOCK_SIZES if 8 <= b <= start), reverse=True))


def block_size_sweep(
    fragmentation: Mapping[int, float],
    own: int,
    gpu_utilization: float | None,
    platform: str,
    start: int = SWEEP_START,
) -> BlockSizeSweep:
    """The reports' step 2 on the what-if series: from 16 (`start`) down, the first
    size with fragmentation < 15 % and GPU utilisation > 90 %. Utilisation is
    measured at the engine's own size only; elsewhere it waits for the restart (said)."""
    if not fragmentation:
        return BlockSizeSweep((), None, "no request ran: no what-if fragmentation to sweep")
    sizes = sweep_sizes(start)
    points = []
    chosen: SweepPoint | None = None
    for size in sizes:
        if size not in fragmentation:
            continue
        util = gpu_utilization if size == own else None
        frag = fragmentation[size]
        meets = frag < FRAGMENTATION_GOAL and (util is None or util > SWEEP_UTILIZATION)
        point = SweepPoint(size, frag, util, meets)
        points.append(point)
        if meets:
            chosen = point
            break
    walked = ", ".join(
        f"{p.block_size}: {_pct(p.fragmentation)}"
        + (f" at {_pct(p.utilization)} GPU" if p.utilization is not None else "")
        for p in points
    )
    rule = (
        f"the reports' sweep from {start} down, the first size with fragmentation < "
        f"{_pct(FRAGMENTATION_GOAL)} and GPU utilisation > {_pct(SWEEP_UTILIZATION)} ({walked})"
    )
    if chosen is None:
        # The reports' loop ends at its last size when none breaks it.
        chosen = points[-1] if points else None
        if chosen is None:
            return BlockSizeSweep((), None, "no what-if fragmentation at the sweep's sizes")
        rule += f": none meets both, the loop ends at {chosen.block_size}"
    else:
        rule += f": {chosen.block_size}"
        if chosen.utilization is None:
            rule += " (its GPU utilisation is measured after the restart)"
    size = chosen.block_size
    valid = valid_block_sizes(platform)
    if size not in valid:
        # On the CPU: the smallest size vLLM takes instead (least fragmentation).
        fallback = min(valid)
        at = fragmentation.get(fallback)
        rule += f"; vLLM on the CPU takes multiples of 32 only: {fallback}" + (
            f" (fragmentation {_pct(at)})" if at is not None else ""
        )
        size = fallback
    return BlockSizeSweep(tuple(points), size, rule)


def gpu_utilization_max(state: AgentState) -> float | None:
    """The highest GPU utilisation at the latest NVML poll (None without a GPU)."""
    gpus = state.gpus
    if not gpus.nvml_up or not gpus.per_gpu:
        return None
    return max(g.utilization_ratio for g in gpus.per_gpu.values())


def what_if_fragmentation(state: AgentState) -> dict[int, float]:
    """The what-if fragmentation by block size after the latest step ({} when none ran)."""
    if not state.stats.requests_running:
        return {}
    return {int(k): v for k, v in state.stats.block_fragmentation_at_block_size.items()}


def tune_block_size(state: AgentState) -> tuple[int | None, str]:
    """`runbook tune`'s step 2: the block size to restart with, and why. The reports'
    sweep on the running requests' what-if fragmentation, from 16 down (from the
    length mix's size where the reports name a larger one: documents, 32k
    contexts); with nothing running, the length mix alone."""
    config, workload = state.config, state.workload
    if config is None:
        return None, "the agent does not report its config"
    mix: int | None = None
    mix_why = "no request reached the engine in the window: no length mix"
    if workload is not None and workload.prompt_tokens.p50 is not None:
        mix, mix_why = block_size_advice(config, workload)
    what_if = what_if_fragmentation(state)
    if not what_if:
        return mix, f"no request running to sweep; {mix_why}"
    start = max(SWEEP_START, mix or SWEEP_START)
    sweep = block_size_sweep(
        what_if, config.block_size, gpu_utilization_max(state), config.platform, start
    )
    why = sweep.text
    if sweep.block_size == 64 and config.platform != "cpu":
        why += "; " + block_64_memory_note(config.gpu_memory_utilization)
    return sweep.block_size, why


def check_token_budget(state: AgentState) -> CheckResult:
    name, limit = "token budget", "<= 2048 (2000-3000)"
    budget = state.knobs.max_num_batched_tokens
    workload = state.workload
    p90 = workload.prompt_tokens.p90 if workload is not None else None
    low, high = BUDGET_BEST
    if budget > high:
        return _result(
            name, limit, "warn", budget, str(budget),
            f"above the reports' best range {low}-{high} and their safe threshold "
            f"{BUDGET_SAFE}: per-step activation memory is their first OOM cause",
        )  # fmt: skip
    if budget > BUDGET_SAFE:
        return _result(
            name, limit, "warn", budget, str(budget),
            f"above the reports' safe threshold {BUDGET_SAFE} (their edge: 0% OOM at 2048, "
            f"5.2% at 4096), though inside their best range {low}-{high}",
        )  # fmt: skip
    if budget < low and p90 is not None and p90 > budget:
        return _result(
            name, limit, "warn", budget, str(budget),
            f"below the prompts' P90 ({p90} tokens): a typical prompt needs several "
            f"prefill steps (the reports' best range is {low}-{high})",
        )  # fmt: skip
    note = "" if budget >= low else f"below {low}, but above the prompts' P90 ({p90})"
    if budget < low and p90 is None:
        note = f"below the reports' range {low}-{high}; no prompt measured to weigh it"
    return _result(name, limit, "pass", budget, str(budget), note)


def check_block_size(state: AgentState) -> CheckResult:
    name, limit = "block size", "by length mix"
    config, workload = state.config, state.workload
    if config is None:
        return _result(name, limit, "n/a", None, "n/a", "the agent does not report its config")
    if workload is None or workload.prompt_tokens.p50 is None:
        return _result(
            name, limit, "n/a", None, "n/a",
            "no request reached the engine in the window: no length mix to judge by",
        )  # fmt: skip
    advice, reason = block_size_advice(config, workload)
    p50 = int(workload.prompt_tokens.p50)
    if state.stats.requests_running:
        # The live requests' fragmentation, at this block size and the others.
        what_if = state.stats.block_fragmentation_at_block_size
        own = what_if.get(str(config.block_size), state.stats.block_fragmentation)
        at_advice = what_if.get(str(advice))
        shown = f"{config.block_size} (frag {100 * own:.0f}%)"
    else:
        # Nothing runs now (the live fragmentation reads 0): the window's median
        # request instead, prompt and output, as it would sit in its blocks.
        context = p50 + int(workload.output_tokens.p50 or 0)
        own, at_advice = context_fragmentation(context, config.block_size), None
        if advice != config.block_size:
            at_advice = context_fragmentation(context, advice)
        shown = f"{config.block_size} (frag {100 * own:.0f}% at the P50 context {context})"
    if advice == 64 and config.platform != "cpu":
        memory = "; " + block_64_memory_note(config.gpu_memory_utilization)
    else:
        memory = ""
    if config.block_size == advice:
        return _result(name, limit, "pass", config.block_size, shown, reason + memory)
    if at_advice is not None:
        reason += f" (fragmentation there {100 * at_advice:.0f}%)"
    status: Status = "warn" if own >= FRAGMENTATION_GOAL else "pass"
    return _result(
        name, limit, status, config.block_size, shown, reason + "; restart to change" + memory
    )


def check_chunked_prefill(state: AgentState) -> CheckResult:
    name, limit = "chunked prefill", "on for 8k+"
    config, workload = state.config, state.workload
    if config is None:
        return _result(name, limit, "n/a", None, "n/a", "the agent does not report its config")
    on = config.enable_chunked_prefill
    shown = "on" if on else "off"
    long_share = workload.long_prompt_ratio if workload is not None else None
    if on:
        # The reports' A/B (step 3): what chunked prefill bought and cost them.
        note = ""
        if long_share is not None and long_share > 0:
            note = (
                f"{100 * long_share:.1f}% of prompts are above {LONG_PROMPT} tokens: the "
                "reports' A/B measured 8k prefills 320 → 290 ms, 32k 2,100 → 1,250 ms with it on"
            )
        elif long_share is not None:
            note = (
                f"no prompt above {LONG_PROMPT} tokens: the reports' A/B measured about 5% "
                "less short-prompt throughput with it on; `benchmarks/chunked_prefill.py` "
                "runs that A/B on two engines"
            )
        return _result(name, limit, "pass", 1.0, shown, note)
    if long_share is None:
        return _result(
            name, limit, "n/a", 0.0, shown,
            "off, and no request reached the engine in the window to say whether 8k+ prompts come",
        )  # fmt: skip
    if long_share > 0:
        return _result(
            name, limit, "fail", 0.0, shown,
            f"{100 * long_share:.1f}% of prompts are above {LONG_PROMPT} tokens: the reports "
            "turn chunked prefill on for them (a whole long prefill stalls every decode)",
        )  # fmt: skip
    return _result(name, limit, "pass", 0.0, shown, f"no prompt above {LONG_PROMPT} tokens")


def check_memory_headroom(state: AgentState) -> CheckResult:
    name, limit = "memory headroom", "util <= 0.85"
    config = state.config
    if config is None:
        return _result(name, limit, "n/a", None, "n/a", "the agent does not report its config")
    util = config.gpu_memory_utilization
    if config.platform == "cpu":
        return _result(
            name, limit, "n/a", util, f"{util:g}",
            "CPU engine: gpu_memory_utilization is the share of RAM for the KV cache",
        )  # fmt: skip
    if config.extensible_kv_cache:
        return _result(
            name, limit, "n/a", util, f"{util:g}",
            "extensible KV cache: vLLM sizes it from the memory free after warm-up, not a fraction",
        )  # fmt: skip
    critical, risk, block_64 = HEADROOM_CRITICAL, HEADROOM_RISK, ""
    if config.block_size == 64:
        # The reports: block size 64 costs about 5 % more memory, to be taken
        # out of the utilisation.
        critical, risk = round(critical - BLOCK_64_MEMORY, 2), round(risk - BLOCK_64_MEMORY, 2)
        block_64 = f" (block size 64: about {100 * BLOCK_64_MEMORY:.0f}% more memory, the reports)"
    status: Status
    if util > risk:
        status, why = "fail", f"above {risk:g}: the reports' OOM risk (under 10% headroom)"
    elif util > critical:
        status, why = "warn", f"above {critical:g}, the reports' critical point"
    else:
        status, why = "pass", f"at least {100 * (1 - critical):.0f}% headroom"
    return _result(name, limit, status, util, f"{util:g}", why + block_64)


def is_a100(config: EngineConfig) -> bool:
    return "A100" in (config.device_name or "")


def check_max_num_seqs(state: AgentState) -> CheckResult:
    name, limit = "max_num_seqs", "A100 <= 80; SMs x 1.5"
    config = state.config
    seqs = state.knobs.max_num_seqs
    if config is None or config.sm_count is None:
        why = "the agent does not report its config"
        if config is not None:
            why = config.device_reason or "no SM count"
        return _result(name, limit, "n/a", seqs, str(seqs), why)
    target = int(config.sm_count * SEQS_PER_SM)
    if is_a100(config):
        # Measured beats the rule of thumb: on their A100 (108 SMs x 1.5 = 162)
        # the reports saw the L1 hit rate fall above 80.
        measured = (
            f"the reports' A100: {A100_SEQS_BEST} best (+11% throughput over 64), above "
            f"{A100_SEQS_LIMIT} the L1 cache hit rate falls ({config.sm_count} SMs x 1.5 = "
            f"{target} is the rule of thumb it overrides)"
        )
        status: Status = "warn" if seqs > A100_SEQS_LIMIT else "pass"
        return _result(name, limit, status, seqs, str(seqs), measured)
    a100_note = (
        f"; the reports' only measurement, on an A100, found less: above {A100_SEQS_LIMIT} "
        f"(not 162) the L1 hit rate fell"
    )
    if seqs <= target:
        return _result(
            name, limit, "pass", seqs, str(seqs), f"{config.sm_count} SMs → {target}" + a100_note
        )
    return _result(
        name, limit, "warn", seqs, str(seqs),
        f"{config.sm_count} SMs x 1.5 = {target}: above it the reports saw the scheduler's share "
        "of the step grow" + a100_note,
    )  # fmt: skip


def check_policy(state: AgentState) -> CheckResult:
    name, limit = "scheduling policy", "tiered if >= 4:1, > 20"
    workload = state.workload
    spread = workload.prompt_length_spread_ratio if workload is not None else None
    policy = state.knobs.policy
    if spread is None:
        return _result(
            name, limit, "n/a", None, policy,
            "no request reached the engine in the window: no length spread",
        )  # fmt: skip
    shown = f"{policy} ({spread:.1f}:1)"
    peak = workload.requests_in_engine_peak if workload is not None else None
    if peak is None:
        concurrency = "requests at once not reported by this agent"
    else:
        mean = workload.requests_in_engine_mean if workload is not None else None
        concurrency = f"at most {peak} requests in the engine at once" + (
            f" (mean {mean:.1f})" if mean is not None else ""
        )
    gain = (
        f"the reports' hybrid policy costs about 2 ms of scheduling a step against 15-30 ms "
        f"saved, a gain that shows above {CONCURRENCY_TIERED} concurrent requests"
    )
    if spread >= SPREAD_TIERED and policy != "tiered":
        if peak is not None and peak <= CONCURRENCY_TIERED:
            return _result(
                name, limit, "pass", spread, shown,
                f"lengths spread 4:1 or more, but {concurrency} in the window: {gain}",
            )  # fmt: skip
        return _result(
            name, limit, "warn", spread, shown,
            "prompt lengths P90/P10 of 4:1 or more hurt batching (the reports), "
            f"{concurrency}; `runbook set policy=tiered` groups them",
        )  # fmt: skip
    if policy == "tiered" and peak is not None and peak <= CONCURRENCY_TIERED:
        return _result(
            name, limit, "pass", spread, shown,
            f"{concurrency} in the window: {gain}; fcfs costs less scheduling here",
        )  # fmt: skip
    return _result(name, limit, "pass", spread, shown, "")


def run_config_checks(state: AgentState) -> list[CheckResult]:
    return [
        check_token_budget(state),
        check_block_size(state),
        check_chunked_prefill(state),
        check_memory_headroom(state),
        check_max_num_seqs(state),
        check_policy(state),
        check_hardware(state),
    ]
