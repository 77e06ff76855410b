"""The guarded executor: run a runbook against one engine, journaled, verified, reversible.

    executor = Executor(Store(url))
    result = executor.execute("oom-pressure", "http://127.0.0.1:9360", approved=True)
    result.exit_code, result.record          # 0 ok, 1 failed/rolled back, 2 refused, 3 engine
    executor.revert(result.record.id)        # restore the recorded before-values

One execution, in order:
1. `create_execution` (pending). An alert episode already executed returns
   that execution untouched (duplicate webhook deliveries, HA replicas).
2. The per-engine lock: a lease row per engine in the store, so two
   executions on one engine never interleave, across processes and
   replicas. A lock left by a dead process (SIGKILL) is taken over.
3. Checks: `/v1/state` → the runbook's diagnostics, journaled and shown.
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

Dry runs take no lock and pass no guardrail: they read, ask the agent what
each step would change (`dry_run: true`), journal `planned` steps, and
change nothing.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import select
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.runbooks.actions import ActionError, ActionRegistry
from vllm_runbook.runbooks.client import (
    AuthFailed,
    CommandRefused,
    EngineClient,
    EngineClientError,
    EngineUnreachable,
)
from vllm_runbook.runbooks.engine_actions import (
    KNOBS,
    ActionContext,
    ActionOutcome,
    SignalReader,
    engine_registry,
)
from vllm_runbook.runbooks.render import format_signal
from vllm_runbook.runbooks.spec import Catalog, Condition, Runbook, StepSpec, load_catalog
from vllm_runbook.runbooks.store import ExecutionRecord, StepRecord, Store
from vllm_runbook.runbooks.store.models import (
    ACTIVE_STATUSES,
    FAILED,
    FINAL_STATUSES,
    REFUSED,
    REVERTED,
    ROLLED_BACK,
    RUNNING,
    STEP_APPLIED,
    STEP_APPLYING,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_PLANNED,
    STEP_REVERTED,
    STEP_SKIPPED,
    SUCCEEDED,
    VERIFYING,
    Execution,
    episode_key,
    utcnow,
)

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # the execution failed or was rolled back
EXIT_REFUSED: Final = 2  # a guardrail or the engine's bounds said no
EXIT_ENGINE: Final = 3  # engine unreachable or authentication failed
EXIT_STORE: Final = 4  # the journal's database is unavailable (raised, mapped by the CLI)

# Lease lengths: the engine lock is renewed at every poll, so its TTL only
# bounds how long a hung (not dead) process blocks the engine.
ENGINE_LOCK_TTL_S: Final = 60.0
ADMISSION_TTL_S: Final = 15.0
ADMISSION_WAIT_S: Final = 15.0

# Signals where a higher value is worse (the circuit breaker's direction).
HIGHER_IS_WORSE: Final = frozenset(
    {
        "error_rate",
        "oom_rate",
        "preemptions_per_minute",
        "p99_latency_seconds",
        "waiting_seconds_p99",
        "oldest_waiting_seconds",
        "schedule_seconds_p99",
        "kv_cache_usage_ratio",
        "block_fragmentation_ratio",
        "num_requests_waiting",
    }
)


class UnknownRunbook(LookupError):
    """No runbook of that name in the catalog."""


class EngineBusy(Exception):
    """Another live execution holds the engine's lock."""


@dataclass(frozen=True)
class ExecutionResult:
    """What happened, for the CLI and the service."""

    record: ExecutionRecord
    exit_code: int
    # One line for a person when the run did not succeed (refusal, error).
    message: str | None = None
    # False when an alert episode had already been executed (nothing done now).
    created: bool = True
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Stable JSON for `--json` and the service's API (keys only ever added)."""
        return {
            "execution": self.record.to_dict(),
            "exit_code": self.exit_code,
            "message": self.message,
            "created": self.created,
            "warnings": list(self.warnings),
        }


class _Abort(Exception):
    """Ends an execution early with a final status, exit code and message."""

    def __init__(self, status: str, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.exit_code = exit_code
        self.message = message


def describe_condition(when: Condition) -> str:
    op, bound = (">", when.above) if when.above is not None else ("<", when.below)
    wait = f" after {when.after_seconds} s" if when.after_seconds else ""
    return f"{when.signal} {op} {bound:g}{wait}"


def _holds(when: Condition, value: Any) -> bool:
    if when.above is not None:
        return bool(value > when.above)
    assert when.below is not None
    return bool(value < when.below)


def _worse(signal: str, value: Any, baseline: Any, direction: str | None = None) -> bool:
    """Whether `value` is worse than `baseline` for this signal."""
    if value is None or baseline is None:
        return False
    if direction is not None:  # the verification signal: worse = the wrong way
        return bool(value > baseline) if direction == "decrease" else bool(value < baseline)
    return bool(value > baseline) if signal in HIGHER_IS_WORSE else bool(value < baseline)


def _improved(value: Any, baseline: Any, direction: str) -> bool:
    if value is None or baseline is None:
        return False
    return bool(value < baseline) if direction == "decrease" else bool(value > baseline)


def engine_lock_name(engine_url: str) -> str:
    # Lease names are short; engine URLs are not.
    return "engine-lock:" + hashlib.sha256(engine_url.encode()).hexdigest()[:40]


def default_who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return f"uid {os.getuid()}"


@dataclass
class Executor:
    """Runs runbooks and reverts them. One instance may serve many executions
    (the service keeps one); all shared state lives in the store."""

    store: Store
    catalog: Catalog | None = None
    registry: ActionRegistry = field(default_factory=engine_registry)
    client_factory: Callable[[str], EngineClient] = EngineClient
    # Agent URL (normalized) -> the engine's vLLM API server, for warm-up requests.
    api_urls: Mapping[str, str] = field(default_factory=dict)
    # Seconds between signal reads while waiting (conditions, verification).
    poll_seconds: float = 1.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.catalog is None:
            self.catalog = load_catalog(registry=self.registry)

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
                EXIT_OK,
                f"alert episode already handled by execution #{record.id}",
                created=False,
            )
        run = _Run(self, spec, client, record.id, dry_run, approved)
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
        run = _Run(
            self, spec, self.client_factory(record.engine), record.id, record.dry_run, approved
        )
        run.verify_seconds = verify_seconds
        run.condition_seconds = condition_seconds
        return run.execute()

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
        return _Revert(self, execution_id, who or default_who(), trigger, reason).run(
            stepwise, healthy_period_seconds
        )

    def find_episode(
        self, runbook: str, engine_url: str, fingerprint: str, starts_at: datetime
    ) -> ExecutionRecord | None:
        """The execution an alert episode started, if any."""
        key = episode_key(runbook, self.client_factory(engine_url).url, fingerprint, starts_at)
        with self.store.session() as s:
            found = s.scalar(select(Execution.id).where(Execution.episode_key == key))
        return None if found is None else self.store.get_execution(found)

    def revert_on_resolve(
        self,
        runbook: str,
        engine_url: str,
        fingerprint: str,
        starts_at: datetime,
        *,
        who: str = "alertmanager",
        healthy_period_seconds: float | None = None,
    ) -> ExecutionResult | None:
        """The service's hook for a resolved alert: revert the episode's
        execution (stepwise where the runbook says so) if the runbook opts in
        and it changed something. None when there is nothing to revert.
        `healthy_period_seconds` overrides the runbook's wait between stages."""
        spec = self.runbook(runbook)
        record = self.find_episode(runbook, engine_url, fingerprint, starts_at)
        if (
            record is None
            or not spec.revert.on_resolve
            or record.dry_run
            or record.status not in (SUCCEEDED, FAILED)
            or not _revertible_steps(record)
        ):
            return None
        return self.revert(
            record.id,
            who=who,
            trigger="rule",
            stepwise=bool(spec.revert.stepwise),
            healthy_period_seconds=healthy_period_seconds,
            reason=f"alert {fingerprint} (since {starts_at.isoformat()}) resolved",
        )

    # --- shared pieces ------------------------------------------------------------

    @contextlib.contextmanager
    def engine_lock(self, engine_url: str, execution_id: int) -> Iterator[Callable[[], None]]:
        """Hold the engine's lease for this execution; yields a renew function.

        Raises EngineBusy when a live execution holds it. A lease whose
        holder execution is finished or was interrupted (its process died on
        this host) is taken over: a SIGKILLed `runbook exec` must not block
        `runbook revert` for the TTL.
        """
        name, holder = engine_lock_name(engine_url), f"execution:{execution_id}"
        if not self.store.acquire_lease(name, holder, ENGINE_LOCK_TTL_S):
            current = self.store.lease_holder(name)
            if not self._stale_holder(current):
                raise EngineBusy(f"engine busy: {self._holder_text(current)} holds its lock")
            if current is not None:
                self.store.release_lease(name, current)
            # Atomic: of several processes taking over at once, one wins.
            if not self.store.acquire_lease(name, holder, ENGINE_LOCK_TTL_S):
                current = self.store.lease_holder(name)
                raise EngineBusy(f"engine busy: {self._holder_text(current)} holds its lock")

        def renew() -> None:
            if not self.store.renew_lease(name, holder, ENGINE_LOCK_TTL_S):
                raise _Abort(FAILED, EXIT_FAILED, "lost the engine lock (lease expired)")

        try:
            yield renew
        finally:
            with contextlib.suppress(Exception):
                self.store.release_lease(name, holder)

    def _stale_holder(self, holder: str | None) -> bool:
        if holder is None:
            return True  # expired between our two calls
        prefix, _, number = holder.partition(":")
        if prefix != "execution" or not number.isdigit():
            return False
        try:
            record = self.store.get_execution(int(number))
        except LookupError:
            return True
        return record.interrupted or record.status in FINAL_STATUSES

    def _holder_text(self, holder: str | None) -> str:
        prefix, _, number = (holder or "").partition(":")
        if prefix == "execution" and number.isdigit():
            with contextlib.suppress(LookupError):
                r = self.store.get_execution(int(number))
                return f"execution #{r.id} ({r.runbook}, {r.status}, by {r.who})"
        return holder or "another execution"

    @contextlib.contextmanager
    def admission(self, execution_id: int) -> Iterator[None]:
        """Serialise guardrail checks + the move to running across processes,
        so the blast-radius count cannot be raced past."""
        holder = f"execution:{execution_id}"
        end = self.clock() + ADMISSION_WAIT_S
        while not self.store.acquire_lease("executor-admission", holder, ADMISSION_TTL_S):
            if self.clock() >= end:
                raise _Abort(REFUSED, EXIT_REFUSED, "admission busy: try again")
            time.sleep(0.05)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                self.store.release_lease("executor-admission", holder)

    def _runs(self, runbook: str, engine: str) -> Any:
        # Real runs: not dry, not refused, started, and not reverts (restoring
        # is not remediation and must not extend the cooldown).
        return select(Execution.started_at).where(
            Execution.runbook == runbook,
            Execution.engine == engine,
            Execution.dry_run.is_(False),
            Execution.status != REFUSED,
            Execution.started_at.is_not(None),
            Execution.reverts_id.is_(None),
        )

    def guardrail_refusal(self, spec: Runbook, engine: str, approved: bool) -> str | None:
        """The first guardrail that refuses this run now, as one sentence; None if all pass."""
        g = spec.guardrails
        if g.requires_approval and not approved:
            return f"runbook {spec.name} requires approval: rerun with --yes"
        now = utcnow()
        with self.store.session() as s:
            last = s.scalar(self._runs(spec.name, engine).order_by(Execution.started_at.desc()))
            hour_ago = now - timedelta(hours=1)
            recent = list(
                s.scalars(
                    self._runs(spec.name, engine)
                    .where(Execution.started_at >= hour_ago)
                    .order_by(Execution.started_at)
                )
            )
            others = set(
                s.scalars(
                    select(Execution.engine)
                    .where(
                        Execution.status.in_((RUNNING, VERIFYING)),
                        Execution.dry_run.is_(False),
                        Execution.reverts_id.is_(None),
                        Execution.engine != engine,
                    )
                    .distinct()
                )
            )
        if last is not None and g.cooldown_seconds:
            remaining = (last + timedelta(seconds=g.cooldown_seconds) - now).total_seconds()
            if remaining > 0:
                return (
                    f"cooldown: {spec.name} ran on this engine at {last:%H:%M:%SZ}; "
                    f"{format_duration(math.ceil(remaining))} left of {g.cooldown_seconds} s"
                )
        if len(recent) >= g.max_runs_per_hour:
            wait = (recent[0] + timedelta(hours=1) - now).total_seconds()
            return (
                f"max runs per hour: {len(recent)} of {g.max_runs_per_hour} in the last hour; "
                f"next allowed in {format_duration(math.ceil(wait))}"
            )
        if len(others) >= g.max_concurrent_engines:
            return (
                f"blast radius: {len(others)} other engine(s) under remediation "
                f"(at most {g.max_concurrent_engines} at once for {spec.name})"
            )
        return None

    def wait(self, seconds: float, renew: Callable[[], None] | None) -> None:
        """Sleep in poll-sized slices, keeping the engine lock alive."""
        end = self.clock() + seconds
        while (left := end - self.clock()) > 0:
            if renew is not None:
                renew()
            self.sleep(min(self.poll_seconds, left))


def _revertible_steps(record: ExecutionRecord) -> list[StepRecord]:
    """Steps whose effect may be on the engine: applied, or interrupted mid-apply."""
    return [
        s
        for s in record.steps
        if s.status in (STEP_APPLIED, STEP_INTERRUPTED)
        and s.before
        and any(k in KNOBS for k in s.before)
    ]


def _restore_targets(steps: list[StepRecord]) -> dict[str, Any]:
    """Per knob, the before-value of the first step that touched it."""
    targets: dict[str, Any] = {}
    for step in sorted(steps, key=lambda s: s.ordinal):
        for knob, value in (step.before or {}).items():
            if knob in KNOBS:
                targets.setdefault(knob, value)
    return targets


def _engine_error_exit(error: EngineClientError) -> int:
    if isinstance(error, EngineUnreachable | AuthFailed):
        return EXIT_ENGINE
    if isinstance(error, CommandRefused):
        return EXIT_REFUSED
    return EXIT_FAILED


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _Run:
    """One execution's state while it runs (not shared, not reused)."""

    def __init__(
        self,
        executor: Executor,
        spec: Runbook,
        client: EngineClient,
        execution_id: int,
        dry_run: bool,
        approved: bool,
    ) -> None:
        self.x = executor
        self.store = executor.store
        self.spec = spec
        self.client = client
        self.id = execution_id
        self.dry_run = dry_run
        self.approved = approved
        self.verify_seconds: float | None = None
        self.condition_seconds: float | None = None
        self.reader = SignalReader(client, clock=executor.clock)
        self.renew: Callable[[], None] | None = None
        self.applied: list[StepRecord] = []
        self.warnings: list[str] = []
        self.baseline: dict[str, Any] = {}

    def result(self, exit_code: int, message: str | None = None) -> ExecutionResult:
        return ExecutionResult(
            self.store.get_execution(self.id), exit_code, message, warnings=tuple(self.warnings)
        )

    def finish(self, status: str, exit_code: int, message: str | None) -> ExecutionResult:
        record = self.store.get_execution(self.id)
        if record.status != status:
            error = message if status in (FAILED, ROLLED_BACK) else None
            reason = message if status in (REFUSED, SUCCEEDED) else None
            self.store.transition(self.id, status, error, reason=reason)
        return self.result(exit_code, None if status == SUCCEEDED else message)

    def execute(self) -> ExecutionResult:
        if self.dry_run:
            return self._guard(self._dry_run)
        try:
            with self.x.engine_lock(self.client.url, self.id) as renew:
                self.renew = renew
                return self._guard(self._real_run)
        except EngineBusy as busy:
            return self.finish(REFUSED, EXIT_REFUSED, str(busy))

    def _guard(self, body: Callable[[], ExecutionResult]) -> ExecutionResult:
        """Turn errors into a final status; roll back whatever was applied."""
        try:
            return body()
        except _Abort as abort:
            if self.applied:
                return self._roll_back(abort.message, abort.exit_code)
            return self.finish(abort.status, abort.exit_code, abort.message)
        except EngineClientError as error:
            message = _one_line(error)
            if self.applied:
                # Rolled back = exit 1, unless the engine itself is gone (3).
                code = EXIT_ENGINE if _engine_error_exit(error) == EXIT_ENGINE else EXIT_FAILED
                return self._roll_back(message, code)
            return self.finish(FAILED, _engine_error_exit(error), message)
        except ActionError as error:
            message = _one_line(error)
            if self.applied:
                return self._roll_back(message, EXIT_FAILED)
            return self.finish(FAILED, EXIT_FAILED, message)

    # --- the phases --------------------------------------------------------------------

    def _checks(self) -> None:
        signals = self.reader.read()
        self.baseline = dict(signals)
        checks = {
            c.name: {"signal": c.signal, "description": c.description, "value": signals[c.signal]}
            for c in self.spec.checks
        }
        self.store.record_checks(self.id, checks)

    def _dry_run(self) -> ExecutionResult:
        self.store.transition(self.id, RUNNING)
        self._checks()
        refusal = self.x.guardrail_refusal(self.spec, self.client.url, approved=True)
        if refusal:
            self.warnings.append(f"a real run would be refused now: {refusal}")
        if self.spec.guardrails.requires_approval:
            self.warnings.append(f"runbook {self.spec.name} requires approval (--yes)")
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
        return self.finish(SUCCEEDED, EXIT_OK, "dry run: nothing changed")

    def _real_run(self) -> ExecutionResult:
        # A crashed run on this host still says 'running': settle it first, so
        # it neither blocks the blast radius nor looks alive in the journal.
        self.store.recover_interrupted()
        self._checks()
        with self.x.admission(self.id):
            refusal = self.x.guardrail_refusal(self.spec, self.client.url, self.approved)
            if refusal:
                raise _Abort(REFUSED, EXIT_REFUSED, refusal)
            self.store.transition(self.id, RUNNING)
        for index, step in enumerate(self.spec.steps):
            details: dict[str, Any] = {}
            if step.when is not None and not self._condition_holds(step, index, details):
                continue
            self._run_step(step, details)
        return self._verify()

    def _condition_holds(self, step: StepSpec, index: int, details: dict[str, Any]) -> bool:
        when = step.when
        assert when is not None
        wait = when.after_seconds if self.condition_seconds is None else self.condition_seconds
        if wait > 0:
            self.x.wait(wait, self.renew)
        observed = self.reader.read()[when.signal]
        details.update(when=describe_condition(when), observed=observed, waited_seconds=wait)
        if observed is None or not _holds(when, observed):
            why = "unavailable" if observed is None else f"{observed:g}"
            details["note"] = f"condition not met ({when.signal} = {why})"
            self.store.add_step(
                self.id, step.action, {**step.params, **details}, status=STEP_SKIPPED
            )
            return False
        return True

    def _call(
        self, step: StepSpec, details: dict[str, Any], started: list[StepRecord] | None = None
    ) -> ActionOutcome:
        """Run one action on a fresh state; `started` receives its journal row."""
        state = self.client.state()
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
            self.client, state, self.dry_run, begin, self.x.api_urls.get(self.client.url)
        )
        outcome: ActionOutcome = self.x.registry.call(step.action, step.params, ctx)
        return outcome

    def _run_step(self, step: StepSpec, details: dict[str, Any]) -> None:
        started: list[StepRecord] = []
        try:
            outcome = self._call(step, details, started)
        except (EngineClientError, ActionError) as error:
            for row in started:
                self.store.finish_step(row.id, STEP_FAILED, error=_one_line(error))
            read_only = step.action in self.x.registry and not (
                self.x.registry.get(step.action).mutating
            )
            if read_only and not started:
                # A read-only action (warm-up) that failed: the journal says which.
                params = {**step.params, **details}
                row = self.store.add_step(self.id, step.action, params, status=STEP_APPLYING)
                self.store.finish_step(row.id, STEP_FAILED, error=_one_line(error))
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
        v = self.spec.verification
        changed = any(s.status == STEP_APPLIED and s.before for s in self.applied)
        if v is None or not changed:
            why = "no verification" if v is None else "nothing changed"
            return self.finish(SUCCEEDED, EXIT_OK, why)
        self.store.transition(self.id, VERIFYING)
        deadline_s = v.deadline_seconds if self.verify_seconds is None else self.verify_seconds
        before = self.baseline.get(v.signal)
        guards = {g: self.baseline.get(g) for g in v.rollback_if_worse}
        report: dict[str, Any] = {
            "signal": v.signal,
            "direction": v.direction,
            "deadline_seconds": deadline_s,
            "before": before,
            "after": None,
            "polls": 0,
            "guards": {g: {"before": b, "after": None} for g, b in guards.items()},
        }
        unavailable = [g for g, b in guards.items() if b is None]
        if unavailable:
            report["guards_unavailable"] = unavailable
        end = self.x.clock() + deadline_s
        outcome = "not improved"
        while True:
            signals = self.reader.read()
            report["polls"] += 1
            report["after"] = value = signals.get(v.signal)
            for guard, baseline in guards.items():
                report["guards"][guard]["after"] = signals.get(guard)
                if _worse(guard, signals.get(guard), baseline):
                    report["outcome"] = f"{guard} got worse"
                    self.store.record_verification(self.id, report)
                    return self._roll_back(
                        f"circuit breaker: {guard} got worse ({baseline:g} → "
                        f"{signals[guard]:g}) after acting",
                        EXIT_FAILED,
                    )
            if before is None and value is None:
                outcome = "unverified: signal not measured by the engine agent"
                break
            if _improved(value, before, v.direction):
                outcome = "improved"
                break
            if self.x.clock() >= end:
                break
            self.x.wait(min(self.x.poll_seconds, max(0.0, end - self.x.clock())), self.renew)
        report["outcome"] = outcome
        self.store.record_verification(self.id, report)
        if outcome == "improved":
            return self.finish(SUCCEEDED, EXIT_OK, None)
        if outcome.startswith("unverified"):
            self.warnings.append(f"{v.signal}: {outcome}")
            return self.finish(SUCCEEDED, EXIT_OK, f"{v.signal} {outcome}")
        if _worse(v.signal, value, before, v.direction):
            return self._roll_back(
                f"circuit breaker: {v.signal} got worse ({before:g} → {value:g}) "
                f"within {deadline_s:g} s",
                EXIT_FAILED,
            )
        return self.finish(
            FAILED,
            EXIT_FAILED,
            f"verification: {v.signal} did not {v.direction} within {deadline_s:g} s "
            f"({format_signal(v.signal, before)} → {format_signal(v.signal, value)}); "
            f"changes kept, `runbook revert {self.id}` "
            "restores them",
        )

    def _roll_back(self, why: str, exit_code: int) -> ExecutionResult:
        """Restore the before-values of every step applied so far, newest first."""
        targets = _restore_targets(self.applied)
        try:
            if targets:
                self.client.set_knobs(**targets)
        except EngineClientError as error:
            message = (
                f"{why}; rollback failed: {_one_line(error)}; "
                f"`runbook revert {self.id}` restores the recorded before-values"
            )
            return self.finish(FAILED, _engine_error_exit(error), message)
        for step in self.applied:
            current = self.store.get_execution(self.id)
            status = next((s.status for s in current.steps if s.id == step.id), None)
            if status in (STEP_APPLIED, STEP_INTERRUPTED):
                self.store.finish_step(step.id, STEP_REVERTED)
        return self.finish(ROLLED_BACK, exit_code, f"{why}; rolled back")


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:g}" if isinstance(value, int | float) else str(value)


class _Revert:
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
        run = _Run(
            self.x,
            self.x.runbook(original.runbook)
            if self._known(original)
            else _placeholder(original.runbook),
            client,
            record.id,
            False,
            True,
        )
        try:
            with self.x.engine_lock(client.url, record.id) as renew:
                run.renew = renew
                return self._restore(run, original, stepwise, healthy_period_seconds)
        except EngineBusy as busy:
            return run.finish(REFUSED, EXIT_REFUSED, str(busy))

    def _known(self, original: ExecutionRecord) -> bool:
        return self.x.catalog is not None and original.runbook in self.x.catalog

    def _refusal(self, original: ExecutionRecord) -> str | None:
        if original.reverts_id is not None:
            return f"execution #{original.id} is itself a revert (of #{original.reverts_id})"
        if original.dry_run:
            return f"execution #{original.id} was a dry run: it changed nothing"
        if original.status == REVERTED:
            return f"execution #{original.id} is already reverted"
        if original.status == ROLLED_BACK:
            return f"execution #{original.id} was already rolled back"
        if original.status in ACTIVE_STATUSES:
            return f"execution #{original.id} is still {original.status}"
        if original.status not in (SUCCEEDED, FAILED):
            return f"execution #{original.id} is {original.status}: nothing to revert"
        if not _revertible_steps(original):
            return f"execution #{original.id} changed no knob: nothing to revert"
        return None

    def _restore(
        self,
        run: _Run,
        original: ExecutionRecord,
        stepwise: bool,
        healthy_period_seconds: float | None,
    ) -> ExecutionResult:
        store = self.store
        steps = _revertible_steps(original)
        targets = _restore_targets(steps)
        spec = run.spec
        fractions: tuple[float, ...] = spec.revert.stepwise if stepwise else ()
        fractions = fractions or (1.0,)
        healthy = (
            spec.revert.healthy_period_seconds
            if healthy_period_seconds is None
            else healthy_period_seconds
        )
        store.transition(run.id, RUNNING)
        try:
            run._checks()
            start = {k: run.reader.last_state["knobs"][k] for k in targets}  # type: ignore[index]
            for stage, fraction in enumerate(fractions):
                goal = _stage_values(start, targets, fraction)
                state = run.client.state()
                before = {k: state["knobs"][k] for k in goal}
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
                        store.finish_step(row.id, STEP_FAILED, error=_one_line(error))
                        raise
                    store.finish_step(
                        row.id,
                        STEP_APPLIED,
                        after={k: result["after"][k] for k in goal},
                        applied_at_step=int(result["effective_from_step"]),
                    )
                if stage < len(fractions) - 1:
                    problem = self._unhealthy(run, healthy)
                    if problem is not None:
                        return run.finish(
                            FAILED,
                            EXIT_FAILED,
                            f"stepwise revert halted after {fraction:.0%}: {problem}; "
                            f"execution #{original.id} is left partly restored",
                        )
        except EngineClientError as error:
            return run.finish(FAILED, _engine_error_exit(error), _one_line(error))
        for step in steps:
            store.finish_step(step.id, STEP_REVERTED)
        store.transition(original.id, REVERTED, reason=f"reverted by execution #{run.id}")
        return run.finish(SUCCEEDED, EXIT_OK, f"execution #{original.id} reverted")

    def _unhealthy(self, run: _Run, seconds: float) -> str | None:
        """Watch a healthy period; the first worsening signal, or None."""
        v = run.spec.verification
        watched = ([v.signal] if v else []) + list(v.rollback_if_worse if v else ())
        baseline = run.reader.read()
        end = self.x.clock() + seconds
        while self.x.clock() < end:
            self.x.wait(min(self.x.poll_seconds, end - self.x.clock()), run.renew)
            now = run.reader.read()
            for signal in watched:
                direction = v.direction if v and signal == v.signal else None
                if _worse(signal, now.get(signal), baseline.get(signal), direction):
                    return f"{signal} got worse ({_fmt(baseline[signal])} → {_fmt(now[signal])})"
        return None


class RevertRefused(Exception):
    """The execution cannot be reverted (already reverted, dry run, still running…)."""


def _stage_values(
    start: Mapping[str, Any], targets: Mapping[str, Any], fraction: float
) -> dict[str, Any]:
    """Knob values `fraction` of the way from `start` back to `targets`.

    Numbers move proportionally (rounded towards the target); the policy is
    not a number and switches back at the last stage.
    """
    goal: dict[str, Any] = {}
    for knob, target in targets.items():
        current = start[knob]
        if fraction >= 1.0 or current == target:
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
