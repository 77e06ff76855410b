"""`runbook check`'s configuration checks: the engine's resolved configuration
(`/v1/state` `config`) against the field reports' advice, given the workload
the engine measured (`workload`, the what-if fragmentation).

Each check prints the reports' reason, the measured value and pass / warn /
fail / n/a (n/a says why: no GPU, no request arrived in the window). A warn
never fails `runbook check`; a fail does.

    token budget       2048 the reports' safe threshold, 2000-3000 their best range
    block size         8 for 50-300-token chat, 16 over 32 (fragmentation), 64 for 32k
                       contexts, 128 beyond 64k; the what-if fragmentation < 15 %
    chunked prefill    on when prompts of 8k+ tokens arrive
    memory headroom    gpu_memory_utilization <= 0.85 (the reports' critical point),
                       > 0.90 an OOM risk (at least 10 % headroom)
    max_num_seqs       about SMs x 1.5 on a GPU (A100: 72)
    policy             tiered when the prompt length spread P90/P10 is 4:1 or more
"""

from __future__ import annotations

from vllm_runbook.collector.agent_api import AgentState, EngineConfig, Workload
from vllm_runbook.rules.checklist import CheckResult, Status

BUDGET_SAFE, BUDGET_BEST = 2048, (2000, 3000)
FRAGMENTATION_GOAL = 0.15
HEADROOM_CRITICAL, HEADROOM_RISK = 0.85, 0.90
SEQS_PER_SM = 1.5
SPREAD_TIERED = 4.0
LONG_PROMPT = 8192


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
    if p50_prompt <= 300 and p99_context <= 1_024:
        return 8
    return 16


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
        f"the reports: 8 for 50-300-token chat, 16 over 32, 64 for 32k contexts, 128 beyond "
        f"64k; this mix (P50 prompt {p50}, P99 context {p99}) → {advice}"
    )
    if config.platform == "cpu" and advice % 32:
        reason += "; on CPU vLLM takes multiples of 32 only"
        advice = 32
    return advice, reason


def check_token_budget(state: AgentState) -> CheckResult:
    name, limit = "token budget", "2000-3000"
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
    if config.block_size == advice:
        return _result(name, limit, "pass", config.block_size, shown, reason)
    if at_advice is not None:
        reason += f" (fragmentation there {100 * at_advice:.0f}%)"
    status: Status = "warn" if own >= FRAGMENTATION_GOAL else "pass"
    return _result(name, limit, status, config.block_size, shown, reason + "; restart to change")


def check_chunked_prefill(state: AgentState) -> CheckResult:
    name, limit = "chunked prefill", "on for 8k+"
    config, workload = state.config, state.workload
    if config is None:
        return _result(name, limit, "n/a", None, "n/a", "the agent does not report its config")
    on = config.enable_chunked_prefill
    shown = "on" if on else "off"
    long_share = workload.long_prompt_ratio if workload is not None else None
    if on:
        return _result(name, limit, "pass", 1.0, shown, "")
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
    status: Status
    if util > HEADROOM_RISK:
        status, why = "fail", f"above {HEADROOM_RISK}: the reports' OOM risk (under 10% headroom)"
    elif util > HEADROOM_CRITICAL:
        status, why = "warn", f"above {HEADROOM_CRITICAL}, the reports' critical point"
    else:
        status, why = "pass", "at least 15% headroom"
    return _result(name, limit, status, util, f"{util:g}", why)


def check_max_num_seqs(state: AgentState) -> CheckResult:
    name, limit = "max_num_seqs", "<= SMs x 1.5"
    config = state.config
    seqs = state.knobs.max_num_seqs
    if config is None or config.sm_count is None:
        why = "the agent does not report its config"
        if config is not None:
            why = config.device_reason or "no SM count"
        return _result(name, limit, "n/a", seqs, str(seqs), why)
    target = int(config.sm_count * SEQS_PER_SM)
    if seqs <= target:
        return _result(name, limit, "pass", seqs, str(seqs), f"{config.sm_count} SMs → {target}")
    return _result(
        name, limit, "warn", seqs, str(seqs),
        f"{config.sm_count} SMs x 1.5 = {target}: above it the reports saw the scheduler's share "
        "of the step grow (A100: 72)",
    )  # fmt: skip


def check_policy(state: AgentState) -> CheckResult:
    name, limit = "scheduling policy", "tiered if >= 4:1"
    workload = state.workload
    spread = workload.prompt_length_spread_ratio if workload is not None else None
    policy = state.knobs.policy
    if spread is None:
        return _result(
            name, limit, "n/a", None, policy,
            "no request reached the engine in the window: no length spread",
        )  # fmt: skip
    shown = f"{policy} ({spread:.1f}:1)"
    if spread >= SPREAD_TIERED and policy != "tiered":
        return _result(
            name, limit, "warn", spread, shown,
            "prompt lengths P90/P10 of 4:1 or more hurt batching (the reports); "
            "`runbook set policy=tiered` groups them",
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
    ]
