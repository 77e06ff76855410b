"""Runs what the webhook recorded: pending alert executions, and reverts when
their alerts resolve and their causes are gone (runbooks/run/hold.py: an
execution holds its changes after its alert resolved; a finding back right
after a revert re-applies what held).

Exactly-once is the database's job: the webhook creates one pending execution
per alert episode (a unique key), and a worker runs one only after taking a
lease named after it, so among any number of replicas exactly one runs it.
A pending execution awaiting approval ("approve" mode) is left for a person
(vllm_runbook.runbooks.store.approvals); once approved the worker runs it like any
other, under the same lease. Each tick also refuses the approvals that
expired, and an alert that resolves refuses its execution still waiting.

Work is found by what it is, not by where it sits in the journal: each tick
reads the runnable executions (pending, an alert's, waiting for nobody)
from a partial index, oldest first, however many executions are finished or
await a person. A webhook delivery or an answer taken by this process wakes
the worker at once (`wake`); what another replica or `runbook approve`
records is found at the next poll (`interval`, 1 s).

The worker is a job of the service's APScheduler scheduler (`schedule`,
service/jobs.py), beside the rules' cycle and the retention; it has no
scheduler or thread of its own (a test schedules it on one it owns, or
calls `tick`).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from datetime import datetime
from typing import Any, Final

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.runbooks.model.config import ExecutorConfig
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.run.hold import Holds, hold_on_resolve, premature_revert, reapply
from vllm_runbook.runbooks.run.revert import RevertRefused
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import ExecutionRecord, Journal, StoreError
from vllm_runbook.runbooks.store.approvals import DEFAULT_APPROVAL_TIMEOUT_S
from vllm_runbook.runbooks.store.models import ApprovalState, ExecutionStatus

log = logging.getLogger("vllm_runbook.service")

__all__ = ["ExecutorHook", "Worker"]

RUNNABLE_PAGE = 100  # runnable executions read per query
JOB_ID: Final = "vllm-runbook-worker"
# How long a stop waits for the execution in flight; one still running when the
# process ends is settled as interrupted by the next run on this host.
STOP_TIMEOUT_S: Final = 30.0
# A holding execution is judged by one replica at a time, for this long after
# its last pass (its revert, when it comes, holds the engine's lock).
HOLD_LEASE_S: Final = 30.0


class Worker:
    def __init__(
        self,
        store: Journal,
        executor: Executor,
        *,
        interval: float = 1.0,
        lease_seconds: float = 3600.0,
        waits: ExecutorConfig | None = None,
        metrics: ServiceMetrics | None = None,
        approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S,
    ) -> None:
        """`waits` replace the runbooks' own (the config's `executor:` section);
        `approval_timeout_s` is how long an execution awaits approval."""
        self.approval_timeout_s = approval_timeout_s
        self.store = store
        self.executor = executor
        self.waits = waits or ExecutorConfig()
        self.metrics = metrics
        self.interval = interval
        self.lease_seconds = lease_seconds
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.resolved: queue.Queue[dict[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self._job = WakeableJob(self._pass, job_id=JOB_ID, name="worker")
        self.holds = Holds(
            executor,
            hold_seconds=self.waits.hold_seconds,
            healthy_period_seconds=self.waits.healthy_period_seconds,
        )

    def schedule(self, scheduler: BaseScheduler) -> Job:
        """Poll every `interval` on `scheduler`, first now; woken by `wake`."""
        return self._job.schedule(scheduler, self.interval)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """No further tick; wait up to `timeout_s` for the one in flight (the
        execution it runs is not interrupted; the tick looks for no more)."""
        self._stop.set()
        if not self._job.stop(timeout_s):
            log.warning(
                "worker: an execution still runs after %g s; if the process ends "
                "first, the next run on this host settles it as interrupted",
                timeout_s,
            )

    def wake(self) -> None:
        """New work was recorded: don't wait for the next poll."""
        self._job.wake()

    def _pass(self) -> bool:
        try:
            self.tick()
        except StoreError as exc:  # the store is down: try again next poll
            log.warning("worker: store unavailable (%s); retrying", exc)
        except Exception:
            log.exception("worker: unexpected error; continuing")
        return False  # more work wakes it

    def tick(self) -> int:
        """Run what is pending and revert what resolved; returns how many ran."""
        ran = 0
        for expired in self.store.expire_approvals(self.approval_timeout_s):
            if self.metrics is not None:
                self.metrics.execution_finished(expired)
            log.warning(
                "execution #%d (%s on %s): %s",
                expired.id,
                expired.runbook,
                expired.engine,
                expired.reason,
            )
        # Resolutions first: an execution whose alert resolved while it was
        # queued (the worker busy with another) is refused, not run.
        self._drain_resolved()
        # Every runnable execution, however old and however large the journal:
        # an indexed query of what is runnable, a page at a time.
        after = 0
        while not self._stop.is_set():
            page = self.store.runnable_executions(after_id=after, limit=RUNNABLE_PAGE)
            for record in page:
                ran += self._run_one(record)
            if len(page) < RUNNABLE_PAGE:
                break
            after = page[-1].id
        self._drain_resolved()
        self._judge_holds()
        return ran

    def release(self, execution_id: int, who: str) -> None:
        """A person releases a holding execution (the page): revert it now, in
        a thread of its own (a stepwise revert waits between its stages)."""

        def revert() -> None:
            try:
                record = self.store.get_execution(execution_id)
                spec = self.executor.runbook(record.runbook)
                result = self.executor.revert(
                    execution_id,
                    who=who,
                    stepwise=bool(spec.revert.stepwise),
                    healthy_period_seconds=self.waits.healthy_period_seconds,
                    reason=f"released by {who} from the page",
                )
            except Exception as exc:  # a person's answer: logged, the page shows the journal
                log.warning("release of execution #%d by %s: %s", execution_id, who, exc)
                return
            if self.metrics is not None and result.record.reverts_id is not None:
                self.metrics.revert_finished(self.store.get_execution(execution_id), result.record)

        threading.Thread(target=revert, name=f"release-{execution_id}", daemon=True).start()

    def _judge_holds(self) -> None:
        """Revert the holding executions whose hold is over and cause gone."""
        holding = self.store.holding_executions()
        if self.metrics is not None:
            self.metrics.set_holding(holding)
        for record in holding:
            if self._stop.is_set():
                return
            # Renewed at every pass; a replica that stops judges no more after it.
            if not self.store.acquire_lease(f"hold:{record.id}", self.holder, HOLD_LEASE_S):
                continue  # another replica judges it
            try:
                result = self.holds.judge(record)
            except RevertRefused as refused:  # reverted meanwhile (a person, another replica)
                log.warning("execution #%d: %s", record.id, refused)
                continue
            if result is None:
                continue
            if self.metrics is not None and result.record.reverts_id is not None:
                self.metrics.revert_finished(self.store.get_execution(record.id), result.record)
            log.warning(
                "execution #%d (%s on %s): held, then reverted by #%d: %s",
                record.id,
                record.runbook,
                record.engine,
                result.record.id,
                result.record.status,
            )

    def _drain_resolved(self) -> None:
        while True:
            try:
                item = self.resolved.get_nowait()
            except queue.Empty:
                return
            self._hold(item)

    def _run_one(self, record: ExecutionRecord) -> int:
        if not self.store.acquire_lease(f"execution:{record.id}", self.holder, self.lease_seconds):
            return 0  # another replica runs it
        if self.store.get_execution(record.id).status != ExecutionStatus.PENDING:
            return 0  # ran or refused meanwhile (the alert resolved, a rejection)
        revert = premature_revert(self.executor, record)
        if revert is not None:
            # The finding came back right after a revert: put back what held.
            result = reapply(self.executor, record, revert)
            if self.metrics is not None and result.record.status == ExecutionStatus.SUCCEEDED:
                self.metrics.revert_premature(record.runbook, record.engine)
        else:
            result = self.executor.run_pending(
                record.id,
                approved=True,
                verify_seconds=self.waits.verify_seconds,
                condition_seconds=self.waits.condition_seconds,
            )
        if self.metrics is not None:
            self.metrics.execution_finished(result.record)
        log.warning(
            "runbook %s on %s for alert %s: %s",
            record.runbook,
            record.engine,
            record.alert_fingerprint,
            result.record.status + (f" ({result.message})" if result.message else ""),
        )
        return 1

    def _hold(self, item: dict[str, Any]) -> None:
        gone = self.executor.gone(item["engine"]) if self.executor.gone is not None else None
        if gone is not None:
            # Its findings resolved because it left: nothing to restore on it.
            log.warning("alert %s resolved: %s; nothing reverted", item["fingerprint"], gone)
            return
        starts_at = datetime.fromisoformat(item["startsAt"])
        waiting = self.store.resolve_before_start(
            item["runbook"], item["engine"], item["fingerprint"], starts_at
        )
        if waiting is not None:
            if self.metrics is not None:
                self.metrics.execution_finished(waiting)
            log.warning("execution #%d: %s", waiting.id, waiting.reason)
            return
        held = hold_on_resolve(
            self.executor,
            item["runbook"],
            item["engine"],
            item["fingerprint"],
            starts_at,
            hold_seconds=self.waits.hold_seconds,
        )
        if held is not None:
            log.warning(
                "alert %s resolved: execution #%d on %s holds: %s",
                item["fingerprint"],
                held.id,
                item["engine"],
                held.hold_note,
            )


class ExecutorHook:
    """The embedded evaluator's RemediationHook: a firing incident becomes a
    pending execution (one per episode, whatever the number of replicas),
    which the worker runs; its resolution queues the revert."""

    def __init__(
        self, store: Journal, worker: Worker, advisory: frozenset[str] = frozenset()
    ) -> None:
        self.store = store
        self.worker = worker
        # Runbooks in advisory mode (`Config.advisory`): their executions are advice.
        self.advisory = advisory

    @staticmethod
    def _episode(handoff: Any) -> tuple[str, datetime]:
        """(fingerprint, startsAt) of the incident's episode. startsAt is when it
        fired, as Prometheus sends it to Alertmanager (its FiredAt, after `for`),
        so detection-to-action means the same on both paths."""
        import hashlib
        from datetime import UTC

        incident = handoff.incident
        fingerprint = "rule-" + hashlib.sha256(handoff.episode.encode()).hexdigest()[:24]
        fired = incident.fired_at if incident.fired_at is not None else incident.first_seen
        return fingerprint, datetime.fromtimestamp(fired, UTC)

    def on_firing(self, handoff: Any) -> None:
        from vllm_runbook.runbooks.engine.client import normalize_url

        if handoff.engine is None:
            log.warning(
                "incident %s: engine %s not in the inventory; nothing to run",
                handoff.incident.alert,
                handoff.engine_name,
            )
            return
        fingerprint, starts_at = self._episode(handoff)
        advisory = handoff.runbook in self.advisory  # advice waits for no one
        _record, created = self.store.create_execution(
            handoff.runbook,
            normalize_url(handoff.engine.agent),
            # An alert episode like Alertmanager's (the journal keys executions
            # by episode for trigger 'alert' only); `who` tells the two apart.
            trigger="alert",
            who=f"rules:{handoff.incident.alert}",
            dry_run=advisory,
            alert_fingerprint=fingerprint,
            alert_starts_at=starts_at,
            reason=ApprovalState.AWAITING if handoff.mode == "approve" and not advisory else None,
        )
        if created and self.worker.metrics is not None:
            self.worker.metrics.execution_created(handoff.runbook)
        self.worker.wake()

    def on_resolved(self, handoff: Any) -> None:
        from vllm_runbook.runbooks.engine.client import normalize_url

        if handoff.engine is None:
            return
        fingerprint, starts_at = self._episode(handoff)
        self.worker.resolved.put(
            {
                "runbook": handoff.runbook,
                "engine": normalize_url(handoff.engine.agent),
                "fingerprint": fingerprint,
                "startsAt": starts_at.isoformat(),
            }
        )
        self.worker.wake()
