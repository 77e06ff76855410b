"""What must hold before and while a runbook acts on an engine.

- the engine lock: a lease per engine, so two executions on one engine never
  interleave, across processes and replicas; a lock left by a dead process is
  taken over;
- admission: a store-wide lease that serialises the guardrail checks and the
  move to running, so the blast-radius count cannot be raced past;
- the refusals: approval, cooldown per (runbook, engine), max runs per hour,
  blast radius (the store answers the queries, this module words them);
- the circuit breaker's comparison for the stepwise revert's healthy check
  (`vllm_runbook.runbooks.run.verification` judges a verification).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Final

from vllm_runbook.collector.agent_api import KNOBS
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import Runbook
from vllm_runbook.runbooks.run.outcome import Abort, EngineBusy
from vllm_runbook.runbooks.run.verification import HIGHER_IS_WORSE, WORSE, judge
from vllm_runbook.runbooks.store import ExecutionRecord, Journal
from vllm_runbook.runbooks.store.models import FINAL_STATUSES, ExecutionStatus, utcnow

# Lease lengths: the engine lock is renewed at every poll, so its TTL only
# bounds how long a hung (not dead) process blocks the engine.
ENGINE_LOCK_TTL_S: Final = 60.0
ADMISSION_TTL_S: Final = 15.0
ADMISSION_WAIT_S: Final = 15.0
ADMISSION_LEASE: Final = "executor-admission"


def worse(
    signal: str, value: Any, baseline: Any, direction: str | None = None, tolerance: float = 0.1
) -> bool:
    """Whether `value` is measurably worse than `baseline` (beyond `tolerance`
    of it) for this signal; `direction` is the verification signal's."""
    if value is None or baseline is None:
        return False
    if direction is None:  # a guard: its own sense of worse
        direction = "decrease" if signal in HIGHER_IS_WORSE else "increase"
    return judge(baseline, value, direction, improve_by=1.0, tolerance=tolerance) == WORSE


def engine_lock_name(engine_url: str) -> str:
    # Lease names are short; engine URLs are not.
    return "engine-lock:" + hashlib.sha256(engine_url.encode()).hexdigest()[:40]


@contextlib.contextmanager
def engine_lock(store: Journal, engine_url: str, execution_id: int) -> Iterator[Callable[[], None]]:
    """Hold the engine's lease for this execution; yields a renew function.

    Raises EngineBusy when a live execution holds it. A lease whose
    holder execution is finished or was interrupted (its process died on
    this host) is taken over: a SIGKILLed `runbook exec` must not block
    `runbook revert` for the TTL. The renew function raises Abort when the
    lease lapsed.
    """
    name, holder = engine_lock_name(engine_url), f"execution:{execution_id}"
    if not store.acquire_lease(name, holder, ENGINE_LOCK_TTL_S):
        current = store.lease_holder(name)
        if not _stale_holder(store, current):
            raise EngineBusy(f"engine busy: {_holder_text(store, current)} holds its lock")
        if current is not None:
            store.release_lease(name, current)
        # Atomic: of several processes taking over at once, one wins.
        if not store.acquire_lease(name, holder, ENGINE_LOCK_TTL_S):
            current = store.lease_holder(name)
            raise EngineBusy(f"engine busy: {_holder_text(store, current)} holds its lock")

    def renew() -> None:
        if not store.renew_lease(name, holder, ENGINE_LOCK_TTL_S):
            raise Abort(
                ExecutionStatus.FAILED, ExitCode.FAILED, "lost the engine lock (lease expired)"
            )

    try:
        yield renew
    finally:
        with contextlib.suppress(Exception):
            store.release_lease(name, holder)


def _stale_holder(store: Journal, holder: str | None) -> bool:
    if holder is None:
        return True  # expired between our two calls
    prefix, _, number = holder.partition(":")
    if prefix != "execution" or not number.isdigit():
        return False
    try:
        record = store.get_execution(int(number))
    except LookupError:
        return True
    return record.interrupted or record.status in FINAL_STATUSES


def _holder_text(store: Journal, holder: str | None) -> str:
    prefix, _, number = (holder or "").partition(":")
    if prefix == "execution" and number.isdigit():
        with contextlib.suppress(LookupError):
            r = store.get_execution(int(number))
            return f"execution #{r.id} ({r.runbook}, {r.status}, by {r.who})"
    return holder or "another execution"


@contextlib.contextmanager
def admission(store: Journal, execution_id: int, clock: Callable[[], float]) -> Iterator[None]:
    """Serialise guardrail checks + the move to running across processes,
    so the blast-radius count cannot be raced past."""
    holder = f"execution:{execution_id}"
    end = clock() + ADMISSION_WAIT_S
    while not store.acquire_lease(ADMISSION_LEASE, holder, ADMISSION_TTL_S):
        if clock() >= end:
            raise Abort(ExecutionStatus.REFUSED, ExitCode.USAGE, "admission busy: try again")
        time.sleep(0.05)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            store.release_lease(ADMISSION_LEASE, holder)


# Who the journal names for the circuit breaker's own executions (its
# rollbacks and fallbacks: runbooks/service/breaker.py): what its hold reads.
BREAKER_WHO: Final = "circuit-breaker"


def judged_knobs(record: ExecutionRecord) -> frozenset[str]:
    """The knobs a breaker execution judged: those its steps changed (the
    autopilot's with max_num_seqs, which it moves)."""
    knobs = {
        k
        for s in record.steps
        if s.before
        for k, v in s.before.items()
        if k in KNOBS and (s.after is None or s.after.get(k) != v)
    }
    if "autopilot" in knobs:
        knobs.add("max_num_seqs")
    return frozenset(knobs)


def breaker_hold(
    store: Journal,
    engine: str,
    cooldown_seconds: float,
    knobs: frozenset[str] | None = None,
) -> str | None:
    """The circuit breaker's hold (runbooks/service/breaker.py): after it rolled a
    change back on `engine`, automatic changes of the same knobs there wait
    `cooldown_seconds`. `knobs`: those the run would change (None: unknown,
    held by any trip); a run on other knobs (another signal's fix) is not held."""
    if cooldown_seconds <= 0:
        return None
    now = utcnow()
    since = now - timedelta(seconds=cooldown_seconds)
    for trip in store.started_by_since(BREAKER_WHO, engine, since):
        judged = judged_knobs(trip)
        shared = judged if knobs is None else judged & knobs
        if not shared or trip.started_at is None:
            continue
        remaining = (trip.started_at + timedelta(seconds=cooldown_seconds) - now).total_seconds()
        if remaining <= 0:
            continue
        return (
            f"circuit breaker hold: it rolled {', '.join(sorted(shared))} back on this engine "
            f"at {trip.started_at:%H:%M:%SZ} (execution #{trip.id}); automatic changes of "
            f"{'them' if len(shared) > 1 else 'it'} wait "
            f"{format_duration(max(0, math.ceil(remaining)))} more"
        )
    return None


def guardrail_refusal(store: Journal, spec: Runbook, engine: str, approved: bool) -> str | None:
    """The first guardrail that refuses this run now, as one sentence; None if all pass."""
    g = spec.guardrails
    if g.requires_approval and not approved:
        return f"runbook {spec.name} requires approval: rerun with --yes"
    now = utcnow()
    last = store.last_run_started(spec.name, engine)
    recent = store.runs_started_since(spec.name, engine, now - timedelta(hours=1))
    others = store.engines_under_remediation(other_than=engine)
    if last is not None and g.cooldown_seconds:
        remaining = (last + timedelta(seconds=g.cooldown_seconds) - now).total_seconds()
        if remaining > 0:
            return (
                f"cooldown: {spec.name} ran on this engine at {last:%H:%M:%SZ}; "
                f"{format_duration(max(0, math.ceil(remaining)))} left of {g.cooldown_seconds} s"
            )
    if len(recent) >= g.max_runs_per_hour:
        wait = (recent[0] + timedelta(hours=1) - now).total_seconds()
        return (
            f"max runs per hour: {len(recent)} of {g.max_runs_per_hour} in the last hour; "
            f"next allowed in {format_duration(max(0, math.ceil(wait)))}"
        )
    if len(others) >= g.max_concurrent_engines:
        return (
            f"blast radius: {len(others)} other engine(s) under remediation "
            f"(at most {g.max_concurrent_engines} at once for {spec.name})"
        )
    return None
