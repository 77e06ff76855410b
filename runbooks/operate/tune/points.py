"""The tune walk's points and their judgement: the limits, a measured window, the
ladder of values walked, which point beats which, the policy choice and the
flags for the next restart (pure functions of what was measured)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.rules.config_checks import (
    BLOCK_64_MEMORY,
    HEADROOM_CRITICAL,
    SPREAD_TIERED,
    check_chunked_prefill,
    check_memory_headroom,
    tune_block_size,
)
from vllm_runbook.runbooks.model.config import BreakerConfig
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.service.breaker import Measurement
from vllm_runbook.runbooks.service.breaker import judge as breaker_judge

# The reports' limit: a point is kept under 0.1 % OOM rate (the breaker trips over
# its own limits, BreakerConfig's: 1 % OOM rate, 0.5 % errors).
OOM_RATE_LIMIT: Final = 0.001
# The breaker's rates are over at least this many requests (one preemption
# among the first few requests of a short window is not a storm).
BREAKER_MIN_FINISHED: Final = 20
# Halvings per knob below its startup value.
LADDER_STEPS: Final = 3
# A point this far below the best throughput so far: lower values only lose more.
STOP_DROP: Final = 0.10
# Two points within this share of each other's throughput are a tie (a 10 s
# window's noise on a quiet machine is several per cent): the tie goes to the less
# restrictive setting, more sequences and then a larger budget, the smaller
# change from startup (benchmarks/tune.py: a tie of 7,024 vs 7,018 tokens/s kept 8
# sequences where 12 was the sweep's best).
TIE_SHARE: Final = 0.02
# A policy is kept only at this share of the baseline's throughput or more.
POLICY_THROUGHPUT: Final = 0.95
# Requests wait meaningfully when the queue time's P99 is this share of the end-to-end P99.
WAIT_SHARE: Final = 0.10
TTFT: Final = "vllm:time_to_first_token_seconds"
TUNED_KNOBS: Final = ("max_num_batched_tokens", "max_num_seqs", "policy")


class TuneStopped(RunbookError):
    """Interrupted or the engine lost; `restored` says what was put back."""

    def __init__(self, message: str, exit_code: ExitCode, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.code = exit_code
        self.report = report


@dataclass(frozen=True)
class TuneLimits:
    """What a point must meet to be kept."""

    sla_e2e_p99: float | None = None
    sla_ttft_p99: float | None = None
    oom_rate: float = OOM_RATE_LIMIT

    def text(self) -> str:
        parts = []
        if self.sla_e2e_p99 is not None:
            parts.append(f"P99 end-to-end <= {self.sla_e2e_p99:g} s")
        if self.sla_ttft_p99 is not None:
            parts.append(f"P99 TTFT <= {self.sla_ttft_p99:g} s")
        parts.append(f"OOM rate < {100 * self.oom_rate:g} %")
        return ", ".join(parts)


@dataclass(frozen=True)
class Window:
    """One measured window: counter deltas and the requests finished in it."""

    seconds: float
    throughput: float | None  # scheduled tokens per second
    finished: int
    preemptions: int
    errors: int = 0
    e2e_p99: float | None = None
    queue_p99: float | None = None
    ttft_p99: float | None = None
    kv_usage_peak: float | None = None
    # The step the change took effect at (None: the baseline, no change).
    from_step: int | None = None
    # The breaker's trip during the window (it was cut short).
    breach: str | None = None
    # The change never took effect within the settle deadline (draining).
    not_in_effect: str | None = None

    @property
    def oom_rate(self) -> float | None:
        if self.finished:
            return self.preemptions / self.finished
        return math.inf if self.preemptions else None


@dataclass
class Point:
    """A setting held for a window, and the judgement."""

    phase: str  # baseline | policy | max_num_seqs | max_num_batched_tokens
    knobs: dict[str, Any]
    window: Window
    failures: list[str] = field(default_factory=list)
    sla_broken: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def throughput(self) -> float:
        return self.window.throughput or 0.0

    def to_dict(self) -> dict[str, Any]:
        w = asdict(self.window)
        w["oom_rate"] = self.window.oom_rate if self.window.oom_rate != math.inf else None
        return {
            "phase": self.phase,
            "knobs": dict(self.knobs),
            **w,
            "meets": self.ok,
            "failures": list(self.failures),
            "sla_broken": self.sla_broken,
        }


def judge_point(w: Window, limits: TuneLimits) -> tuple[list[str], bool]:
    """Why a window fails the limits (empty: it meets both), and whether it broke the SLA."""
    failures: list[str] = []
    if w.not_in_effect:
        return [f"not in effect: {w.not_in_effect}"], False
    if w.breach:
        failures.append(f"circuit breaker: {w.breach}")
    if not w.finished:
        failures.append("no request finished in the window: nothing to judge")
        return failures, False
    oom = w.oom_rate
    assert oom is not None
    if oom >= limits.oom_rate:
        failures.append(
            f"OOM rate {100 * oom:.2g} % ({w.preemptions} preemptions / {w.finished} finished) "
            f">= {100 * limits.oom_rate:g} %"
        )
    broken = False
    for name, sla, value in (
        ("P99 end-to-end", limits.sla_e2e_p99, w.e2e_p99),
        ("P99 TTFT", limits.sla_ttft_p99, w.ttft_p99),
    ):
        if sla is None:
            continue
        if value is None:
            failures.append(f"{name} not measured")
        elif value > sla:
            failures.append(f"{name} {value:.3g} s > SLA {sla:g} s")
            broken = True
    return failures, broken


_BREAKER: Final = BreakerConfig(min_finished=BREAKER_MIN_FINISHED)


def breach_of(seconds: float, preemptions: int, finished: int, errors: int) -> str | None:
    """The circuit breaker's absolute limits on a window so far (breaker.judge)."""
    trip = breaker_judge(Measurement(seconds, preemptions, finished, errors), _BREAKER)
    return None if trip is None else trip.text


def beats(point: Point, best: Point, fastest: float) -> bool:
    """Whether `point` should replace `best` (both meet the limits; `fastest`:
    the highest throughput measured among those that do, `point` included):
    faster beyond a tie, or within a tie (TIE_SHARE) of both `best` and the
    fastest and less restrictive. The kept point is never more than a tie
    below the fastest: ties do not chain."""
    if point.throughput > (1 + TIE_SHARE) * best.throughput:
        return True
    if point.throughput < (1 - TIE_SHARE) * max(best.throughput, fastest):
        return False
    return _headroom(point.knobs) > _headroom(best.knobs)


def _headroom(knobs: Mapping[str, Any]) -> tuple[int, int]:
    return (int(knobs.get("max_num_seqs") or 0), int(knobs.get("max_num_batched_tokens") or 0))


def ladder(startup: int, floor: int, steps: int = LADDER_STEPS) -> list[int]:
    """startup, then halvings down to the floor: at most `steps` below startup."""
    values = [startup]
    value = startup
    for _ in range(steps):
        value = max(floor, value // 2)
        if value >= values[-1]:
            break
        values.append(value)
    return values


def midpoints(best: int, measured: Sequence[int]) -> list[int]:
    """One value halfway to each measured neighbour of `best` (none where they touch)."""
    out = []
    above = [v for v in measured if v > best]
    below = [v for v in measured if v < best]
    if above and min(above) - best >= 2:
        out.append((best + min(above)) // 2)
    if below and best - max(below) >= 2:
        out.append((best + max(below)) // 2)
    return out


def policy_candidate(state: AgentState, baseline: Window) -> tuple[str | None, str]:
    """The policy to try (None: keep the current one) and why, from the length
    spread (`runbook check`'s 4:1) and the waiting times."""
    workload = state.workload
    spread = workload.prompt_length_spread_ratio if workload is not None else None
    policy = state.knobs.policy
    if spread is None:
        return None, "no request arrived in the window: no length spread"
    waits = baseline.queue_p99
    waited = (
        waits is not None
        and baseline.e2e_p99 is not None
        and baseline.e2e_p99 > 0
        and waits >= WAIT_SHARE * baseline.e2e_p99
    )
    wait_text = "n/a" if waits is None else f"{waits:.3g} s"
    if policy != "tiered" and spread >= SPREAD_TIERED:
        if not waited:
            return None, (
                f"spread {spread:.1f}:1 but requests hardly wait (queue P99 {wait_text}, under "
                f"{100 * WAIT_SHARE:g} % of the end-to-end P99): {policy} kept"
            )
        return "tiered", f"spread {spread:.1f}:1 >= {SPREAD_TIERED:g}:1, queue P99 {wait_text}"
    if policy == "tiered" and spread < SPREAD_TIERED:
        return "fcfs", f"spread {spread:.1f}:1 < {SPREAD_TIERED:g}:1: tiered has little to sort"
    return None, f"spread {spread:.1f}:1: {policy} kept"


def policy_kept(candidate: Point, baseline: Point) -> tuple[bool, str]:
    """Whether the measured policy is better than the baseline's."""
    if not candidate.ok:
        return False, "; ".join(candidate.failures)
    if candidate.throughput < POLICY_THROUGHPUT * baseline.throughput:
        return False, (
            f"throughput {candidate.throughput:.0f} < {100 * POLICY_THROUGHPUT:g} % of "
            f"{baseline.throughput:.0f} tokens/s"
        )
    if not baseline.ok:
        return True, "meets the limits the baseline did not"
    before = baseline.window.ttft_p99 or baseline.window.queue_p99
    after = candidate.window.ttft_p99 or candidate.window.queue_p99
    if candidate.knobs.get("policy") == "tiered":
        if before is not None and after is not None and after < before:
            return True, f"waiting P99 {before:.3g} → {after:.3g} s"
        return False, "waiting P99 not lower"
    if candidate.throughput >= baseline.throughput:
        return True, "throughput as high or higher"
    return False, "throughput lower"


def restart_flags(
    state: AgentState,
    kept: Mapping[str, Any],
    block_size: tuple[int | None, str] | None = None,
) -> dict[str, Any]:
    """`vllm serve` flags for the next restart: the kept live values plus the
    restart-only advice: the block size of step 2 (`block_size`, else
    `tune_block_size` on `state`), and chunked prefill and memory utilisation by
    `runbook check`'s configuration checks."""
    flags: list[str] = [
        f"--max-num-batched-tokens {kept['max_num_batched_tokens']}",
        f"--max-num-seqs {kept['max_num_seqs']}",
    ]
    env: list[str] = []
    notes: list[str] = []
    config = state.config
    if config is not None:
        advised, why = block_size if block_size is not None else tune_block_size(state)
        block = advised if advised is not None else config.block_size
        if advised is not None:
            notes.append(f"block size: {why}")
        flags.append(f"--block-size {block}")
        chunked = check_chunked_prefill(state)
        on = config.enable_chunked_prefill or chunked.status == "fail"
        flags.append("--enable-chunked-prefill" if on else "--no-enable-chunked-prefill")
        if chunked.status == "fail":
            notes.append(f"chunked prefill: {chunked.note}")
        memory = check_memory_headroom(state)
        util = config.gpu_memory_utilization
        if memory.status in ("warn", "fail"):
            util = HEADROOM_CRITICAL
            notes.append(f"memory utilisation: {memory.note}")
        if block == 64 and config.block_size != 64 and config.platform != "cpu":
            # The reports: 64 costs about 5 % more memory than 32, out of the utilisation.
            util = round(min(util, HEADROOM_CRITICAL) - BLOCK_64_MEMORY, 2)
        if not config.extensible_kv_cache:  # vLLM 0.34's default sizes itself
            flags.append(f"--gpu-memory-utilization {util:g}")
    if kept["policy"] == "tiered":
        env.append("VLLM_RUNBOOK_POLICY=tiered")
    elif kept["policy"] != "fcfs":
        flags.append(f"--scheduling-policy {kept['policy']}")
    if kept.get("autopilot"):
        env.append("VLLM_RUNBOOK_AUTOPILOT=on")
    return {
        "flags": flags,
        "env": env,
        "command": " ".join([*env, "vllm serve MODEL", *flags]),
        "notes": notes,
    }
