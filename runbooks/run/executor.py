"""The guarded executor: run a runbook against one engine, journaled, verified, reversible.

    executor = Executor(Journal(url))
    result = executor.execute("oom-pressure", "http://127.0.0.1:9360", approved=True)
    result.exit_code, result.record          # an ExitCode: OK, FAILED, USAGE (refused), ENGINE
    executor.revert(result.record.id)        # restore the recorded before-values

One execution, in order:
1. `create_execution` (pending). An alert episode already executed returns
   that execution untouched (duplicate webhook deliveries, HA replicas).
2. The per-engine lock: a lease row per engine in the store, so two
   executions on one engine never interleave, across processes and
   replicas. A lock left by a dead process (SIGKILL) is taken over.
3. Checks: `/v1/state` → the runbook's diagnostics, journaled and shown:
   each gauge's value now, and its peak and mean over the alert's episode
   (from its condition's start, startsAt minus the rule's `for`; the
   collector's window without an alert).
4. Admission, serialised by a store-wide lease: approval, cooldown per
   (runbook, engine), max runs per hour, blast radius (engines under
   remediation). A refusal is journaled as `refused` with the reason.
5. Steps through the action registry. A mutating step is journaled
   `applying` with its before-values *before* the engine is touched, then
   `applied` with the after-values and the engine step it took effect at.
   `when` conditions wait and read the live signal. A failing step rolls
   back every step applied before it (nothing is left half-applied).
6. Verification: poll the signal until the deadline; success as soon as it
   moved the expected way; the circuit breaker rolls back when a guarded
   rate (or the signal itself, at the deadline) got worse.

Where the pieces live: the lock, admission and the refusals in
guardrails.py (the store answers their queries), reverting in revert.py,
the result in outcome.py (its exit codes: exit_codes.py). This module is the run.

Dry runs take no lock and pass no guardrail: they read, ask the agent what
each step would change (`dry_run: true`), journal `planned` steps, and
change nothing. An alert's dry run is advisory mode's advice (run/advisory.py):
it asks the agent nothing (the changes are computed from `/v1/state`) and its
`reason` says what a real run would have done (acted, or the refusal it met).
"""

from __future__ import annotations

import getpass
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from vllm_runbook.collector.agent_api import AgentState, SettledSince
from vllm_runbook.rules.slo import SloSpec
from vllm_runbook.runbooks.engine.client import (
    Agent,
    EngineClient,
    EngineClientError,
    EngineUnreachable,
)
from vllm_runbook.runbooks.engine.operations import (
    ActionContext,
    ActionOutcome,
    SignalReader,
    engine_registry,
)
from vllm_runbook.runbooks.engine.routing import RouterBinding
from vllm_runbook.runbooks.engine.sources import (
    API_SIGNALS,
    SLO_BURN_RATE,
    WINDOWED,
    autopilot_position,
    check_episode,
    runbook_readings,
    signals_from_state,
)
from vllm_runbook.runbooks.model.actions import ActionError, ActionRegistry
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import (
    Catalog,
    Runbook,
    StepSpec,
    load_catalog,
)
from vllm_runbook.runbooks.run.advisory import (
    WOULD_ACT,
    WOULD_REFUSE,
    AdvisoryAgent,
    is_advised,
)
from vllm_runbook.runbooks.run.conditions import (
    alert_slo,
    describe_condition,
    episode_seconds,
    holds,
    slo_verification,
)
from vllm_runbook.runbooks.run.guardrails import (
    admission,
    breaker_hold,
    engine_lock,
    format_duration,
    guardrail_refusal,
)
from vllm_runbook.runbooks.run.outcome import (
    Abort,
    EngineBusy,
    EngineGone,
    ExecutionResult,
    UnknownRunbook,
    one_line,
)
from vllm_runbook.runbooks.run.render import format_signal
from vllm_runbook.runbooks.run.revert import (
    Revert,
    RevertRefused,
    restore_targets,
)
from vllm_runbook.runbooks.run.verification import IMPROVED, NO_CHANGE, WORSE, measure
from vllm_runbook.runbooks.store import Journal, StepRecord
from vllm_runbook.runbooks.store.models import (
    NOTHING_TO_IMPROVE,
    STEP_APPLIED,
    STEP_APPLYING,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_PLANNED,
    STEP_REVERTED,
    STEP_SKIPPED,
    ExecutionStatus,
)

# The CLI, the service and the tests import these from here (their home is
# outcome.py, guardrails.py and revert.py).
__all__ = [
    "EngineBusy",
    "ExecutionResult",
    "Executor",
    "RevertRefused",
    "Run",
    "UnknownRunbook",
    "default_who",
    "describe_condition",
    "format_duration",
]


def default_who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return f"uid {os.getuid()}"


@dataclass
class Executor:
    """Runs runbooks and reverts them. One instance may serve many executions
    (the service keeps one); all shared state lives in the store."""

    store: Journal
    catalog: Catalog | None = None
    registry: ActionRegistry = field(default_factory=engine_registry)
    client_factory: Callable[[str], Agent] = EngineClient
    # Agent URL (normalized) -> the engine's vLLM API server, for warm-up requests.
    api_urls: Mapping[str, str] = field(default_factory=dict)
    # Agent URL (normalized) -> where the engine is routed (drain, undrain, restart).
    routers: Mapping[str, RouterBinding] = field(default_factory=dict)
    # Agent URL -> why the engine is gone (it left the inventory), None while it
    # is there (service/discovery.py); None: engines never go (the CLI).
    gone: Callable[[str], str | None] | None = None
    # Seconds between signal reads while waiting (conditions, verification).
    poll_seconds: float = 1.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    # After the circuit breaker rolled a change back on an engine, automatic
    # executions there are refused this long (the config's breaker.cooldown).
    breaker_hold_seconds: float = 0.0
    # The configuration's `slos:`: an execution one of their burn-rate alerts
    # started verifies on the SLO's burn rate (`slo_verification`).
    slos: Sequence[SloSpec] = ()
    # Alert name -> its rule's `for` (seconds): an alert's checks read its episode
    # from startsAt minus it (an alert not here: from startsAt).
    alert_for_seconds: Mapping[str, float] = field(default_factory=dict)
    # The wall clock an alert's startsAt is compared with (tests set a fixed one).
    wall_clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))

    def __post_init__(self) -> None:
        if self.catalog is None:
            self.catalog = load_catalog(registry=self.registry)

    def knobs_of(self, spec: Runbook) -> frozenset[str] | None:
        """The engine knobs `spec`'s steps may change; None where an action
        that changes the engine does not say which (held by any breaker trip)."""
        knobs: set[str] = set()
        for step in spec.steps:
            if step.action not in self.registry:
                continue
            action = self.registry.get(step.action)
            if action.mutating and not action.knobs:
                return None
            knobs.update(action.knobs)
        return frozenset(knobs)

    # --- public API ------------------------------------------------------------------

    def runbook(self, name: str) -> Runbook:
        assert self.catalog is not None
        try:
            return self.catalog[name]
        except KeyError:
            known = ", ".join(self.catalog) or "none"
            raise UnknownRunbook(f"unknown runbook {name!r} (known: {known})") from None

    def execute(
        self,
        runbook: Runbook | str,
        engine_url: str,
        *,
        trigger: str = "cli",
        who: str | None = None,
        alert_fingerprint: str | None = None,
        alert_starts_at: datetime | None = None,
        dry_run: bool = False,
        approved: bool = False,
        verify_seconds: float | None = None,
        condition_seconds: float | None = None,
    ) -> ExecutionResult:
        """Run `runbook` against the engine agent at `engine_url`.

        `approved` is the operator's (or the service's) consent for runbooks
        with `requires_approval`. `verify_seconds` / `condition_seconds`
        override the verification deadline and every `when.after_seconds`.
        Raises StoreUnavailable when the journal cannot be written; every
        other outcome is in the result.
        """
        spec = self.runbook(runbook) if isinstance(runbook, str) else runbook
        client = self.client_factory(engine_url)
        record, created = self.store.create_execution(
            spec.name,
            client.url,
            trigger=trigger,
            who=who or default_who(),
            dry_run=dry_run,
            alert_fingerprint=alert_fingerprint,
            alert_starts_at=alert_starts_at,
        )
        if not created:
            return ExecutionResult(
                record,
                ExitCode.OK,
                f"alert episode already handled by execution #{record.id}",
                created=False,
            )
        run = Run(self, spec, client, record.id, dry_run, approved)
        run.verify_seconds = verify_seconds
        run.condition_seconds = condition_seconds
        return run.execute()

    def run_pending(
        self,
        execution_id: int,
        *,
        approved: bool,
        verify_seconds: float | None = None,
        condition_seconds: float | None = None,
    ) -> ExecutionResult:
        """Run an execution another component recorded as pending (the webhook
        records one per alert episode; the service's worker runs it). The
        caller makes sure one process runs it (see vllm_runbook.runbooks.service.worker)."""
        record = self.store.get_execution(execution_id)
        spec = self.runbook(record.runbook)
        run = Run(
            self, spec, self.client_factory(record.engine), record.id, record.dry_run, approved
        )
        run.verify_seconds = verify_seconds
        run.condition_seconds = condition_seconds
        return run.execute()

    def new_run(
        self,
        spec: Runbook,
        client: Agent,
        execution_id: int,
        *,
        dry_run: bool,
        approved: bool,
    ) -> Run:
        """The state of one execution about to run (a revert runs one too)."""
        return Run(self, spec, client, execution_id, dry_run, approved)

    def revert(
        self,
        execution_id: int,
        *,
        who: str | None = None,
        trigger: str = "cli",
        stepwise: bool = False,
        healthy_period_seconds: float | None = None,
        reason: str | None = None,
    ) -> ExecutionResult:
        """Restore the before-values an execution recorded; mark it reverted.

        `stepwise` restores in the runbook's stages (e.g. 50 % then 100 % of
        the way back), waiting a healthy period between stages and halting if
        the runbook's verification or guarded signals get worse meanwhile.
        The revert is itself an execution (`reverts_id` = the original),
        with trigger 'cli' or 'rule' (an alert episode belongs to the
        original). Raises RevertRefused when there is nothing to revert.
        """
        return Revert(self, execution_id, who or default_who(), trigger, reason).run(
            stepwise, healthy_period_seconds
        )

    def wait(self, seconds: float, renew: Callable[[], None] | None) -> None:
        """Sleep in poll-sized slices, keeping the engine lock alive."""
        end = self.clock() + seconds
        while (left := end - self.clock()) > 0:
            if renew is not None:
                renew()
            self.sleep(min(self.poll_seconds, left))


class Run:
    """One execution's state while it runs (not shared, not reused)."""

    def __init__(
        self,
        executor: Executor,
        spec: Runbook,
        client: Agent,
        execution_id: int,
        dry_run: bool,
        approved: bool,
    ) -> None:
        self.x = executor
        self.store = executor.store
        self.spec = spec
        self.id = execution_id
        self.dry_run = dry_run
        self.approved = approved
        self.verify_seconds: float | None = None
        self.condition_seconds: float | None = None
        # An SLO's burn-rate alert started it: verified on the SLO's burn rate.
        record = self.store.get_execution(execution_id)
        # Advisory mode (run/advisory.py): an alert's dry run, whose writes
        # are never sent, not even as the agent's dry runs.
        self.advised = is_advised(record.dry_run, record.trigger)
        self.client = client = AdvisoryAgent(client) if self.advised else client
        self.slo = alert_slo(executor.slos, record.who) if record.trigger == "alert" else None
        self.alert = (record.who, record.alert_starts_at) if record.trigger == "alert" else None
        if self.slo is not None and spec.verification is not None:
            spec = self.spec = spec.model_copy(
                update={"verification": slo_verification(spec.verification)}
            )
        # vLLM's API server /metrics is read only for a runbook that names its signals.
        named = {sig for _, _, sig in runbook_readings(spec)}
        named |= {s.when.signal for s in spec.steps if s.when is not None}
        names_api = bool(named & API_SIGNALS)
        self.reader = SignalReader(
            client,
            clock=executor.clock,
            api_url=executor.api_urls.get(client.url) if names_api else None,
            slo=self.slo[0] if self.slo is not None else None,
        )
        self.renew: Callable[[], None] | None = None
        self.applied: list[StepRecord] = []
        self.warnings: list[str] = []
        self.baseline: dict[str, Any] = {}
        self.baseline_unavailable: dict[str, str] = {}

    def result(self, exit_code: ExitCode, message: str | None = None) -> ExecutionResult:
        return ExecutionResult(
            self.store.get_execution(self.id), exit_code, message, warnings=tuple(self.warnings)
        )

    def finish(self, status: str, exit_code: ExitCode, message: str | None) -> ExecutionResult:
        record = self.store.get_execution(self.id)
        if record.status != status:
            error = (
                message if status in (ExecutionStatus.FAILED, ExecutionStatus.ROLLED_BACK) else None
            )
            reason = (
                message if status in (ExecutionStatus.REFUSED, ExecutionStatus.SUCCEEDED) else None
            )
            self.store.transition(self.id, status, error, reason=reason)
        return self.result(exit_code, None if status == ExecutionStatus.SUCCEEDED else message)

    def gone(self) -> str | None:
        return self.x.gone(self.client.url) if self.x.gone is not None else None

    def _still_there(self) -> None:
        why = self.gone()
        if why is not None:
            raise EngineGone(why)

    def execute(self) -> ExecutionResult:
        why = self.gone()
        if why is not None:  # left the inventory before this execution started
            return self.finish(ExecutionStatus.REFUSED, ExitCode.ENGINE, why)
        if self.dry_run:
            return self._guard(self._dry_run)
        try:
            with engine_lock(self.store, self.client.url, self.id) as renew:

                def renew_if_there() -> None:
                    # Called before every action and at every wait's slice: an
                    # engine that left the inventory ends the execution there.
                    self._still_there()
                    renew()

                self.renew = renew_if_there
                return self._guard(self._real_run)
        except EngineBusy as busy:
            return self.finish(ExecutionStatus.REFUSED, ExitCode.USAGE, str(busy))

    def _ended_gone(self, why: str) -> ExecutionResult:
        """The engine left the inventory (a pod scaled away): nothing is reverted on
        it, nothing retried; the steps applied stay as the journal recorded them."""
        if self.applied:
            why += f"; not reverted ({len(self.applied)} step(s) applied on it)"
        return self.finish(ExecutionStatus.FAILED, ExitCode.ENGINE, why)

    def _guard(self, body: Callable[[], ExecutionResult]) -> ExecutionResult:
        """Turn errors into a final status; roll back whatever was applied."""
        try:
            return body()
        except EngineGone as gone:
            return self._ended_gone(gone.message)
        except Abort as abort:
            if self.applied:
                return self._roll_back(abort.message, abort.exit_code)
            return self.finish(abort.status, abort.exit_code, abort.message)
        except EngineClientError as error:
            message = one_line(error)
            why = self.gone()
            if why is not None:  # it failed because the engine went away
                return self._ended_gone(f"{why} ({message})")
            if self.applied:
                # Rolled back = exit 1, unless the engine itself is gone (3).
                code = ExitCode.ENGINE if error.exit_code == ExitCode.ENGINE else ExitCode.FAILED
                return self._roll_back(message, code)
            return self.finish(ExecutionStatus.FAILED, error.exit_code, message)
        except ActionError as error:
            message = one_line(error)
            if self.applied:
                return self._roll_back(message, ExitCode.FAILED)
            return self.finish(ExecutionStatus.FAILED, ExitCode.FAILED, message)

    # --- the phases --------------------------------------------------------------------

    def checks(self) -> None:
        span = None
        if self.alert is not None:
            who, starts_at = self.alert
            span = episode_seconds(who, starts_at, self.x.alert_for_seconds, self.x.wall_clock())
        signals = self.reader.read(episode_seconds=span)
        episode = None if self.reader.last_state is None else self.reader.last_state.episode
        self.baseline = dict(signals)
        self.baseline_unavailable = dict(self.reader.unavailable)
        if self.slo is not None:
            # Before the change: the burn rate the alert fired at (its long and
            # short windows both above it), a lower bound of the true one.
            self.baseline[SLO_BURN_RATE] = self.slo[1].factor
            self.baseline_unavailable.pop(SLO_BURN_RATE, None)
        checks: dict[str, Any] = {}
        for c in self.spec.checks:
            checks[c.name] = {
                "signal": c.signal,
                "description": c.description,
                "value": signals[c.signal],
            }
            if signals[c.signal] is None:
                checks[c.name]["unavailable"] = self.baseline_unavailable.get(c.signal, "not read")
            # Peak and mean over the episode beside the value now: a read between
            # two waves of a burst is never shown alone.
            checks[c.name].update(check_episode(episode, c.signal))
        self.store.record_checks(self.id, checks)

    def _required_guards_refusal(self) -> str | None:
        """A required guard that cannot be read refuses the run before any change."""
        v = self.spec.verification
        if v is None:
            return None
        unread = [
            f"{g} ({self.baseline_unavailable.get(g, 'not read')})"
            for g in v.required_guards
            if self.baseline.get(g) is None
        ]
        if not unread:
            return None
        return f"required guard cannot be read on this engine: {'; '.join(unread)}"

    def _breaker_hold(self) -> str | None:
        """Automatic executions (an alert's, a rule's) wait out the breaker's hold."""
        if self.store.get_execution(self.id).trigger == "cli":
            return None
        return breaker_hold(
            self.store, self.client.url, self.x.breaker_hold_seconds, self.x.knobs_of(self.spec)
        )

    def _nothing_to_improve(self) -> str | None:
        """Why there is nothing to fix now (before any change), or None.

        The runbook's `acts_only_if` conditions on the checks' reading (an
        unreadable signal cannot show the condition either); then, for a
        runbook whose mutating steps are all unconditional, whether every one
        of them would change nothing (asked as a dry run)."""
        for when in self.spec.acts_only_if:
            value = self.baseline.get(when.signal)
            if value is None:
                why = self.baseline_unavailable.get(when.signal, "not read")
                return f"{NOTHING_TO_IMPROVE}: {when.signal} cannot be read ({why})"
            if not holds(when, value):
                return (
                    f"{NOTHING_TO_IMPROVE}: {when.signal} = {format_signal(when.signal, value)}, "
                    f"the runbook acts only if {describe_condition(when)}"
                )
        mutating = [
            s
            for s in self.spec.steps
            if s.action in self.x.registry and self.x.registry.get(s.action).mutating
        ]
        if not mutating or any(s.when is not None for s in mutating):
            return None
        notes = []
        probe = Run(self.x, self.spec, self.client, self.id, dry_run=True, approved=False)
        for step in mutating:
            # On the checks' reading: what each step would do to the engine as it was.
            try:
                outcome = probe._call(step, {}, state=self.reader.last_state)
            except (EngineClientError, ActionError):
                return None  # the run itself meets (and journals) what the probe met
            if outcome.skipped is None and outcome.before != outcome.after:
                return None
            notes.append(f"{step.action}: {outcome.skipped or 'already so'}")
        return f"{NOTHING_TO_IMPROVE}: every step would change nothing ({'; '.join(notes)})"

    def _dry_run(self) -> ExecutionResult:
        self.store.transition(self.id, ExecutionStatus.RUNNING)
        self.checks()
        # The breaker's hold first: while it holds, automatic runs are refused
        # whatever the engine shows (the on-call should see why nothing acts).
        hold = self._breaker_hold()
        if hold and not self.advised:
            raise Abort(ExecutionStatus.REFUSED, ExitCode.USAGE, hold)
        nothing = self._nothing_to_improve()
        if nothing:
            self.warnings.append(f"a real run would be refused now: {nothing}")
        refusal = guardrail_refusal(self.store, self.spec, self.client.url, approved=True)
        if refusal:
            self.warnings.append(f"a real run would be refused now: {refusal}")
        if self.spec.guardrails.requires_approval and not self.advised:
            self.warnings.append(f"runbook {self.spec.name} requires approval (--yes)")
        required = self._required_guards_refusal()
        if required:
            self.warnings.append(f"a real run would be refused now: {required}")
        # Advice names the first refusal a real run would meet, in its order.
        first = next((r for r in (hold, required, refusal, nothing) if r), None)
        for step in self.spec.steps:
            details: dict[str, Any] = {}
            if step.when is not None:
                # A dry run does not wait: show the condition and its value now.
                details["when"] = describe_condition(step.when)
                details["observed_now"] = self.baseline.get(step.when.signal)
            outcome = self._call(step, details)
            params = {**step.params, **details, **outcome.details}
            if outcome.skipped is not None:
                params["note"] = outcome.skipped
                self.store.add_step(self.id, step.action, params, status=STEP_SKIPPED)
            else:
                self.store.add_step(
                    self.id,
                    step.action,
                    params,
                    before=outcome.before,
                    after=outcome.after,
                    status=STEP_PLANNED,
                )
        if self.advised:
            advice = WOULD_ACT if first is None else f"{WOULD_REFUSE}: {first}"
            return self.finish(ExecutionStatus.SUCCEEDED, ExitCode.OK, advice)
        return self.finish(ExecutionStatus.SUCCEEDED, ExitCode.OK, "dry run: nothing changed")

    def _real_run(self) -> ExecutionResult:
        # A crashed run on this host still says 'running': settle it first, so
        # it neither blocks the blast radius nor looks alive in the journal.
        self.store.recover_interrupted()
        self.checks()
        # The breaker's hold first: while it holds, automatic runs are refused
        # whatever the engine shows (the on-call should see why nothing acts).
        hold = self._breaker_hold()
        if hold:
            raise Abort(ExecutionStatus.REFUSED, ExitCode.USAGE, hold)
        with admission(self.store, self.id, self.x.clock):
            refusal = self._required_guards_refusal() or guardrail_refusal(
                self.store, self.spec, self.client.url, self.approved
            )
            if refusal:
                raise Abort(ExecutionStatus.REFUSED, ExitCode.USAGE, refusal)
            # After the guardrails (a cooldown is said as such), before any change.
            nothing = self._nothing_to_improve()
            if nothing:
                # Not a failure: refused before any change, counts for no guardrail.
                raise Abort(ExecutionStatus.REFUSED, ExitCode.OK, nothing)
            self.store.transition(self.id, ExecutionStatus.RUNNING)
        for index, step in enumerate(self.spec.steps):
            details: dict[str, Any] = {}
            if step.when is not None and not self._conditionholds(step, index, details):
                continue
            self._run_step(step, details)
        return self._verify()

    def _conditionholds(self, step: StepSpec, index: int, details: dict[str, Any]) -> bool:
        when = step.when
        assert when is not None
        wait = when.after_seconds if self.condition_seconds is None else self.condition_seconds
        if wait > 0:
            self.x.wait(wait, self.renew)
        observed = self.reader.read()[when.signal]
        details.update(when=describe_condition(when), observed=observed, waited_seconds=wait)
        if observed is None or not holds(when, observed):
            why = "unavailable" if observed is None else f"{observed:g}"
            details["note"] = f"condition not met ({when.signal} = {why})"
            self.store.add_step(
                self.id, step.action, {**step.params, **details}, status=STEP_SKIPPED
            )
            return False
        return True

    def _call(
        self,
        step: StepSpec,
        details: dict[str, Any],
        started: list[StepRecord] | None = None,
        state: AgentState | None = None,
    ) -> ActionOutcome:
        """Run one action on a fresh state (or `state`); `started` receives its journal row."""
        state = state if state is not None else self.client.state()
        rows = started if started is not None else []

        def begin(before: dict[str, Any], resolved: dict[str, Any]) -> None:
            if self.renew is not None:
                self.renew()  # never act without the lock
            rows.append(
                self.store.add_step(
                    self.id,
                    step.action,
                    {**step.params, **details, **resolved},
                    before=before,
                    status=STEP_APPLYING,
                )
            )

        ctx = ActionContext(
            self.client,
            state,
            self.dry_run,
            begin,
            self.x.api_urls.get(self.client.url),
            wait=lambda seconds: self.x.wait(seconds, self.renew),
            router=self.x.routers.get(self.client.url),
        )
        outcome: ActionOutcome = self.x.registry.call(step.action, step.params, ctx)
        return outcome

    def _run_step(self, step: StepSpec, details: dict[str, Any]) -> None:
        started: list[StepRecord] = []
        try:
            outcome = self._call(step, details, started)
        except (EngineClientError, ActionError) as error:
            for row in started:
                self.store.finish_step(row.id, STEP_FAILED, error=one_line(error))
            read_only = step.action in self.x.registry and not (
                self.x.registry.get(step.action).mutating
            )
            if read_only and not started:
                # A read-only action (warm-up) that failed: the journal says which.
                params = {**step.params, **details}
                row = self.store.add_step(self.id, step.action, params, status=STEP_APPLYING)
                self.store.finish_step(row.id, STEP_FAILED, error=one_line(error))
            if isinstance(error, EngineUnreachable) and started:
                # The request may have landed before the connection broke:
                # restore this step's before-values too when rolling back.
                self.applied.append(started[-1])
            raise
        params = {**step.params, **details, **outcome.details}
        if started:
            (row,) = started
            finished = self.store.finish_step(
                row.id, STEP_APPLIED, after=outcome.after, applied_at_step=outcome.applied_at_step
            )
            self.applied.append(finished)
        elif outcome.skipped is not None:
            params["note"] = outcome.skipped
            self.store.add_step(self.id, step.action, params, status=STEP_SKIPPED)
        else:
            # Read-only action (diagnostics, advice): nothing to restore.
            row = self.store.add_step(self.id, step.action, params, status=STEP_APPLYING)
            self.store.finish_step(row.id, STEP_APPLIED, after=outcome.after)
        for clamp in outcome.clamped:
            self.warnings.append(
                f"{step.action}: {clamp['knob']} clamped to {clamp['applied']} "
                f"(asked {clamp['requested']})"
            )

    def _verify(self) -> ExecutionResult:
        """Judge the change on what happened after it (see runbooks/run/verification.py)."""
        v = self.spec.verification
        changed = [s for s in self.applied if s.status == STEP_APPLIED and s.before]
        if v is None or not changed:
            why = "no verification" if v is None else "nothing changed"
            return self.finish(ExecutionStatus.SUCCEEDED, ExitCode.OK, why)
        self.store.transition(self.id, ExecutionStatus.VERIFYING)
        deadline_s = v.deadline_seconds if self.verify_seconds is None else self.verify_seconds
        steps = [s.applied_at_step for s in changed if s.applied_at_step is not None]
        from_step = max(steps) if steps else None
        last = self.reader.last_state
        window = None if last is None else last.stats.window_seconds

        def change_facts() -> dict[str, Any] | None:
            since = self.reader.last_since
            return since.model_dump() if isinstance(since, SettledSince) else None

        report = measure(
            lambda step: self.reader.read(since_step=step),
            lambda: self.reader.unavailable,
            v,
            self.baseline,
            self.baseline_unavailable,
            from_step,
            deadline_s=deadline_s,
            window_s=float(window) if window else None,
            clock=self.x.clock,
            wait=lambda seconds: self.x.wait(seconds, self.renew),
            poll_s=self.x.poll_seconds,
            change=change_facts,
            settled=lambda: from_step is None or self.reader.settled,
        )
        tripped = report.pop("tripped")
        if self.slo is not None:
            slo, pair = self.slo
            report["slo"] = {
                "name": slo.name,
                "objective": slo.describe(),
                "alert_burn_rate": pair.factor,
                "long_window_seconds": pair.long,
            }
        settled = autopilot_position(self.reader.last_state)
        if settled is not None:
            # Handed over to the autopilot: where it had max_num_seqs when judged.
            report["autopilot"] = settled
        # The raw post-change measurement, and what a trailing window (which
        # still holds the time before the change) would have said: shown, never used.
        since = self.reader.last_since
        report["measurement"] = None if since is None else since.model_dump(mode="json")
        if v.signal in WINDOWED and self.reader.last_state is not None:
            report["trailing_window_after"] = signals_from_state(self.reader.last_state).get(
                v.signal
            )
        self.store.record_verification(self.id, report)
        before, after, outcome = report["before"], report["after"], report["outcome"]
        for guard, row in report["guards"].items():
            if str(row["outcome"]).startswith("unavailable"):
                self.warnings.append(f"guard {guard} {row['outcome']}")
        if tripped is not None:
            row = report["guards"][tripped]
            return self._roll_back(
                f"circuit breaker: guard {tripped} got worse "
                f"({format_signal(tripped, row['before'])} → "
                f"{format_signal(tripped, row['after'])}) after the change",
                ExitCode.FAILED,
            )
        if outcome == IMPROVED:
            return self.finish(ExecutionStatus.SUCCEEDED, ExitCode.OK, None)
        if outcome.startswith("not in effect"):
            return self.finish(
                ExecutionStatus.FAILED,
                ExitCode.FAILED,
                f"verification: {outcome}; changes kept, `runbook revert {self.id}` restores them",
            )
        if outcome.startswith("unverified"):
            self.warnings.append(outcome)
            return self.finish(ExecutionStatus.SUCCEEDED, ExitCode.OK, outcome)
        change = f"{format_signal(v.signal, before)} → {format_signal(v.signal, after)}"
        if outcome == WORSE:
            return self._roll_back(
                f"circuit breaker: {v.signal} got worse ({change}) after the change",
                ExitCode.FAILED,
            )
        assert outcome == NO_CHANGE
        return self.finish(
            ExecutionStatus.FAILED,
            ExitCode.FAILED,
            f"verification: no measurable change in {v.signal} ({change}; needed "
            f"{report['needed']}) within {report['measured_seconds']:g} s after the change; "
            f"changes kept, `runbook revert {self.id}` restores them",
        )

    def _roll_back(self, why: str, exit_code: ExitCode) -> ExecutionResult:
        """Restore the before-values of every step applied so far, newest first."""
        targets = restore_targets(self.applied)
        try:
            if targets:
                self.client.set_knobs(**targets)
        except EngineClientError as error:
            message = (
                f"{why}; rollback failed: {one_line(error)}; "
                f"`runbook revert {self.id}` restores the recorded before-values"
            )
            return self.finish(ExecutionStatus.FAILED, error.exit_code, message)
        for step in self.applied:
            current = self.store.get_execution(self.id)
            status = next((s.status for s in current.steps if s.id == step.id), None)
            if status in (STEP_APPLIED, STEP_INTERRUPTED):
                self.store.finish_step(step.id, STEP_REVERTED)
        return self.finish(ExecutionStatus.ROLLED_BACK, exit_code, f"{why}; rolled back")
