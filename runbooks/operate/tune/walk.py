"""The tuner: the five steps walked against a `TuneEngine` (see the package doc)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, Protocol

from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.rules.config_checks import (
    check_block_size,
    tune_block_size,
)
from vllm_runbook.runbooks.engine.client import EngineClientError, EngineUnreachable
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.tune.points import (
    STOP_DROP,
    TUNED_KNOBS,
    Point,
    TuneLimits,
    TuneStopped,
    Window,
    beats,
    judge_point,
    ladder,
    midpoints,
    policy_candidate,
    policy_kept,
    restart_flags,
)


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
        # Step 2's block size to restart with, and why (None: none measured).
        self.block_size: tuple[int | None, str] | None = None

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
        # 2. block size (advice: it cannot change live): the reports' sweep on the
        # what-if fragmentation; `runbook check`'s length-mix line beside it
        check = check_block_size(state)
        self.block_size = tune_block_size(state)
        self.report["block_size"] = {
            "status": check.status,
            "shown": check.shown,
            "note": check.note,
            "advice": self.block_size[0],
            "sweep": self.block_size[1],
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
            self.report["restart"] = restart_flags(self.engine.state(), kept, self.block_size)


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
