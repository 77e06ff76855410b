"""Alertmanager deliveries → durable events → at most one execution per episode.

Contract (docs/service.md, "Endpoints"): authenticate, validate, store durably, then answer 2xx;
4xx for a malformed payload (nothing stored); 5xx when the store is down so
Alertmanager retries. Delivery is at least once and HA peers send duplicates:
an execution is keyed by (runbook, engine, fingerprint, startsAt) in the
database, so any number of deliveries, on any number of replicas, creates one.

A delivery is one transaction: its event row and the pending executions of
its firing alerts commit together or not at all. Under load the
GroupCommitter puts the deliveries that arrive together into one
transaction (group commit): each is still acknowledged only after the commit
that holds it, so durability is unchanged and the commit cost is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Final

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.rules.config import Automation, EngineConfig
from vllm_runbook.runbooks.engine.client import normalize_url
from vllm_runbook.runbooks.service.alertmanager import Alert, WebhookPayload
from vllm_runbook.runbooks.service.discovery import Inventory, Resolution
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.store import Journal, StoreUnavailable
from vllm_runbook.runbooks.store.executions import NewExecution
from vllm_runbook.runbooks.store.models import (
    ApprovalState,
    ExecutionStatus,
)
from vllm_runbook.runbooks.store.webhook_events import NewDelivery

log = logging.getLogger("vllm_runbook.service")

WHO_MAX = 256  # executions.who
REASON_MAX = 1000
# The journal's engine of an alert that names no one engine (nothing ran on any).
UNRESOLVED = "unresolved"
MAX_BATCH = 128  # deliveries per group commit
JOB_ID: Final = "vllm-runbook-webhook-writer"
# The writer is woken by every delivery: the interval only catches what a wake missed.
INTERVAL_S: Final = 1.0
# How long a close waits for the batch in flight before committing the rest itself.
STOP_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class Router:
    """Alert → runbook (its `runbook` label, else the rule catalog's) and
    alert → exactly one engine of the inventory (service/discovery.py,
    `Inventory.resolve`: the static entry whose labels the alert carries, or
    whose name is the alert's `instance`; else the discovered engine its
    identity labels name). `inventory` None: the static `engines` alone."""

    engines: tuple[EngineConfig, ...]
    automation: Automation
    alert_runbooks: Mapping[str, str | None] = field(default_factory=dict)
    known_runbooks: frozenset[str] = frozenset()
    inventory: Inventory | None = None
    # Runbooks in advisory mode (`Config.advisory`): their executions are advice.
    advisory: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.inventory is None:
            object.__setattr__(self, "inventory", Inventory(self.engines))

    def runbook(self, alert: Alert) -> str | None:
        name = alert.labels.get("runbook") or self.alert_runbooks.get(alert.alertname)
        return name if name in self.known_runbooks else None

    def resolve(self, alert: Alert) -> Resolution:
        assert self.inventory is not None
        return self.inventory.resolve(alert.labels)

    def engine(self, alert: Alert) -> EngineConfig | None:
        return self.resolve(alert).engine


@dataclass
class Outcome:
    event_id: int
    executions: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    resolved: list[dict[str, str]] = field(default_factory=list)  # episodes to revert
    # Alerts that cannot be stored (a startsAt outside the journal's range):
    # refused one by one, the rest of the group is stored.
    rejected: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "event": self.event_id,
            "executions": self.executions,
            "skipped": self.skipped,
            "rejected": self.rejected,
        }

    @property
    def created(self) -> list[str]:
        """Runbooks of the executions this delivery created (not redeliveries)."""
        return [e["runbook"] for e in self.executions if e["created"] and e["mode"] != "refused"]


@dataclass
class _Planned:
    """What a delivery will write, decided before the transaction."""

    payload: WebhookPayload
    raw: dict[str, Any]
    size: int = 0  # bytes of the body as received
    executions: list[NewExecution] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    resolved: list[dict[str, str]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)


def plan(router: Router, payload: WebhookPayload, raw: dict[str, Any], size: int = 0) -> _Planned:
    """Route every alert (no database): pending executions, skips, rejections,
    episodes to revert. `size`: the body's bytes (kept for the retention)."""
    planned = _Planned(payload, raw, size)
    for alert in payload.alerts:

        def skip(reason: str, alert: Alert = alert) -> None:
            planned.skipped.append(
                {"alert": alert.alertname, "fingerprint": alert.fingerprint, "reason": reason}
            )

        problem = alert.starts_at_problem()
        if problem is not None:  # nothing of it can be keyed or stored
            planned.rejected.append(
                {"alert": alert.alertname, "fingerprint": alert.fingerprint, "reason": problem}
            )
            continue
        runbook = router.runbook(alert)
        if runbook is None:
            skip("no runbook for this alert")
            continue
        resolution = router.resolve(alert)
        engine = resolution.engine
        if engine is None:
            reason = resolution.reason or "no engine in the inventory matches the alert's labels"
            skip(reason)
            if alert.status == "firing":
                log.warning("alert %s (%s): %s", alert.alertname, alert.fingerprint, reason)
                # The journal says why nothing ran: a refused execution of the
                # episode, on no engine (one row per episode, like any other).
                planned.executions.append(
                    NewExecution(
                        runbook,
                        UNRESOLVED,
                        trigger="alert",
                        who=f"alertmanager:{alert.alertname}"[:WHO_MAX],
                        alert_fingerprint=alert.fingerprint,
                        alert_starts_at=alert.startsAt,
                        reason=reason[:REASON_MAX],
                        status=ExecutionStatus.REFUSED,
                    )
                )
                planned.modes.append("refused")
            continue
        # Executions are keyed by the agent URL, as `runbook exec` keys them.
        engine_url = normalize_url(engine.agent)
        if alert.status == "resolved":
            planned.resolved.append(
                {
                    "runbook": runbook,
                    "engine": engine_url,
                    "fingerprint": alert.fingerprint,
                    "startsAt": alert.startsAt.isoformat(),
                }
            )
            skip("resolved")
            continue
        mode = router.automation.mode(runbook)
        if mode == "notify":
            log.warning(
                "alert %s on %s: runbook %s not automated (notify)",
                alert.alertname,
                engine.name,
                runbook,
            )
            skip("automation: notify")
            continue
        # Advice waits for no one: it changes nothing (run/advisory.py).
        advisory = runbook in router.advisory
        planned.modes.append("advisory" if advisory else mode)
        planned.executions.append(
            NewExecution(
                runbook,
                engine_url,
                trigger="alert",
                who=f"alertmanager:{alert.alertname}"[:WHO_MAX],
                dry_run=advisory,
                alert_fingerprint=alert.fingerprint,
                alert_starts_at=alert.startsAt,
                reason=ApprovalState.AWAITING if mode == "approve" and not advisory else None,
            )
        )
    return planned


def ingest_many(store: Journal, batch: Sequence[_Planned]) -> list[Outcome]:
    """Store the deliveries and their pending executions in one transaction
    (Journal.record_deliveries).

    Raises StoreUnavailable (→ 503) when nothing was stored; a retry re-runs
    this idempotently (the episode key).
    """
    stored = store.record_deliveries(
        [
            NewDelivery(
                group_key=p.payload.groupKey,
                status=p.payload.status,
                payload=p.raw,
                payload_bytes=p.size,
                executions=p.executions,
            )
            for p in batch
        ]
    )
    outcomes = []
    for p, row in zip(batch, stored, strict=True):
        outcome = Outcome(row.event_id, skipped=p.skipped, resolved=p.resolved, rejected=p.rejected)
        for new, mode, (execution_id, was_created) in zip(
            p.executions, p.modes, row.executions, strict=True
        ):
            outcome.executions.append(
                {
                    "id": execution_id,
                    "runbook": new.runbook,
                    "engine": new.engine,
                    "created": was_created,
                    "mode": mode,
                }
            )
        outcomes.append(outcome)
    return outcomes


def ingest(
    store: Journal, router: Router, payload: WebhookPayload, raw: dict[str, Any], size: int = 0
) -> Outcome:
    """One delivery, its own transaction."""
    return ingest_many(store, [plan(router, payload, raw, size)])[0]


class GroupCommitter:
    """Deliveries queued together are committed together, by one job of the
    service's scheduler (service/jobs.py), woken by every `submit`.

    `submit` returns a Future resolved after the commit that holds the
    delivery (or failed with the store's error). A pass commits what is
    queued, at most `max_batch` deliveries per transaction, until the queue
    is empty. A batch that fails for any other reason than an unavailable
    store is retried one delivery at a time, so one bad delivery cannot fail
    the others. `close` stops the job and commits what is still queued.

    Not scheduled (an app built alone, as the tests build one; or closed),
    `commit` drains the queue itself, off the event loop, once it queued its
    delivery: what queued together still commits together.
    """

    def __init__(self, store: Journal, router: Router, max_batch: int = MAX_BATCH) -> None:
        self.store = store
        self.router = router
        self.max_batch = max_batch
        self._queue: queue.Queue[tuple[_Planned, Future[Outcome]]] = queue.Queue()
        self._writing = threading.Lock()  # one batch at a time: the job's, or a drain's
        self._job = WakeableJob(self._pass, job_id=JOB_ID, name="webhook-writer")

    def schedule(self, scheduler: BaseScheduler, interval_s: float = INTERVAL_S) -> Job:
        """The writer on `scheduler`: woken by every delivery; `interval_s` is a safety net."""
        return self._job.schedule(scheduler, interval_s)

    @property
    def scheduled(self) -> bool:
        return self._job.scheduled

    def submit(
        self, payload: WebhookPayload, raw: dict[str, Any], size: int = 0
    ) -> Future[Outcome]:
        future: Future[Outcome] = Future()
        self._queue.put((plan(self.router, payload, raw, size), future))
        self._job.wake()
        return future

    async def commit(self, payload: WebhookPayload, raw: dict[str, Any], size: int = 0) -> Outcome:
        """`submit`, then the delivery's outcome once committed (the store's error raised)."""
        future = self.submit(payload, raw, size)
        if not self.scheduled:  # no job to wake: commit what is queued, off the event loop
            await asyncio.to_thread(self.drain)
        return await asyncio.wrap_future(future)

    def drain(self) -> None:
        """Commit every delivery queued, batch after batch, in this thread."""
        while self._pass():
            pass

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """No further pass; the one in flight ends (up to `timeout_s`), then what
        is still queued is committed here."""
        if not self._job.stop(timeout_s):
            log.warning(
                "webhook writer: a commit still runs after %g s; the deliveries queued "
                "behind it are not committed (Alertmanager sends them again)",
                timeout_s,
            )
            return
        self.drain()

    def _pass(self) -> bool:
        """One batch: up to `max_batch` queued deliveries, one transaction. True if
        it committed one (more may be queued)."""
        with self._writing:
            batch: list[tuple[_Planned, Future[Outcome]]] = []
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                return False
            self._commit(batch)
            return True

    def _commit(self, batch: list[tuple[_Planned, Future[Outcome]]]) -> None:
        try:
            outcomes = ingest_many(self.store, [p for p, _ in batch])
        except StoreUnavailable as exc:
            for _, future in batch:
                _settle(future, exc)
            return
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            log.warning("webhook batch of %d failed (%s); one at a time", len(batch), exc)
            for one in batch:
                self._commit([one])
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            _settle(future, outcome)


def _settle(future: Future[Outcome], result: Outcome | BaseException) -> None:
    """Resolve `future`; one cancelled meanwhile (its request was cancelled) is
    left as it is: it must not keep the rest of its batch unanswered."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
