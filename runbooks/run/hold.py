"""An undo judged as carefully as a fix: the revert's hold and the judge of reverts.

    hold_on_resolve(executor, runbook, engine, fingerprint, starts_at)  # its alert resolved
    Holds(executor).judge(record)      # each worker pass: revert once the cause is gone
    reapply_if_premature(executor, pending)   # the finding came back after a revert

A finding often resolves *because the fix works* (the FCFS switch serves the
starving requests), not because its cause is gone: reverting at once brings
the symptom back. So when the alert of an execution resolves, the execution
holds its changes ("holding"). Its revert starts only when both

- `revert.hold_seconds` have passed since the resolution, and
- every `revert.until` condition (the cause's signals, e.g. no request
  waiting over 2 s for its first schedule: what arrives is drained) has held
  on every reading for `hold_seconds` on end (an unreadable engine resets it).

A revert is then watched: when the runbook's finding fires again on that
engine within `revert.watch_seconds` of the revert (the verification's
deadline when unset), the revert was premature. The pending execution of the
returning finding re-applies the last stage that held (the knob values the
revert's last stage replaced) instead of running the runbook afresh, the
revert is marked premature (linked to the execution it undid) and notified,
and the service counts it per engine and runbook.

No knob turns round more than twice an hour on one engine for one runbook
without a person: a revert that would be the third change of direction (the
runbook's knob-changing executions of the last hour: fix, revert, re-apply or
a new fix) is held for a person, who releases it with `runbook revert N` or
the page. So a second premature revert of the same fix never happens by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from vllm_runbook.runbooks.engine.client import EngineClientError
from vllm_runbook.runbooks.engine.operations import KNOBS, SignalReader
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import Condition, Runbook
from vllm_runbook.runbooks.run.conditions import describe_condition, holds
from vllm_runbook.runbooks.run.guardrails import engine_lock
from vllm_runbook.runbooks.run.outcome import EngineBusy, ExecutionResult, one_line
from vllm_runbook.runbooks.run.revert import Executor, revertible_steps
from vllm_runbook.runbooks.store import ExecutionRecord
from vllm_runbook.runbooks.store.models import (
    HOLDABLE_STATUSES,
    STEP_APPLIED,
    STEP_FAILED,
    ExecutionStatus,
    utcnow,
)

# Within this span, a runbook's knobs on one engine change direction at most
# twice without a person (fix → revert → re-apply, or fix → revert → new fix).
DIRECTION_WINDOW: Final = timedelta(hours=1)
MAX_AUTOMATIC_CHANGES: Final = 3  # knob-changing executions in the window: 2 turns
WHO: Final = "hold"  # `who` of the reverts a hold releases
REAPPLY: Final = "reapply_knobs"  # the step of a re-apply after a premature revert
# An advised execution's note when its finding resolved (its hold_since: when).
ADVICE_RESOLVED: Final = "advisory mode: the finding resolved by itself; nothing was changed"


def _eligible(spec: Runbook, record: ExecutionRecord | None) -> ExecutionRecord | None:
    if (
        record is None
        or not spec.revert.on_resolve
        or record.dry_run
        or record.status not in HOLDABLE_STATUSES
        or record.hold_since is not None
        or not revertible_steps(record)
    ):
        return None
    return record


def hold_on_resolve(
    executor: Executor,
    runbook: str,
    engine_url: str,
    fingerprint: str,
    starts_at: datetime,
    *,
    hold_seconds: float | None = None,
) -> ExecutionRecord | None:
    """The alert of an episode resolved: its execution holds its changes until
    the revert's conditions are met (`Holds.judge`). None when there is
    nothing to revert (the runbook does not revert on resolve, a dry run, no
    knob changed)."""
    spec = executor.runbook(runbook)
    engine = executor.client_factory(engine_url).url
    found = executor.store.find_episode(runbook, engine, fingerprint, starts_at)
    if found is not None and found.advised:
        # Advisory mode changed nothing: the journal keeps when the finding
        # resolved by itself (`runbook report` compares it with the advice).
        if found.status != ExecutionStatus.SUCCEEDED or found.hold_since is not None:
            return None
        return executor.store.hold(found.id, ADVICE_RESOLVED)
    record = _eligible(spec, found)
    if record is None:
        return None
    hold = spec.revert.hold_seconds if hold_seconds is None else hold_seconds
    return executor.store.hold(record.id, _waiting(spec, hold, None, resolved=True))


def _waiting(spec: Runbook, hold: float, cause: str | None, *, resolved: bool = False) -> str:
    """What a holding execution waits on, in a line that changes only when
    what it waits on does (it is journaled, shown and notified)."""
    conditions = " and ".join(describe_condition(c) for c in spec.revert.until)
    if cause is not None:
        return f"the cause holds ({cause}); reverts once {conditions} for {hold:g} s on end"
    if conditions and not resolved:
        return f"the cause is gone ({conditions}); reverts after {hold:g} s of it"
    if conditions:
        return f"alert resolved; reverts once {conditions} for {hold:g} s on end"
    return f"alert resolved; reverts after a hold of {hold:g} s"


@dataclass
class Holds:
    """Judges the holding executions, once per worker pass (`judge`)."""

    executor: Executor
    # Override of every runbook's `hold_seconds` (the config's executor.hold_seconds).
    hold_seconds: float | None = None
    healthy_period_seconds: float | None = None
    # Execution id → since when its `until` conditions held on every reading.
    cause_since: dict[int, datetime] = field(default_factory=dict)
    now: Callable[[], datetime] = utcnow

    def judge(self, record: ExecutionRecord) -> ExecutionResult | None:
        """Revert `record` if its hold is over and its cause gone; else note
        what it waits on. None while it keeps holding."""
        store = self.executor.store
        if record.hold_for_person:
            return None
        catalog = self.executor.catalog
        if catalog is None or record.runbook not in catalog:
            return self._revert(record, None, "its runbook left the catalog")
        spec = self.executor.runbook(record.runbook)
        hold = spec.revert.hold_seconds if self.hold_seconds is None else self.hold_seconds
        now = self.now()
        turned = store.knob_changes_since(record.runbook, record.engine, now - DIRECTION_WINDOW)
        twice = self._second_premature(record)
        if twice is not None:
            store.note_hold(
                record.id,
                f"held for a person: the fix of #{twice} was reverted too early twice; "
                f"release: runbook revert {record.id}",
                for_person=True,
            )
            return None
        if turned >= MAX_AUTOMATIC_CHANGES:
            store.note_hold(
                record.id,
                f"held for a person: {record.runbook}'s knobs changed {turned} times on this "
                f"engine in the last hour (a revert would turn them round a third time); "
                f"release: runbook revert {record.id}",
                for_person=True,
            )
            return None
        start = record.hold_since or now
        cause: str | None = None
        if spec.revert.until:
            cause = self._cause(record, spec)
            if cause is None:
                start = max(start, self.cause_since.setdefault(record.id, now))
            else:
                self.cause_since.pop(record.id, None)
        left = hold - (now - start).total_seconds()
        if cause is not None or left > 0:
            note = _waiting(spec, hold, cause)
            if note != record.hold_note:
                store.note_hold(record.id, note)
            return None
        self.cause_since.pop(record.id, None)
        held = (now - (record.hold_since or now)).total_seconds()
        gone = " and ".join(describe_condition(c) for c in spec.revert.until)
        why = f"its alert resolved {held:.0f} s ago" + (
            f" and {gone} held for {hold:g} s" if gone else f" (hold {hold:g} s)"
        )
        return self._revert(record, spec, why)

    def _cause(self, record: ExecutionRecord, spec: Runbook) -> str | None:
        """None when every `until` condition holds now; else what fails."""
        try:
            signals = SignalReader(self.executor.client_factory(record.engine)).read()
        except EngineClientError as error:
            return f"engine unreadable: {type(error).__name__}"
        failing = []
        for condition in spec.revert.until:
            value = signals.get(condition.signal)
            if value is None:
                failing.append(f"{condition.signal} unreadable")
            elif not holds(condition, value):
                failing.append(_negated(condition))
        return "; ".join(failing) or None

    def _revert(self, record: ExecutionRecord, spec: Runbook | None, why: str) -> ExecutionResult:
        result = self.executor.revert(
            record.id,
            who=WHO,
            trigger="rule",
            stepwise=bool(spec and spec.revert.stepwise),
            healthy_period_seconds=self.healthy_period_seconds,
            reason=why,
        )
        if result.record.status == ExecutionStatus.FAILED:
            # A halted (stepwise) or failed revert is not tried again by itself
            # (one refused because the engine was busy is, at the next pass).
            self.executor.store.note_hold(
                record.id,
                f"held for a person: revert #{result.record.id} {result.record.status}"
                + (f" ({result.message})" if result.message else "")
                + f"; release: runbook revert {record.id}",
                for_person=True,
            )
        return result

    def _second_premature(self, record: ExecutionRecord) -> int | None:
        """The fix `record` re-applied when that fix was itself a re-apply: its
        revert would be the second premature one of the same fix."""
        first = _reapplied(record)
        if first is None:
            return None
        return first if _reapplied(self.executor.store.get_execution(first)) is not None else None


def _reapplied(record: ExecutionRecord) -> int | None:
    """The execution whose fix `record` re-applied after a premature revert."""
    for step in record.steps:
        if step.action == REAPPLY and step.status == STEP_APPLIED:
            of = step.params.get("of_execution")
            return int(of) if of is not None else None
    return None


def _negated(condition: Condition) -> str:
    if condition.above is not None:
        return f"{condition.signal} ≤ {condition.above:g}"
    return f"{condition.signal} ≥ {condition.below:g}"


def watch_seconds(spec: Runbook) -> float:
    """How long after a revert a returning finding makes it premature."""
    if spec.revert.watch_seconds is not None:
        return spec.revert.watch_seconds
    return spec.verification.deadline_seconds if spec.verification else 0.0


def premature_revert(executor: Executor, pending: ExecutionRecord) -> ExecutionRecord | None:
    """The revert `pending`'s finding returned after, within its watch (None
    when there is none: the pending execution runs as a new fix)."""
    if pending.trigger not in ("alert", "rule") or pending.dry_run:
        return None
    catalog = executor.catalog
    if catalog is None or pending.runbook not in catalog:
        return None
    last = executor.store.last_revert(pending.runbook, pending.engine)
    if last is None or last.premature or last.finished_at is None or last.who != WHO:
        return None
    fired = pending.alert_starts_at or pending.created_at
    after = (fired - last.finished_at).total_seconds()
    window = watch_seconds(executor.runbook(pending.runbook))
    return last if 0 <= after <= window else None


def reapply(
    executor: Executor, pending: ExecutionRecord, revert: ExecutionRecord
) -> ExecutionResult:
    """Run `pending` as the re-application of the last stage of `revert`
    that held: the knob values its last applied stage replaced."""
    store = executor.store
    applied = [s for s in revert.steps if s.status == STEP_APPLIED and s.before]
    goal = {k: v for k, v in (applied[-1].before or {}).items() if k in KNOBS} if applied else {}
    fired = pending.alert_starts_at or pending.created_at
    assert revert.finished_at is not None
    after = (fired - revert.finished_at).total_seconds()
    alert = pending.who.partition(":")[2] or pending.runbook
    client = executor.client_factory(pending.engine)
    why = (
        f"re-applies what revert #{revert.id} of #{revert.reverts_id} undid: {alert} fired "
        f"again {after:.0f} s after it (premature)"
    )
    try:
        with engine_lock(store, client.url, pending.id):
            return _reapply(executor, pending, revert, goal, why, alert, after)
    except EngineBusy as busy:
        record = store.transition(pending.id, ExecutionStatus.REFUSED, reason=str(busy))
        return ExecutionResult(record, ExitCode.USAGE, str(busy))


def _reapply(
    executor: Executor,
    pending: ExecutionRecord,
    revert: ExecutionRecord,
    goal: dict[str, Any],
    why: str,
    alert: str,
    after: float,
) -> ExecutionResult:
    store = executor.store
    client = executor.client_factory(pending.engine)
    store.transition(pending.id, ExecutionStatus.RUNNING)
    try:
        state = client.state()
        before = {k: getattr(state.knobs, k) for k in goal}
        changes = {k: v for k, v in goal.items() if before[k] != v}
        row = store.add_step(
            pending.id,
            REAPPLY,
            {"of_execution": revert.reverts_id, "premature_revert": revert.id},
            before=before,
        )
        try:
            result = client.set_knobs(**changes) if changes else None
        except EngineClientError as error:
            store.finish_step(row.id, STEP_FAILED, error=one_line(error))
            raise
        after_knobs = (
            {k: getattr(result.after, k) for k in goal} if result is not None else dict(before)
        )
        store.finish_step(
            row.id,
            STEP_APPLIED,
            after=after_knobs,
            applied_at_step=None if result is None else result.effective_from_step,
        )
    except EngineClientError as error:
        store.transition(pending.id, ExecutionStatus.FAILED, one_line(error), reason=why)
        return ExecutionResult(store.get_execution(pending.id), error.exit_code, one_line(error))
    store.mark_premature(
        revert.id,
        f"premature: {alert} fired again {after:.0f} s after it; re-applied by #{pending.id}",
    )
    record = store.transition(pending.id, ExecutionStatus.SUCCEEDED, reason=why)
    return ExecutionResult(record, ExitCode.OK, why)
