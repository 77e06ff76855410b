"""The reports' circuit breaker, service-wide: every change watched against absolute limits.

    breaker = Breaker(journal, executor, BreakerConfig(), engines=[agent_url, ...])
    breaker.tick()        # the service's job does this every `interval`

The field reports' fifth step: after any change, an OOM rate above 1 % means
roll back at once. A runbook's own verification only compares before and
after, and only while it verifies; this watches every change, whoever made
it, for `watch` (default 10 min) after it took effect:

- the changes: each execution the journal holds that changed a knob (a
  runbook's, from the service, `runbook exec` or another replica; a revert
  and the breaker's own undoing are not watched, but they end the watch of
  what they undid), and each change the engine's autopilot made (seen on the
  agent's `/v1/state`). Any other tuner records its changes as executions,
  or hands them to `watch()` with its source;
- per engine only the newest change is judged: an older one is no longer
  what the engine runs with (a later change of the same engine supersedes
  it, and undoing the older one would undo the newer one too);
- the limits (`judge`): preemptions per finished request above
  `preemption_rate` (1 %; not for a change that only lowered max_num_seqs or
  the budget: a cut frees KV blocks), errors per finished request above
  `error_rate` (0.5 %), the P99 end-to-end latency above `p99_sla` where one
  is set. The rates' denominator is at least `min_finished`: a storm that
  finishes nothing still trips, one preemption among the first three
  requests does not. Measured from the change's first step on (the agent's
  counters from the step the change took effect at), never over a window
  that still holds the time before it;
- the change must be implicated, not only the hour: a change made to fix
  that very signal (a runbook whose verification reads it: oom-pressure for
  preemptions) trips only when the rate is also worse than over as long a
  time just before it (the agent's `since.before`; the breaker's own ticks
  for the autopilot). A fix that brought a storm from 12 % down to 2 % is
  not rolled back into it. Any other change over a limit is implicated;
- a trip: a change that lowered admission (a remediation's cut, with the
  autopilot it handed over to) falls back to the engine's safe setting:
  admission at the lowest of before, after and now, the autopilot off,
  every other knob back (`safe_setting`), never into the storm it answered.
  Any other execution is rolled back to the values before it (`runbook
  revert`, journaled with the measurements as its reason); an autopilot
  change: the autopilot off and max_num_seqs back. Each journaled (the
  fallback as an execution of `circuit-breaker`), notified through the
  journal's events like every execution, counted in
  `vllm_runbook_service_breaker_trips_total{engine,reason}`; automatic
  executions on that engine that would change the same knobs are refused
  for `cooldown` (guardrails.breaker_hold), a fix on other knobs is not.

Several replicas may run the breaker: a lease per trip lets one act.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from vllm_runbook.collector.agent_api import AgentState, Before, SettledSince
from vllm_runbook.runbooks.engine.client import Agent, EngineClientError
from vllm_runbook.runbooks.engine.operations import KNOBS
from vllm_runbook.runbooks.model.config import BreakerConfig
from vllm_runbook.runbooks.run.guardrails import BREAKER_WHO as BREAKER_WHO
from vllm_runbook.runbooks.run.outcome import one_line
from vllm_runbook.runbooks.run.revert import RevertRefused, revertible_steps
from vllm_runbook.runbooks.store import ExecutionRecord, Journal
from vllm_runbook.runbooks.store.models import STEP_APPLIED, ExecutionStatus, utcnow

if TYPE_CHECKING:
    from vllm_runbook.runbooks.run.executor import Executor

log = logging.getLogger("vllm_runbook.breaker")

# Who the journal names for the breaker's reverts and its own executions
# (BREAKER_WHO, defined beside the hold that reads it: guardrails.py).
# The journal's runbook name for undoing a change no execution made (the autopilot's).
BREAKER_RUNBOOK: Final = "circuit-breaker"
# Why it trips (the trips counter's `reason` label).
PREEMPTION_RATE: Final = "preemption_rate"
ERROR_RATE: Final = "error_rate"
P99_OVER_SLA: Final = "p99_over_sla"
REASONS: Final = (PREEMPTION_RATE, ERROR_RATE, P99_OVER_SLA)
# A runbook remediates a limit's own signal when its verification reads one of
# these: its change answers that symptom, so it is implicated only when the
# symptom got worse than in as long a time before it.
REMEDIATES: Final[dict[str, frozenset[str]]] = {
    PREEMPTION_RATE: frozenset({"preemptions_per_minute", "oom_rate"}),
    ERROR_RATE: frozenset({"error_rate"}),
    P99_OVER_SLA: frozenset(
        {"engine_e2e_latency_p99", "starving_waiting", "tier_requests_waiting_hot"}
    ),
}
# Where a change comes from.
SOURCE_RUNBOOK: Final = "runbook"
SOURCE_AUTOPILOT: Final = "autopilot"
TRIP_LEASE_S: Final = 3600.0


@dataclass(frozen=True)
class Measurement:
    """What happened on the engine from a change's first step on."""

    seconds: float
    preemptions: int
    finished: int
    errors: int
    p99_latency_seconds: float | None = None
    # The same counters over as long a time just before the change (None: unknown).
    before: Measurement | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seconds": round(self.seconds, 3),
            "preemptions": self.preemptions,
            "requests_finished": self.finished,
            "errors": self.errors,
            "p99_latency_seconds": self.p99_latency_seconds,
        }
        if self.before is not None:
            out["before"] = self.before.to_dict()
        return out

    @classmethod
    def of_before(cls, before: Before) -> Measurement:
        return cls(
            seconds=before.seconds,
            preemptions=before.preemptions,
            finished=before.requests_finished,
            errors=before.errors,
            p99_latency_seconds=before.engine_e2e_latency_p99,
        )


@dataclass(frozen=True)
class Trip:
    reason: str  # one of REASONS
    value: float
    limit: float
    text: str  # one sentence with the numbers


# Knobs that admit work: lowering them frees KV blocks, it cannot cause a preemption.
ADMISSION_KNOBS: Final = ("max_num_seqs", "max_num_batched_tokens")


def only_lowers_admission(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether a change only lowered max_num_seqs or the budget (a cut): it
    cannot have caused a preemption, and undoing it would admit more into
    the storm it answers."""
    return bool(before) and all(
        k in ADMISSION_KNOBS
        and isinstance(after.get(k), int)
        and isinstance(v, int)
        and after[k] < v
        for k, v in before.items()
    )


def judge(
    m: Measurement,
    config: BreakerConfig,
    *,
    preemptions: bool = True,
    remediates: frozenset[str] = frozenset(),
) -> Trip | None:
    """The first limit `m` is over for which the change is implicated, or None.

    `preemptions` False: the change only lowered admission, its preemption
    rate is not its doing (errors and latency are still judged).
    `remediates`: the limits (REASONS) whose own signal the change was made
    to fix. Such a change is implicated only when the rate is also worse than
    over as long a time before it (`m.before`; unknown counts as worse): a
    fix that brought a storm of 12 % down to 2 % is not rolled back into it.
    Any other change over a limit is implicated."""
    denominator = max(m.finished, config.min_finished)
    b = m.before
    b_denominator = max(b.finished, config.min_finished) if b is not None else 1

    def implicated(reason: str, value: float, before: float | None) -> tuple[bool, str]:
        if before is None:
            return True, "" if reason not in remediates else " (nothing known from before it)"
        seen = f"; {_rate_text(reason, before)} in the {b.seconds:.0f} s before" if b else ""
        if reason not in remediates:
            return True, seen
        return value > before, seen

    rate = m.preemptions / denominator
    if preemptions and rate > config.preemption_rate:
        before = b.preemptions / b_denominator if b is not None else None
        guilty, seen = implicated(PREEMPTION_RATE, rate, before)
        if guilty:
            return Trip(
                PREEMPTION_RATE,
                rate,
                config.preemption_rate,
                f"{m.preemptions} preemptions per {_per(m, config)} = {rate:.2%} "
                f"> {config.preemption_rate:.2%}{seen}",
            )
    errors = m.errors / denominator
    if errors > config.error_rate:
        before = b.errors / b_denominator if b is not None else None
        guilty, seen = implicated(ERROR_RATE, errors, before)
        if guilty:
            return Trip(
                ERROR_RATE,
                errors,
                config.error_rate,
                f"{m.errors} errors per {_per(m, config)} = {errors:.2%} "
                f"> {config.error_rate:.2%}{seen}",
            )
    sla, p99 = config.p99_sla_seconds, m.p99_latency_seconds
    if sla is not None and p99 is not None and m.finished >= config.min_finished and p99 > sla:
        before = b.p99_latency_seconds if b is not None else None
        guilty, seen = implicated(P99_OVER_SLA, p99, before)
        if guilty:
            return Trip(
                P99_OVER_SLA,
                p99,
                sla,
                f"P99 end-to-end latency {p99:.3g} s over {m.finished} finished requests "
                f"> SLA {sla:g} s{seen}",
            )
    return None


def _rate_text(reason: str, value: float) -> str:
    return f"{value:.3g} s" if reason == P99_OVER_SLA else f"{value:.2%}"


def _per(m: Measurement, config: BreakerConfig) -> str:
    if m.finished >= config.min_finished:
        return f"{m.finished} finished requests"
    return f"{m.finished} finished requests (counted as the minimum {config.min_finished})"


@dataclass
class Change:
    """One knob change the breaker watches."""

    engine: str  # the agent's URL, normalized
    source: str  # SOURCE_RUNBOOK, SOURCE_AUTOPILOT, or another tuner's name
    before: dict[str, Any]  # the values to roll back to
    after: dict[str, Any]
    at: datetime  # when it took effect (the watch runs from here)
    # Executions: the step it took effect at (the agent measures from there).
    from_step: int | None = None
    execution_id: int | None = None
    # Changes without a step mark (the autopilot's): the counters when it was seen.
    baseline: dict[str, float] | None = None
    # What names the change alike on every replica (the autopilot's: its step).
    ref: str | None = None
    # The runbook that made it (an execution's).
    runbook: str | None = None

    @property
    def key(self) -> str:
        if self.execution_id is not None:
            return f"execution:{self.execution_id}"
        return f"{self.source}:{self.engine}:{self.ref or self.at.isoformat()}"

    def describe(self) -> str:
        knobs = ", ".join(f"{k} {v} → {self.after.get(k)}" for k, v in self.before.items())
        by = f"execution #{self.execution_id}" if self.execution_id is not None else self.source
        return f"{knobs} by {by}"


def execution_change(record: ExecutionRecord) -> Change | None:
    """The change an execution left on its engine, if it is one to watch."""
    if (
        record.reverts_id is not None
        or record.who == BREAKER_WHO
        or record.status not in (ExecutionStatus.SUCCEEDED, ExecutionStatus.FAILED)
        or record.finished_at is None
    ):
        return None
    steps = [s for s in revertible_steps(record) if s.status == STEP_APPLIED]
    if not steps:
        return None
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    for step in sorted(steps, key=lambda s: s.ordinal):
        for knob, value in (step.before or {}).items():
            if knob in KNOBS:
                before.setdefault(knob, value)
        after.update({k: v for k, v in (step.after or {}).items() if k in KNOBS})
    before = {k: v for k, v in before.items() if after.get(k) != v}
    after = {k: after.get(k) for k in before}
    if not before:
        return None  # nothing differs: nothing to roll back
    marks = [s.applied_at_step for s in steps if s.applied_at_step is not None]
    return Change(
        record.engine,
        SOURCE_RUNBOOK,
        before,
        after,
        record.finished_at,
        from_step=max(marks) if marks else None,
        execution_id=record.id,
        runbook=record.runbook,
    )


def lowers_admission(change: Change) -> bool:
    """Whether the change lowered max_num_seqs or the budget (a remediation's
    cut): it is never undone into the storm it answered."""
    return any(
        isinstance(v, int) and isinstance(change.after.get(k), int) and change.after[k] < v
        for k, v in change.before.items()
        if k in ADMISSION_KNOBS
    )


def safe_setting(change: Change, current: dict[str, Any]) -> dict[str, Any]:
    """Where a change that lowered admission falls back to: the engine's
    conservative setting, not the values before the fix. Admission stays at
    the lowest of before, after and now (never raised into the storm the cut
    answered), the autopilot is off (it would raise it again), every other
    knob the change moved (the policy) goes back to its value before."""
    targets: dict[str, Any] = {}
    for knob, before in change.before.items():
        after, now = change.after.get(knob), current.get(knob)
        if knob in ADMISSION_KNOBS:
            targets[knob] = min(v for v in (before, after, now) if isinstance(v, int))
        elif knob == "autopilot":
            targets[knob] = False
        else:
            targets[knob] = before
    if targets.get("autopilot") is False and "max_num_seqs" not in targets:
        seqs = current.get("max_num_seqs")
        if isinstance(seqs, int):
            targets["max_num_seqs"] = seqs  # where the autopilot left it
    return targets


def _changes_knobs(record: ExecutionRecord) -> bool:
    return any(
        s.status in (STEP_APPLIED, "reverted") and s.before and any(k in KNOBS for k in s.before)
        for s in record.steps
    )


def counters(state: AgentState) -> dict[str, float]:
    """The engine's cumulative counters the breaker measures a stepless change by."""
    by_reason = state.stats.requests_finished_by_reason_total
    return {
        "preemptions": float(state.stats.preemptions_total),
        "finished": float(sum(by_reason.values())),
        "errors": float(by_reason.get("error", 0)),
    }


@dataclass
class Breaker:
    """The breaker's state in one process (the changes are re-read from the
    journal and the agents at every tick; only the autopilots' last seen
    positions are kept here)."""

    store: Journal
    executor: Executor
    config: BreakerConfig = field(default_factory=BreakerConfig)
    # The inventory's agents (normalized URLs): their autopilots are watched.
    engines: Iterable[str] = ()
    client_factory: Callable[[str], Agent] | None = None
    # Called on a trip with (engine URL, reason): the service's counter.
    on_trip: Callable[[str, str], None] | None = None
    holder: str = "breaker"
    now: Callable[[], datetime] = utcnow
    # Per engine: (autopilot's last change step, max_num_seqs) seen at the latest tick.
    _autopilot_seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per engine: the autopilot change being watched, if it is the newest change.
    _autopilot_changes: dict[str, Change] = field(default_factory=dict)
    _extra: dict[str, Change] = field(default_factory=dict)
    # Keys of the changes already judged over (tripped, or whose undoing failed).
    _done: set[str] = field(default_factory=set)
    # Per engine: (time, counters) at each tick, as long as a watch: what a
    # change without a step mark (the autopilot's) is compared with before it.
    _history: dict[str, list[tuple[datetime, dict[str, float]]]] = field(default_factory=dict)

    def client(self, url: str) -> Agent:
        factory = self.client_factory or self.executor.client_factory
        return factory(url)

    # --- what is watched -------------------------------------------------------------

    def watch(self, change: Change) -> None:
        """A change made outside the journal (another tuner): watch it too."""
        self._extra[change.engine] = change

    def newest_changes(self) -> dict[str, Change]:
        """Per engine, the newest change within the watch period, if it is one
        to watch (a revert or the breaker's undoing ends the watch)."""
        now = self.now()
        since = now - timedelta(seconds=self.config.watch_seconds)
        newest: dict[str, tuple[datetime, Change | None]] = {}

        def offer(engine: str, at: datetime, change: Change | None) -> None:
            if at >= since and (engine not in newest or at >= newest[engine][0]):
                newest[engine] = (at, change)

        for record in self.store.finished_since(since):
            if record.finished_at is None or not _changes_knobs(record):
                continue
            offer(record.engine, record.finished_at, execution_change(record))
        for change in (*self._autopilot_changes.values(), *self._extra.values()):
            offer(change.engine, change.at, change)
        return {
            engine: change
            for engine, (_, change) in newest.items()
            if change is not None and change.key not in self._done
        }

    def _see_autopilots(self) -> None:
        """Record each autopilot change seen since the latest tick."""
        for url in self.engines:
            try:
                state = self.client(url).state()
            except EngineClientError as error:
                log.debug("breaker: %s unreadable (%s)", url, one_line(error))
                continue
            self._remember(url, state)
            pilot = state.autopilot
            seqs = state.knobs.max_num_seqs
            last = pilot.last_change
            step = last.step if last is not None else -1
            seen = self._autopilot_seen.get(url)
            self._autopilot_seen[url] = (step, seqs)
            if not pilot.enabled or seen is None or step == seen[0] or seqs == seen[1]:
                continue
            base = counters(state)
            self._autopilot_changes[url] = Change(
                url,
                SOURCE_AUTOPILOT,
                {"autopilot": True, "max_num_seqs": seen[1]},
                {"autopilot": True, "max_num_seqs": seqs},
                self.now(),
                baseline=base,
                ref=f"step {step}",
            )

    def _remember(self, url: str, state: AgentState) -> None:
        now = self.now()
        kept = [
            (t, c)
            for t, c in self._history.get(url, [])
            if (now - t).total_seconds() <= 2 * self.config.watch_seconds
        ]
        kept.append((now, counters(state)))
        self._history[url] = kept

    def _before(self, change: Change, seconds: float) -> Measurement | None:
        """For a change without a step mark: the counters over `seconds`
        before it, from the ticks (None: no tick that long before it)."""
        if change.baseline is None:
            return None
        start = change.at - timedelta(seconds=seconds)
        older = [(t, c) for t, c in self._history.get(change.engine, []) if t <= start]
        if not older:
            return None
        t0, c0 = older[-1]
        base = change.baseline
        return Measurement(
            seconds=(change.at - t0).total_seconds(),
            preemptions=int(base["preemptions"] - c0["preemptions"]),
            finished=int(base["finished"] - c0["finished"]),
            errors=int(base["errors"] - c0["errors"]),
        )

    def remediates(self, change: Change) -> frozenset[str]:
        """The limits whose own signal the change's runbook was made to fix."""
        catalog = self.executor.catalog
        if change.runbook is None or catalog is None or change.runbook not in catalog:
            return frozenset()
        v = catalog[change.runbook].verification
        if v is None:
            return frozenset()
        return frozenset(r for r, signals in REMEDIATES.items() if v.signal in signals)

    # --- measuring and judging ---------------------------------------------------------

    def measure(self, change: Change) -> Measurement | None:
        """What happened since the change took effect; None while it cannot be said."""
        client = self.client(change.engine)
        if change.from_step is not None:
            since = client.state(since_step=change.from_step).since
            if not isinstance(since, SettledSince):
                return None  # no mark kept, or a lower limit still draining
            return Measurement(
                seconds=since.seconds,
                preemptions=since.preemptions,
                finished=since.requests_finished,
                errors=since.finished_by_reason.get("error", 0),
                p99_latency_seconds=since.engine_e2e_latency_p99,
                before=None if since.before is None else Measurement.of_before(since.before),
            )
        if change.baseline is None:
            return None
        now = counters(client.state())
        base = change.baseline
        seconds = (self.now() - change.at).total_seconds()
        return Measurement(
            seconds=seconds,
            preemptions=int(now["preemptions"] - base["preemptions"]),
            finished=int(now["finished"] - base["finished"]),
            errors=int(now["errors"] - base["errors"]),
            before=self._before(change, seconds),
        )

    def tick(self) -> list[tuple[Change, Trip]]:
        """One pass: see the autopilots, judge each engine's newest change,
        roll back what is over a limit. Returns the trips of this pass."""
        if not self.config.enabled:
            return []
        self._see_autopilots()
        trips = []
        for change in self.newest_changes().values():
            try:
                m = self.measure(change)
            except EngineClientError as error:
                log.warning("breaker: cannot measure %s: %s", change.describe(), one_line(error))
                continue
            if m is None:
                continue
            trip = judge(
                m,
                self.config,
                preemptions=not only_lowers_admission(change.before, change.after),
                remediates=self.remediates(change),
            )
            if trip is None:
                continue
            if not self.store.acquire_lease(
                f"breaker-trip:{change.key}", self.holder, TRIP_LEASE_S
            ):
                self._done.add(change.key)  # another replica acts on it
                continue
            self._done.add(change.key)
            self._trip(change, m, trip)
            trips.append((change, trip))
        return trips

    # --- a trip -----------------------------------------------------------------------

    def _trip(self, change: Change, m: Measurement, trip: Trip) -> None:
        why = f"circuit breaker: {trip.text} in {m.seconds:.0f} s after {change.describe()}"
        log.warning("breaker on %s: %s; rolling back", change.engine, why)
        report = {
            "signal": trip.reason,
            "before": trip.limit,
            "after": trip.value,
            "outcome": "over the breaker's limit",
            "breaker": {
                "source": change.source,
                "measurement": m.to_dict(),
                "text": trip.text,
                "why": why,
            },
        }
        if change.execution_id is not None and not lowers_admission(change):
            try:
                result = self.executor.revert(
                    change.execution_id, who=BREAKER_WHO, trigger="rule", reason=why
                )
            except RevertRefused as refused:
                log.warning("breaker: %s", refused)
                return
            if result.record.status == ExecutionStatus.REFUSED:
                # The engine's lock is held (a run under way): try again next pass.
                self._done.discard(change.key)
                self.store.release_lease(f"breaker-trip:{change.key}", self.holder)
                return
            self.store.record_verification(result.record.id, report)
        else:
            self._undo(change, why, report)
        if self.on_trip is not None:
            self.on_trip(change.engine, trip.reason)

    def _undo(self, change: Change, why: str, report: dict[str, Any]) -> None:
        """Fall back from a change that lowered admission (an execution's cut,
        or the autopilot's) to the safe setting, or roll back a change no
        execution made; journaled as the breaker's own execution."""
        if change.execution_id is not None:
            why = f"{why}; falling back to the safe setting, not into the storm it answered"
            report["breaker"]["fallback_for"] = change.execution_id
        record, _ = self.store.create_execution(
            BREAKER_RUNBOOK, change.engine, trigger="rule", who=BREAKER_WHO, reason=why
        )
        self.store.transition(record.id, ExecutionStatus.RUNNING)
        client = self.client(change.engine)
        try:
            state = client.state()
            current = state.knobs.model_dump()
            # An execution reaches here only when it lowered admission (_trip).
            targets = (
                safe_setting(change, current) if lowers_admission(change) else dict(change.before)
            )
            if change.source == SOURCE_AUTOPILOT:
                targets["autopilot"] = False  # left on, it would move max_num_seqs again
            before = {k: getattr(state.knobs, k) for k in targets}
            row = self.store.add_step(
                record.id, "set_knobs", {"source": change.source}, before=before
            )
            result = client.set_knobs(**targets)
        except EngineClientError as error:
            self.store.transition(record.id, ExecutionStatus.FAILED, one_line(error))
            return
        self.store.finish_step(
            row.id,
            STEP_APPLIED,
            after={k: getattr(result.after, k) for k in targets},
            applied_at_step=result.effective_from_step,
        )
        self.store.record_verification(record.id, report)
        self.store.transition(record.id, ExecutionStatus.SUCCEEDED, reason=why)
