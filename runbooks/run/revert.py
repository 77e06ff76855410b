"""Reverting an execution: restore the knob values it recorded before acting.

    executor.revert(execution_id)                       # all the way back, at once
    executor.revert(execution_id, stepwise=True)        # in the runbook's stages
    (the service reverts once an alert resolved and its cause is gone: hold.py)

A revert is itself an execution (`reverts_id` = the original), journaled like
a run and holding the engine lock. Stepwise, it moves the knobs back in the
runbook's stages (e.g. 50 % then 100 %), watching a healthy period between
stages and halting when the verification or a guarded signal gets worse.
The run's own rollback (a failing step, the circuit breaker) restores with
`restore_targets` too. A drain (engine/router.py) is undone by routing to
the engine again at its router (`revert_drain`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vllm_runbook.runbooks.engine.client import Agent, EngineClientError
from vllm_runbook.runbooks.engine.operations import KNOBS, SignalReader
from vllm_runbook.runbooks.engine.router import RouterError, undo_drain
from vllm_runbook.runbooks.engine.routing import RouterBinding
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.model.spec import Catalog, Runbook
from vllm_runbook.runbooks.run.guardrails import engine_lock, worse
from vllm_runbook.runbooks.run.outcome import (
    EngineBusy,
    ExecutionResult,
    one_line,
)
from vllm_runbook.runbooks.store import ExecutionRecord, Journal, StepRecord
from vllm_runbook.runbooks.store.models import (
    ACTIVE_STATUSES,
    STEP_APPLIED,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_REVERTED,
    STEP_SKIPPED,
    ExecutionStatus,
)


class Run(Protocol):
    """What a revert uses of the executor's run of its own execution
    (runbooks/run/executor.py's Run; the executor imports this module, so
    it is named here by what it does, not imported)."""

    id: int
    spec: Runbook
    client: Agent
    reader: SignalReader
    baseline: dict[str, Any]
    renew: Callable[[], None] | None

    def checks(self) -> None: ...

    def finish(self, status: str, exit_code: ExitCode, message: str | None) -> ExecutionResult: ...


class Executor(Protocol):
    """What a revert uses of the executor (runbooks/run/executor.py's Executor)."""

    @property
    def store(self) -> Journal: ...

    @property
    def catalog(self) -> Catalog | None: ...

    @property
    def client_factory(self) -> Callable[[str], Agent]: ...

    @property
    def poll_seconds(self) -> float: ...

    @property
    def routers(self) -> Mapping[str, RouterBinding]: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def runbook(self, name: str) -> Runbook: ...

    def new_run(
        self,
        spec: Runbook,
        client: Agent,
        execution_id: int,
        *,
        dry_run: bool,
        approved: bool,
    ) -> Run: ...

    def wait(self, seconds: float, renew: Callable[[], None] | None) -> None: ...

    def revert(
        self,
        execution_id: int,
        *,
        who: str | None = None,
        trigger: str = "cli",
        stepwise: bool = False,
        healthy_period_seconds: float | None = None,
        reason: str | None = None,
    ) -> ExecutionResult: ...


class RevertRefused(RunbookError):
    """The execution cannot be reverted (already reverted, dry run, still running…)."""

    exit_code = ExitCode.USAGE


def revertible_steps(record: ExecutionRecord) -> list[StepRecord]:
    """Steps whose effect may be on the engine: applied, or interrupted mid-apply."""
    return [
        s
        for s in record.steps
        if s.status in (STEP_APPLIED, STEP_INTERRUPTED)
        and s.before
        and any(k in KNOBS for k in s.before)
    ]


def drained_steps(record: ExecutionRecord) -> list[StepRecord]:
    """Steps that took the engine out of its router's rotation (engine/router.py's
    drain, journaled `{"routed": true}` before): a revert routes to it again."""
    return [
        s
        for s in record.steps
        if s.status in (STEP_APPLIED, STEP_INTERRUPTED)
        and s.before is not None
        and s.before.get("routed") is True
    ]


def restore_targets(steps: list[StepRecord]) -> dict[str, Any]:
    """Per knob, the before-value of the first step that touched it."""
    targets: dict[str, Any] = {}
    for step in sorted(steps, key=lambda s: s.ordinal):
        for knob, value in (step.before or {}).items():
            if knob in KNOBS:
                targets.setdefault(knob, value)
    return targets


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:g}" if isinstance(value, int | float) else str(value)


class Revert:
    """Restore one execution's recorded before-values (itself journaled)."""

    def __init__(
        self, executor: Executor, execution_id: int, who: str, trigger: str, reason: str | None
    ) -> None:
        if trigger not in ("cli", "rule"):
            raise ValueError("a revert is triggered by 'cli' or 'rule'")
        self.x = executor
        self.store = executor.store
        self.target_id = execution_id
        self.who = who
        self.trigger = trigger
        self.reason = reason

    def run(self, stepwise: bool, healthy_period_seconds: float | None) -> ExecutionResult:
        self.store.recover_interrupted()
        original = self.store.get_execution(self.target_id)
        refusal = self._refusal(original)
        client = self.x.client_factory(original.engine)
        if refusal is not None:
            raise RevertRefused(refusal)
        why = f"revert of execution #{original.id}" + (f": {self.reason}" if self.reason else "")
        record, _ = self.store.create_execution(
            original.runbook,
            original.engine,
            trigger=self.trigger,
            who=self.who,
            reverts_id=original.id,
            reason=why,
        )
        spec = (
            self.x.runbook(original.runbook)
            if self._known(original)
            else _placeholder(original.runbook)
        )
        run = self.x.new_run(spec, client, record.id, dry_run=False, approved=True)
        try:
            with engine_lock(self.store, client.url, record.id) as renew:
                run.renew = renew
                return self._restore(run, original, stepwise, healthy_period_seconds)
        except EngineBusy as busy:
            return run.finish(ExecutionStatus.REFUSED, ExitCode.USAGE, str(busy))

    def _known(self, original: ExecutionRecord) -> bool:
        return self.x.catalog is not None and original.runbook in self.x.catalog

    def _refusal(self, original: ExecutionRecord) -> str | None:
        if original.reverts_id is not None:
            return f"execution #{original.id} is itself a revert (of #{original.reverts_id})"
        if original.dry_run:
            return f"execution #{original.id} was a dry run: it changed nothing"
        if original.status == ExecutionStatus.REVERTED:
            return f"execution #{original.id} is already reverted"
        if original.status == ExecutionStatus.ROLLED_BACK:
            return f"execution #{original.id} was already rolled back"
        if original.status in ACTIVE_STATUSES:
            return f"execution #{original.id} is still {original.status}"
        if original.status not in (ExecutionStatus.SUCCEEDED, ExecutionStatus.FAILED):
            return f"execution #{original.id} is {original.status}: nothing to revert"
        if not revertible_steps(original) and not drained_steps(original):
            return f"execution #{original.id} changed no knob: nothing to revert"
        return None

    def _restore(
        self,
        run: Run,
        original: ExecutionRecord,
        stepwise: bool,
        healthy_period_seconds: float | None,
    ) -> ExecutionResult:
        store = self.store
        steps = revertible_steps(original)
        targets = restore_targets(steps)
        spec = run.spec
        fractions: tuple[float, ...] = spec.revert.stepwise if stepwise else ()
        fractions = fractions or (1.0,)
        healthy = (
            spec.revert.healthy_period_seconds
            if healthy_period_seconds is None
            else healthy_period_seconds
        )
        drains = drained_steps(original)
        if not targets:
            fractions = ()  # only a drain to undo
        store.transition(run.id, ExecutionStatus.RUNNING)
        try:
            run.checks()
            if drains:
                problem = self._undrain(run, original)
                if problem is not None:
                    return run.finish(ExecutionStatus.FAILED, ExitCode.FAILED, problem)
            assert run.reader.last_state is not None  # checks() read it
            start = {k: getattr(run.reader.last_state.knobs, k) for k in targets}
            for stage, fraction in enumerate(fractions):
                goal = stage_values(start, targets, fraction)
                # Before this stage: the healthy check compares against it.
                stage_baseline = run.reader.read() if stage else dict(run.baseline)
                stage_step: int | None = None
                state = run.client.state()
                before = {k: getattr(state.knobs, k) for k in goal}
                changes = {k: v for k, v in goal.items() if before[k] != v}
                params = {"of_execution": original.id, "fraction": fraction}
                if not changes:
                    store.add_step(
                        run.id,
                        "revert_knobs",
                        {**params, "note": "already there"},
                        status=STEP_SKIPPED,
                    )
                else:
                    row = store.add_step(run.id, "revert_knobs", params, before=before)
                    try:
                        result = run.client.set_knobs(**changes)
                    except EngineClientError as error:
                        store.finish_step(row.id, STEP_FAILED, error=one_line(error))
                        raise
                    stage_step = result.effective_from_step
                    store.finish_step(
                        row.id,
                        STEP_APPLIED,
                        after={k: getattr(result.after, k) for k in goal},
                        applied_at_step=stage_step,
                    )
                if stage < len(fractions) - 1:
                    problem = self._unhealthy(run, healthy, stage_baseline, stage_step)
                    if problem is not None:
                        return run.finish(
                            ExecutionStatus.FAILED,
                            ExitCode.FAILED,
                            f"stepwise revert halted after {fraction:.0%}: {problem}; "
                            f"execution #{original.id} is left partly restored",
                        )
        except EngineClientError as error:
            return run.finish(ExecutionStatus.FAILED, error.exit_code, one_line(error))
        for step in [*steps, *drains]:
            store.finish_step(step.id, STEP_REVERTED)
        store.transition(
            original.id, ExecutionStatus.REVERTED, reason=f"reverted by execution #{run.id}"
        )
        return run.finish(
            ExecutionStatus.SUCCEEDED,
            ExitCode.OK,
            f"execution #{original.id} reverted" + (f": {self.reason}" if self.reason else ""),
        )

    def _undrain(self, run: Run, original: ExecutionRecord) -> str | None:
        """Route to the engine again; a problem (no router known, the router
        refused) as one line, None when it is back in rotation."""
        binding = self.x.routers.get(run.client.url)
        params = {"of_execution": original.id}
        if binding is None:
            return (
                f"execution #{original.id} drained the engine, but no router is configured for it"
            )
        row = self.store.add_step(run.id, "revert_drain", params, before={"routed": False})
        try:
            added = undo_drain(binding)
        except RouterError as error:
            self.store.finish_step(row.id, STEP_FAILED, error=one_line(error))
            return one_line(error)
        after = {"routed": True} if added else {"routed": True, "note": "already in rotation"}
        self.store.finish_step(row.id, STEP_APPLIED, after=after)
        return None

    def _unhealthy(
        self,
        run: Run,
        seconds: float,
        baseline: Mapping[str, Any],
        from_step: int | None,
    ) -> str | None:
        """Watch a healthy period after a stage; the first signal measurably
        worse than before the stage, read only from the stage's step on
        (rates and percentiles over that period, like a verification), or None."""
        v = run.spec.verification
        watched = ([v.signal] if v else []) + list(v.rollback_if_worse if v else ())
        tolerance = v.tolerance if v else 0.1
        end = self.x.clock() + seconds
        while self.x.clock() < end:
            self.x.wait(min(self.x.poll_seconds, end - self.x.clock()), run.renew)
        now = run.reader.read(since_step=from_step)
        for signal in watched:
            direction = v.direction if v and signal == v.signal else None
            if worse(signal, now.get(signal), baseline.get(signal), direction, tolerance):
                return f"{signal} got worse ({_fmt(baseline[signal])} → {_fmt(now[signal])})"
        return None


def stage_values(
    start: Mapping[str, Any], targets: Mapping[str, Any], fraction: float
) -> dict[str, Any]:
    """Knob values `fraction` of the way from `start` back to `targets`.

    Numbers move proportionally (rounded towards the target); the policy is
    not a number and switches back at the last stage. The autopilot (a
    switch) goes back at the first: left on, it would move max_num_seqs
    against the stages.
    """
    goal: dict[str, Any] = {}
    for knob, target in targets.items():
        current = start[knob]
        if fraction >= 1.0 or current == target or isinstance(target, bool):
            goal[knob] = target
        elif isinstance(target, int) and isinstance(current, int):
            step = (target - current) * fraction
            goal[knob] = current + (math.ceil(step) if step > 0 else math.floor(step))
        else:
            goal[knob] = current
    return goal


def _placeholder(name: str) -> Runbook:
    """A stand-in for a runbook no longer in the catalog (revert needs no more)."""
    return Runbook.model_validate(
        {
            "name": name,
            "description": "(not in the catalog)",
            "steps": [{"action": "advise", "params": {"text": "-"}}],
        }
    )
