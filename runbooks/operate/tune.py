"""`runbook tune`: the field reports' five tuning steps on a live engine's traffic.

    tuner = Tuner(engine, TuneLimits(sla_e2e_p99=2.0), window_seconds=30)
    report = tuner.run()      # every point measured, the setting kept, the restart flags

1. baseline: throughput, P99 (end-to-end, TTFT with the API server), preemptions
   and the OOM rate, KV usage, over one measured window at the values tune found;
2. block size: `runbook check`'s advice (rules/config_checks.py) from the
   window's length mix and the what-if fragmentation, for the next restart;
3. policy: fcfs vs tiered from the length spread and the waiting times,
   switched live and measured for a window before it is kept;
4. budget and admission: max_num_seqs, then max_num_batched_tokens, walked
   down from their startup value (never above: the agent refuses it) in
   halvings within their live floors, then one midpoint on each side of the
   best; each point is held for a window measured only from the step it took
   effect at (`/v1/state?since_step=N`, as verification.py reads it) and
   judged on the SLA and an OOM rate (preemptions per finished request) under
   0.1 %; the highest-throughput point meeting both is kept (within 2 %, a
   tie, the less restrictive one: `beats`). An autopilot
   that is on owns max_num_seqs: only the budget is walked;
5. circuit breaker: at every read of a point the breaker's absolute limits
   (breaker.judge: OOM rate > 1 %, error rate > 0.5 %) are checked; a trip, or
   a point whose window broke the SLA, steps back at once to the best point
   measured so far and ends that knob's walk.

The engine side is the `TuneEngine` protocol: `AgentEngine` talks to the
agent (journaling each change before it is made), tests give a fake.
Interrupted (Ctrl-C) or with the engine lost, `Tuner.run` puts back what
tune changed and raises `TuneStopped` saying what it restored.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol

from vllm_runbook.collector.agent_api import AgentState, SettledSince
from vllm_runbook.rules.checklist import parse_exposition
from vllm_runbook.rules.config_checks import (
    SPREAD_TIERED,
    block_size_advice,
    check_block_size,
    check_chunked_prefill,
    check_memory_headroom,
)
from vllm_runbook.rules.promfuncs import bucket_quantile
from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError, EngineUnreachable
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


def restart_flags(state: AgentState, kept: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm serve` flags for the next restart: the kept live values plus the
    restart-only advice (block size, chunked prefill, memory utilisation) of
    `runbook check`'s configuration checks."""
    flags: list[str] = [
        f"--max-num-batched-tokens {kept['max_num_batched_tokens']}",
        f"--max-num-seqs {kept['max_num_seqs']}",
    ]
    env: list[str] = []
    notes: list[str] = []
    config, workload = state.config, state.workload
    if config is not None:
        block = config.block_size
        if workload is not None and workload.prompt_tokens.p50 is not None:
            block, why = block_size_advice(config, workload)
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
            util = 0.85
            notes.append(f"memory utilisation: {memory.note}")
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


class TuneEngine(Protocol):
    """What the tuner needs of an engine (the agent's, or a fake in tests)."""

    def state(self) -> AgentState: ...

    def apply(self, phase: str, knobs: Mapping[str, Any]) -> int:
        """Set the knobs (journaled before the change); the step they take effect at."""
        ...

    def restore_startup(self) -> int: ...

    def measure(self, from_step: int | None, seconds: float) -> Window:
        """A window from `from_step` on (None: from now, no change), cut short by a breach."""
        ...


class Tuner:
    """The five steps against one engine (see the module doc)."""

    def __init__(
        self,
        engine: TuneEngine,
        limits: TuneLimits,
        *,
        window_seconds: float,
        max_points: int = 12,
        dry_run: bool = False,
        restore: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.window = window_seconds
        self.max_points = max_points
        self.dry_run = dry_run
        self.restore = restore
        self.clock = clock
        self.points: list[Point] = []
        self.best: Point | None = None
        self.current: dict[str, Any] = {}
        self.started_with: dict[str, Any] = {}
        self.report: dict[str, Any] = {}
        self.events: list[str] = []

    # --- the run -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = self.clock()
        state = self.engine.state()
        self.started_with = {k: getattr(state.knobs, k) for k in (*TUNED_KNOBS, "autopilot")}
        self.current = dict(self.started_with)
        self.report = {
            "dry_run": self.dry_run,
            "window_seconds": self.window,
            "limits": {**asdict(self.limits), "text": self.limits.text()},
            "startup": state.startup.model_dump(),
            "started_with": dict(self.started_with),
            "points": [],
            "events": self.events,
        }
        try:
            self._steps(state)
            self._finish(started)  # --restore talks to the engine too
        except KeyboardInterrupt:
            self._stop("interrupted", ExitCode.INTERRUPTED, started)
        except EngineUnreachable as lost:
            self._stop(f"engine lost ({lost})", ExitCode.ENGINE, started)
        except EngineClientError as error:  # refused mid-run (a bound moved): back too
            self._stop(f"stopped ({error})", error.exit_code, started)
        return self.report

    def _steps(self, state: AgentState) -> None:
        # 1. baseline
        baseline = self._measure("baseline", None)
        state = self.engine.state()  # the workload over the baseline's window
        self.report["baseline"] = baseline.to_dict()
        # 2. block size (advice: it cannot change live)
        check = check_block_size(state)
        self.report["block_size"] = {
            "status": check.status,
            "shown": check.shown,
            "note": check.note,
            "advice": (
                block_size_advice(state.config, state.workload)[0]
                if state.config is not None
                and state.workload is not None
                and state.workload.prompt_tokens.p50 is not None
                else None
            ),
        }
        # 3. policy
        candidate, why = policy_candidate(state, baseline.window)
        policy: dict[str, Any] = {"from": self.current["policy"], "why": why, "kept": None}
        self.report["policy"] = policy
        if baseline.ok:
            self.best = baseline
        if candidate is not None:
            policy["tried"] = candidate
            if self.dry_run:
                policy["kept"] = f"not tried (dry run): a real run measures {candidate}"
            else:
                point = self._point("policy", {"policy": candidate})
                keep, reason = policy_kept(point, baseline)
                policy["measured"] = point.to_dict()
                if keep:
                    policy["kept"] = f"{candidate}: {reason}"
                    self.best = point if point.ok else self.best
                else:
                    policy["kept"] = f"{baseline.knobs['policy']}: {candidate} not kept ({reason})"
                    self._set("policy", {"policy": baseline.knobs["policy"]})
        # 4. budget and admission, 5. the breaker at every read
        bounds = self.engine.state().bounds
        plans: list[tuple[str, list[int]]] = []
        if self.current["autopilot"]:
            self.events.append("the autopilot owns max_num_seqs: only the budget is walked")
        else:
            b = bounds.max_num_seqs
            plans.append(("max_num_seqs", ladder(b.max, b.min)))
        if self.dry_run:
            b = bounds.max_num_batched_tokens
            plans.append(("max_num_batched_tokens", ladder(b.max, b.min)))
            self.report["planned"] = {knob: values for knob, values in plans}
            return
        self._walk("max_num_seqs", plans[0][1] if plans else [])
        b = self.engine.state().bounds.max_num_batched_tokens  # its floor follows max_num_seqs
        self._walk("max_num_batched_tokens", ladder(b.max, b.min))

    def _walk(self, knob: str, values: list[int]) -> None:
        if not values:
            return
        measured: dict[int, Point] = {}
        for value in values:
            if not self._room():
                break
            point = self._value_point(knob, value)
            measured[value] = point
            if not self._judge_step(point):
                break
        best = self.best
        if best is not None and best.knobs.get(knob) in measured:
            for value in midpoints(int(best.knobs[knob]), list(measured)):
                if not self._room():
                    break
                measured[value] = self._value_point(knob, value)
                self._judge_step(measured[value], stop=False)
        target = self.best.knobs if self.best is not None else self.started_with
        if self.current.get(knob) != target[knob]:
            self._set(f"keep {knob}", {knob: target[knob]})

    def _value_point(self, knob: str, value: int) -> Point:
        base = self.best.knobs if self.best is not None else self.current
        knobs = {k: base[k] for k in TUNED_KNOBS}
        knobs[knob] = value
        same = [p for p in self.points if p.knobs == knobs]
        if same:  # measured already (the startup value is the baseline's)
            return same[-1]
        return self._point(knob, {knob: value, **_other(knobs, self.current, knob)})

    def _judge_step(self, point: Point, stop: bool = True) -> bool:
        """Update the best; False when the walk of this knob should end."""
        best = self.best
        if point.ok:
            fastest = max([p.throughput for p in self.points if p.ok], default=0.0)
            if best is None or beats(point, best, fastest):
                self.best = point
                return True
            return point.throughput >= (1 - STOP_DROP) * best.throughput or not stop
        if best is not None and best is not point:
            # The breaker, or the SLA broken for a window: back at once.
            self.events.append(
                f"step back to {_knobs_text(best.knobs)}: {'; '.join(point.failures)}"
            )
            self._set("step back", {k: best.knobs[k] for k in TUNED_KNOBS})
            return False
        return True  # nothing measured meets the limits yet: keep looking lower

    def _room(self) -> bool:
        return sum(p.phase != "baseline" for p in self.points) < self.max_points

    # --- points ------------------------------------------------------------------

    def _point(self, phase: str, change: Mapping[str, Any]) -> Point:
        step = self._set(phase, change)
        return self._measure(phase, step)

    def _set(self, phase: str, change: Mapping[str, Any]) -> int | None:
        change = {k: v for k, v in change.items() if self.current.get(k) != v}
        if not change:
            return None
        step = self.engine.apply(phase, change)
        self.current.update(change)
        if "max_num_seqs" in change:
            self.current["autopilot"] = False  # setting it takes it from the autopilot
        return step

    def _measure(self, phase: str, from_step: int | None) -> Point:
        window = self.engine.measure(from_step, self.window)
        failures, broken = judge_point(window, self.limits)
        point = Point(phase, {k: self.current[k] for k in TUNED_KNOBS}, window, failures, broken)
        self.points.append(point)
        return point

    # --- the end -----------------------------------------------------------------

    def _changed(self) -> dict[str, Any]:
        return {
            k: self.started_with[k]
            for k in TUNED_KNOBS
            if self.current.get(k) != self.started_with[k]
        }

    def _stop(self, why: str, code: ExitCode, started: float) -> None:
        import signal

        # A second Ctrl-C must not cut the restore short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            back = self._changed()
            try:  # what the engine runs with now (a change may have landed unseen)
                now = self.engine.state().knobs
                back = {
                    k: v
                    for k, v in self.started_with.items()
                    if k in TUNED_KNOBS
                    and getattr(now, k) != v
                    and not (
                        k == "max_num_seqs"
                        and v is not None
                        and now.autopilot
                        and self.started_with["autopilot"]
                    )
                }
            except EngineClientError:
                pass
            if not back:
                restored = "nothing to restore: tune had changed nothing"
            else:
                try:
                    self.engine.apply("restore", _with_autopilot(back, self.started_with))
                    restored = f"restored {_knobs_text(back)}"
                    self.current.update(back)
                except EngineClientError as error:
                    restored = (
                        f"could not restore {_knobs_text(back)} ({error}): "
                        "`runbook revert` the execution when the engine is back"
                    )
        finally:
            signal.signal(signal.SIGINT, previous)
        self.events.append(f"{why}: {restored}")
        lost = code == ExitCode.ENGINE
        self._finish(started, outcome=f"{why}: {restored}", read_engine=not lost)
        raise TuneStopped(f"{why}: {restored}", code, self.report)

    def _finish(self, started: float, outcome: str | None = None, read_engine: bool = True) -> None:
        self.report["points"] = [p.to_dict() for p in self.points]
        best = self.best
        kept = (
            dict(best.knobs) if best is not None else {k: self.started_with[k] for k in TUNED_KNOBS}
        )
        kept["autopilot"] = bool(self.current.get("autopilot"))
        self.report["kept"] = kept
        self.report["kept_point"] = self.points.index(best) if best is not None else None
        if outcome is None:
            if self.dry_run:
                outcome = "dry run: measured and recommended, nothing changed"
            elif best is None:
                outcome = f"no point met {self.limits.text()}: back at the values tune started with"
            else:
                outcome = f"kept {_knobs_text(kept)} ({best.throughput:.0f} tokens/s)"
            if self.restore and not self.dry_run:
                self.engine.restore_startup()
                self.current.update({k: self.report["startup"][k] for k in TUNED_KNOBS})
                outcome += "; --restore: every knob back at its startup value"
        self.report["outcome"] = outcome
        self.report["ended_with"] = {k: self.current.get(k) for k in TUNED_KNOBS}
        total = max(self.clock() - started, 1e-9)
        broken = sum(p.window.seconds for p in self.points if p.sla_broken)
        self.report["tune_seconds"] = round(total, 3)
        self.report["sla_broken_seconds"] = round(broken, 3)
        self.report["sla_broken_share"] = round(min(1.0, broken / total), 4)
        self.report["breaches"] = sum(p.window.breach is not None for p in self.points)
        if read_engine:
            self.report["restart"] = restart_flags(self.engine.state(), kept)


def _other(knobs: Mapping[str, Any], current: Mapping[str, Any], knob: str) -> dict[str, Any]:
    """The other tuned knobs where the point differs from the engine now."""
    return {k: v for k, v in knobs.items() if k != knob and current.get(k) != v}


def _with_autopilot(back: Mapping[str, Any], started: Mapping[str, Any]) -> dict[str, Any]:
    # Setting max_num_seqs turns the autopilot off: back on if it was on.
    if "max_num_seqs" in back and started.get("autopilot"):
        return {**back, "autopilot": True}
    return dict(back)


def _knobs_text(knobs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in knobs.items() if k in TUNED_KNOBS)


# --- the engine's agent ----------------------------------------------------------------


class Journaling(Protocol):
    def add_step(self, *args: Any, **kwargs: Any) -> Any: ...

    def finish_step(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass
class AgentEngine:
    """The tuner's engine: the agent's `/v1/state` and knobs; each change
    journaled (its before-values committed) before the engine is touched."""

    client: EngineClient
    api_url: str | None = None
    journal: Journaling | None = None
    execution_id: int | None = None
    renew: Callable[[], None] | None = None
    poll_seconds: float = 0.5
    # A change not in effect (max_num_seqs draining) after this long is judged as such.
    settle_seconds: float = 60.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def state(self) -> AgentState:
        return self.client.state()

    def apply(self, phase: str, knobs: Mapping[str, Any]) -> int:
        from vllm_runbook.runbooks.store.models import STEP_APPLIED, STEP_FAILED

        before = {k: getattr(self.client.state().knobs, k) for k in knobs}
        row = None
        if self.journal is not None and self.execution_id is not None:
            self._renew()
            row = self.journal.add_step(self.execution_id, f"tune:{phase}", {}, before=before)
        try:
            result = self.client.set_knobs(**knobs)
        except EngineClientError as error:
            if row is not None:
                self.journal.finish_step(row.id, STEP_FAILED, error=str(error))  # type: ignore[union-attr]
            raise
        if row is not None:
            self.journal.finish_step(  # type: ignore[union-attr]
                row.id,
                STEP_APPLIED,
                after={k: getattr(result.after, k) for k in knobs},
                applied_at_step=result.effective_from_step,
            )
        return result.effective_from_step

    def restore_startup(self) -> int:
        state = self.client.state()
        back = {k: getattr(state.startup, k) for k in (*TUNED_KNOBS, "autopilot")}
        changes = {k: v for k, v in back.items() if getattr(state.knobs, k) != v}
        if not changes:
            return state.engine.step
        return self.apply("restore", changes)

    def _ttft(self, state: AgentState) -> dict[float, float] | None:
        if self.api_url is None:
            return None
        import httpx

        try:
            text = httpx.get(self.api_url + "/metrics", timeout=self.client.timeout).text
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"vLLM server {self.api_url} unreachable: {exc}") from None
        samples = parse_exposition(text, model_name=state.engine.model_name)
        buckets: dict[float, float] = {}
        for labels, value in samples.get(TTFT + "_bucket", []):
            if labels.get("engine", state.engine.engine) == state.engine.engine:
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        return buckets

    def _renew(self) -> None:
        """Keep the engine's lock; a lapsed one stops the tune (and restores)."""
        if self.renew is None:
            return
        try:
            self.renew()
        except Exception as error:  # the guardrails' Abort: the lease lapsed
            raise EngineClientError(str(error)) from None

    def _wait(self) -> None:
        self._renew()
        self.sleep(self.poll_seconds)

    def measure(self, from_step: int | None, seconds: float) -> Window:
        if from_step is None:
            return self._baseline(seconds)
        start = self.clock()
        state = self.client.state(since_step=from_step)
        while not isinstance(state.since, SettledSince):
            if self.clock() - start > self.settle_seconds:
                why = "the agent kept no mark" if state.since is None else "still draining"
                return Window(0.0, None, 0, 0, from_step=from_step, not_in_effect=why)
            self._wait()
            state = self.client.state(since_step=from_step)
        ttft0 = self._ttft(state)
        peak = 0.0
        while True:
            since = state.since
            assert isinstance(since, SettledSince)
            peak = max(peak, state.stats.kv_cache_usage_ratio)
            errors = since.finished_by_reason.get("error", 0)
            breach = breach_of(since.seconds, since.preemptions, since.requests_finished, errors)
            if breach is not None or since.seconds >= seconds:
                break
            self._wait()
            state = self.client.state(since_step=from_step)
        return Window(
            seconds=since.seconds,
            throughput=since.throughput_tokens_per_second,
            finished=since.requests_finished,
            preemptions=since.preemptions,
            errors=errors,
            e2e_p99=since.p99_latency_seconds,
            queue_p99=since.waiting_seconds_p99,
            ttft_p99=_p99_delta(ttft0, self._ttft(state)),
            kv_usage_peak=peak,
            from_step=from_step,
            breach=breach,
        )

    def _baseline(self, seconds: float) -> Window:
        """No change to measure from: counter deltas over the window; the P99s
        over the agent's trailing window at its end (no change in it either)."""
        first = self.client.state()
        ttft0 = self._ttft(first)
        start = self.clock()
        peak = first.stats.kv_cache_usage_ratio
        while self.clock() - start < seconds:
            self._wait()
            peak = max(peak, self.client.state().stats.kv_cache_usage_ratio)
        last = self.client.state()
        elapsed = self.clock() - start
        s0, s1 = first.stats, last.stats
        finished0 = sum(s0.requests_finished_by_reason_total.values())
        finished1 = sum(s1.requests_finished_by_reason_total.values())
        errors = s1.requests_finished_by_reason_total.get(
            "error", 0
        ) - s0.requests_finished_by_reason_total.get("error", 0)
        return Window(
            seconds=elapsed,
            throughput=(s1.scheduled_tokens_total - s0.scheduled_tokens_total) / elapsed
            if elapsed > 0
            else None,
            finished=finished1 - finished0,
            preemptions=s1.preemptions_total - s0.preemptions_total,
            errors=errors,
            e2e_p99=s1.p99_latency_seconds,
            queue_p99=s1.waiting_seconds_p99,
            ttft_p99=_p99_delta(ttft0, self._ttft(last)),
            kv_usage_peak=max(peak, s1.kv_cache_usage_ratio),
        )


def _p99_delta(
    before: Mapping[float, float] | None, after: Mapping[float, float] | None
) -> float | None:
    """P99 of a histogram's observations between two scrapes (bucket bound)."""
    if before is None or after is None:
        return None
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    if delta.get(math.inf, 0.0) <= 0:
        return None
    return float(bucket_quantile(0.99, sorted(delta.items())))


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: every point, the setting kept, the restart flags."""
    from vllm_runbook.runbooks.run.render import format_table

    def ms(value: Any) -> str:
        return "-" if value is None else f"{1000 * value:.0f}"

    rows = []
    for i, p in enumerate(report.get("points", [])):
        k = p["knobs"]
        oom = p.get("oom_rate")
        mark = "*" if i == report.get("kept_point") else ""
        rows.append(
            (
                f"{i}{mark}",
                p["phase"],
                k["max_num_batched_tokens"],
                k["max_num_seqs"],
                k["policy"],
                f"{p['seconds']:.1f}",
                "-" if p["throughput"] is None else f"{p['throughput']:.0f}",
                ms(p["e2e_p99"]),
                ms(p["ttft_p99"]),
                p["finished"],
                p["preemptions"],
                "-" if oom is None else f"{100 * oom:.2g}",
                "yes" if p["meets"] else "; ".join(p["failures"]),
            )
        )
    headers = (
        "#", "phase", "budget", "seqs", "policy", "s", "tok/s", "e2e p99 ms",
        "ttft p99 ms", "done", "preempt", "oom %", "meets",
    )  # fmt: skip
    lines = [
        f"runbook tune {report.get('engine', '')}: {report['limits']['text']}, "
        f"{report['window_seconds']:g} s per point" + (" (dry run)" if report["dry_run"] else ""),
        "",
        format_table(rows, headers).rstrip("\n"),
        "",
    ]
    block = report.get("block_size")
    if block:
        lines.append(f"block size: {block['shown']} ({block['status']}) {block['note']}".rstrip())
    policy = report.get("policy")
    if policy:
        lines.append(f"policy: {policy['why']}" + (f"; {policy['kept']}" if policy["kept"] else ""))
    if report.get("planned"):
        planned = "; ".join(f"{k} {v}" for k, v in report["planned"].items())
        lines.append(f"a real run walks: {planned}")
    for event in report.get("events", []):
        lines.append(f"- {event}")
    lines.append(f"outcome: {report['outcome']}")
    lines.append(
        f"SLA broken {report['sla_broken_seconds']:.0f} s of {report['tune_seconds']:.0f} s "
        f"({100 * report['sla_broken_share']:.0f} %), breaker trips {report['breaches']}"
    )
    restart = report.get("restart")
    if restart:
        lines.append(f"at the next restart: {restart['command']}")
        lines += [f"  {note}" for note in restart["notes"]]
    return "\n".join(lines) + "\n"
