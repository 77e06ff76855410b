"""Notifications: every execution event to the configured receivers.

    notifier = Notifier(store, receivers_from(config.notifications), metrics=metrics)
    notifier.schedule(scheduler)   # the feed job + one delivery job per receiver (job_count)
    notifier.stop()

Events are not pushed by the executor: every transaction that changes an
execution appends the events it implies to the store's events table, in the
same commit (store/events.py): awaiting approval, started, then succeeded |
no measurable change | failed | rolled back | refused | nothing to improve |
interrupted, and reverted. So every path that writes the journal (the webhook, the worker,
`runbook exec`, `runbook approve` on another machine, a crashed run settled
later) notifies, and the executor is never blocked or even aware of it.

The feed reads the events table by id from a cursor per receiver (ids only
grow and become visible in order, so a page never repeats and nothing is
skipped however many events share a timestamp), and queues one outbox row
per event and receiver, moving the cursors in the same transaction; the
cursors are in the database, so a restart goes on where the feed stopped.

The feed and each receiver's delivery are jobs of the service's APScheduler
scheduler (service/jobs.py), beside the worker and the rules' cycle; each
never overlaps itself, and the feed wakes a delivery when it queued rows.

Each receiver's delivery job claims queued rows for a lease
(`notifications.claim_lease`), renews the claim while it tries, and records
the fate: among replicas watching one database the one holding the claim
delivers. A replica that dies leaves its claims to lapse; another replica
then claims and sends them again: delivery is at least once, and every
message carries the event's key (the webhook's `key`, the Slack text's last
line) so a receiver drops a duplicate. A delivery is retried with exponential
backoff in its receiver's own job (a slow or dead receiver delays only
itself); its fate is recorded in the outbox (visible in `runbook history ID`
and on the page) and counted in `vllm_runbook_service_notifications_total`.

Receivers: `webhook` posts the event as JSON (optionally with a bearer
token); `slack` posts `{"text": ...}` (a Slack-compatible incoming webhook),
the text rendered from templates/notification.txt.j2 in the sandbox. Alert
labels and notes are untrusted: in the text every value is one line and, for
Slack, escaped (render.py), so it can add no line, mention or link; the
webhook's JSON carries them in their own fields (`alert`, `execution`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Protocol

import httpx
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.runbooks.model.config import NotificationsConfig
from vllm_runbook.runbooks.run.render import PLAIN, SLACK, render_notification
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.store import ExecutionRecord, Journal, StoreError
from vllm_runbook.runbooks.store.events import NO_CHANGE, derive_events
from vllm_runbook.runbooks.store.models import NOTIFY_DELIVERED, NOTIFY_FAILED
from vllm_runbook.runbooks.store.notifications import Claim

__all__ = [
    "NO_CHANGE",
    "HttpSender",
    "Notifier",
    "Receiver",
    "events_of",
    "message",
    "payload",
    "receivers_from",
]

log = logging.getLogger("vllm_runbook.notify")

# Where the feed of a receiver never fed starts: events written in the last
# minutes before it first ran are still sent (a new receiver does not get the
# whole history). Afterwards its cursor is stored.
START_LOOKBACK: Final = timedelta(minutes=5)
FEED_PAGE: Final = 1000  # events read per query
CLAIM_BATCH: Final = 16  # outbox rows a delivery job claims at once
DEFAULT_CLAIM_LEASE_S: Final = 30.0
FEED_JOB_ID: Final = "vllm-runbook-notify-feed"
DELIVERY_JOB_ID: Final = "vllm-runbook-notify-{receiver}"
STOP_TIMEOUT_S: Final = 10.0  # per job: a stopping delivery gives its claims back at once


def alert_name(record: ExecutionRecord) -> str | None:
    """The alert behind an execution: its `who` is `alertmanager:NAME` or `rules:NAME`."""
    source, sep, name = record.who.partition(":")
    return name if sep and source in ("alertmanager", "rules") else None


def events_of(record: ExecutionRecord) -> list[str]:
    """The events an execution's record implies so far, in order (what the
    store appends as the execution changes; store/events.py)."""
    return derive_events(
        dry_run=record.dry_run,
        reverts_id=record.reverts_id,
        reason=record.reason,
        decision=record.decision,
        started_at=record.started_at,
        status=record.status,
        error=record.error,
        verification=record.verification,
        interrupted=record.interrupted,
        hold_since=record.hold_since,
        hold_for_person=record.hold_for_person,
        premature=record.premature,
        trigger=record.trigger,
    )


class Sender(Protocol):
    """Sends one event; raises on failure (the notifier retries). `key` is the
    event's key: the same in every delivery of that event."""

    def __call__(
        self, receiver: Receiver, event: str, record: ExecutionRecord, key: str
    ) -> None: ...


@dataclass(frozen=True)
class Receiver:
    name: str
    type: str  # webhook | slack
    url: str
    token: str | None = None


def receivers_from(config: NotificationsConfig) -> list[Receiver]:
    """The configured receivers, their token files read (OSError if unreadable)."""
    out = []
    for r in config.receivers:
        token = None if r.token_file is None else r.token_file.read_text().strip() or None
        out.append(Receiver(r.name, r.type, r.url, token))
    return out


def message(
    record: ExecutionRecord,
    event: str,
    page_url: str | None = None,
    key: str | None = None,
    receiver_format: str = PLAIN,
) -> str:
    """The human text of an event (the webhook's `text`; SLACK: Slack's `text`);
    its last line names the event's key."""
    link = f"{page_url.rstrip('/')}/#execution-{record.id}" if page_url else None
    return render_notification(
        record,
        alert_name=alert_name(record),
        event=event,
        link=link,
        receiver_format=receiver_format,
        key=key,
    )


def payload(
    record: ExecutionRecord, event: str, page_url: str | None = None, key: str | None = None
) -> dict[str, Any]:
    """The generic webhook's JSON body; `key` is the event's (drop a repeated key)."""
    return {
        "event": event,
        "key": key,
        "execution_id": record.id,
        "runbook": record.runbook,
        "engine": record.engine,
        "alert": alert_name(record),
        "text": message(record, event, page_url, key),
        "execution": record.to_dict(),
    }


class HttpSender:
    """POSTs with httpx: JSON for `webhook`, `{"text"}` for `slack`; 2xx is success."""

    def __init__(self, timeout_s: float, page_url: str | None = None) -> None:
        self.client = httpx.Client(timeout=timeout_s, follow_redirects=False)
        self.page_url = page_url

    def __call__(self, receiver: Receiver, event: str, record: ExecutionRecord, key: str) -> None:
        headers = {"Authorization": f"Bearer {receiver.token}"} if receiver.token else {}
        if receiver.type == "slack":
            body: dict[str, Any] = {"text": message(record, event, self.page_url, key, SLACK)}
        else:
            body = payload(record, event, self.page_url, key)
        response = self.client.post(receiver.url, json=body, headers=headers)
        if not response.is_success:
            raise RuntimeError(f"HTTP {response.status_code} from {receiver.url}")

    def close(self) -> None:
        self.client.close()


def _why(error: BaseException) -> str:
    if isinstance(error, httpx.TimeoutException):
        return f"timed out ({type(error).__name__})"
    if isinstance(error, httpx.TransportError):
        return f"unreachable ({type(error).__name__}: {error})"
    return str(error) or type(error).__name__


class _Held:
    """The claims of one batch: renewed once a quarter of the lease has passed,
    so a claim outlives any one attempt (the lease is at least 4 timeouts)."""

    def __init__(self, notifier: Notifier, claims: list[Claim]) -> None:
        self.notifier = notifier
        self.ids = {c.id for c in claims}
        self.renewed = time.monotonic()

    def keep(self, claim_id: int) -> bool:
        """Whether this replica still holds the claim (renewing the batch if due)."""
        n = self.notifier
        if claim_id in self.ids and time.monotonic() - self.renewed >= n.claim_lease_s / 4:
            self.ids = n.store.renew_claims(self.ids, n.holder, n.claim_lease_s)
            self.renewed = time.monotonic()
        return claim_id in self.ids


class Notifier:
    """The feed job and one delivery job per receiver (see the module doc)."""

    def __init__(
        self,
        store: Journal,
        receivers: list[Receiver],
        *,
        retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 5.0,
        page_url: str | None = None,
        interval_s: float = 1.0,
        claim_lease_s: float = DEFAULT_CLAIM_LEASE_S,
        sender: Sender | None = None,
        metrics: Any = None,
        on_finished: Callable[[str, str, int], None] | None = None,
    ) -> None:
        if claim_lease_s < 4 * timeout_s:
            raise ValueError(
                f"claim lease {claim_lease_s:g} s: at least 4 x the timeout ({timeout_s:g} s)"
            )
        self.store = store
        self.receivers = list(receivers)
        self.retries = retries
        self.backoff_s = backoff_s
        self.interval_s = interval_s
        self.claim_lease_s = claim_lease_s
        self._http = None if sender is not None else HttpSender(timeout_s, page_url)
        self.sender: Sender = sender or self._http  # type: ignore[assignment]
        self.metrics = metrics
        self.on_finished = on_finished
        # Names this replica in the claims it takes (as the worker's leases do).
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._cursors: dict[str, int] = {}
        self._stop = threading.Event()
        self._feed_job = WakeableJob(self._feed_pass, job_id=FEED_JOB_ID, name="notify-feed")
        self._deliveries = {
            r.name: WakeableJob(
                functools.partial(self._delivery_pass, r),
                job_id=DELIVERY_JOB_ID.format(receiver=r.name),
                name=f"notify-{r.name}",
            )
            for r in self.receivers
        }

    @classmethod
    def from_config(cls, store: Journal, config: NotificationsConfig, **kwargs: Any) -> Notifier:
        return cls(
            store,
            receivers_from(config),
            retries=config.retries,
            backoff_s=config.backoff_seconds,
            timeout_s=config.timeout_seconds,
            page_url=config.page_url,
            claim_lease_s=config.claim_lease_seconds,
            **kwargs,
        )

    @property
    def job_count(self) -> int:
        """The jobs `schedule` adds (the scheduler's pool needs a thread for each)."""
        return 1 + len(self._deliveries)

    def schedule(self, scheduler: BaseScheduler) -> None:
        """The feed and every receiver's delivery on `scheduler`, each every
        `interval_s`, first now; a delivery is woken when the feed queued rows."""
        self._feed_job.schedule(scheduler, self.interval_s)
        for job in self._deliveries.values():
            job.schedule(scheduler, self.interval_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """No further pass; a delivery in flight gives its claims back to the
        other replicas now (not when the lease lapses); waits for them."""
        self._stop.set()
        for job in [self._feed_job, *self._deliveries.values()]:
            job.stop(timeout_s)
        if self._http is not None:
            self._http.close()

    # --- the feed ------------------------------------------------------------------

    def _feed_pass(self) -> bool:
        try:
            self.poll()
        except StoreError as exc:
            log.warning("notifications: store unavailable (%s); retrying", exc)
        except Exception:
            log.exception("notifications: unexpected error; continuing")
        return False

    def poll(self) -> int:
        """Queue an outbox row per receiver for every event written since the
        feed last looked; returns how many rows this call queued (rows another
        replica queued first are not counted)."""
        names = [r.name for r in self.receivers]
        if not names:
            return 0
        stored = self.store.feed_cursors(names, lookback=START_LOOKBACK)
        # Another replica may have moved the stored cursors further: start there.
        cursors = {n: max(stored[n], self._cursors.get(n, 0)) for n in names}
        queued, seen = 0, False
        while not self._stop.is_set():
            events = self.store.events_after(min(cursors.values()), limit=FEED_PAGE)
            if not events:
                break
            seen = True
            queued += sum(self.store.queue_notifications(events, cursors).values())
            cursors = {n: max(c, events[-1].id) for n, c in cursors.items()}
            if len(events) < FEED_PAGE:
                break
        self._cursors = cursors
        if seen:
            for job in self._deliveries.values():
                job.wake()
        return queued

    # --- delivery ------------------------------------------------------------------

    def _delivery_pass(self, receiver: Receiver) -> bool:
        """Deliver what is queued; True (run again at once) when some was sent.
        New rows wake the job (this replica's feed); claims of a replica that
        died lapse without a sound: looked for every interval."""
        try:
            return self.send_queued(receiver) > 0
        except StoreError as exc:
            log.warning("notifications: %s: store unavailable (%s)", receiver.name, exc)
        except Exception:
            log.exception("notifications: %s: unexpected error", receiver.name)
        return False

    def send_queued(self, receiver: Receiver) -> int:
        """Claim and deliver the queued rows of `receiver` until none is left
        that nobody holds; returns how many this replica delivered or failed."""
        done = 0
        while not self._stop.is_set():
            claims = self.store.claim_notifications(
                receiver.name, self.holder, self.claim_lease_s, limit=CLAIM_BATCH
            )
            if not claims:
                break
            held = _Held(self, claims)
            records = self.store.executions_by_id(c.execution_id for c in claims)
            for claim in claims:
                if self._stop.is_set():
                    break
                record = records.get(claim.execution_id)
                if self.deliver(receiver, claim, held.keep, record) is not None:
                    done += 1
            if self._stop.is_set():
                # Stopping: what this replica holds goes to the others now,
                # not when the lease lapses.
                self.store.release_claims(held.ids, self.holder)
        return done

    def deliver(
        self,
        receiver: Receiver,
        claim: Claim,
        keep: Callable[[int], bool] | None = None,
        record: ExecutionRecord | None = None,
    ) -> str | None:
        """Send one claimed row, retrying with backoff; record and count its fate.
        None when the claim was lost (it lapsed and another replica took it) or
        the notifier stops: the fate is then another replica's to record."""
        keep = keep or (lambda _id: True)
        if record is None:
            record = self.store.get_execution(claim.execution_id)
        key = claim.event_key or f"notification-{claim.id}"
        attempts, error = 0, None
        for attempt in range(self.retries + 1):
            # 1 s, 2 s, 4 s, ... (backoff_s doubled) before a retry.
            if attempt and not self._pause(self.backoff_s * 2 ** (attempt - 1), claim.id, keep):
                return None
            if not keep(claim.id):
                log.warning(
                    "notification %s of execution #%d to %s: claim lost to another replica",
                    claim.event,
                    claim.execution_id,
                    receiver.name,
                )
                return None
            attempts += 1
            try:
                self.sender(receiver, claim.event, record, key)
            except Exception as exc:  # every failure of a receiver is retried alike
                error = _why(exc)
                log.warning(
                    "notification %s of execution #%d to %s: attempt %d failed: %s",
                    claim.event,
                    claim.execution_id,
                    receiver.name,
                    attempts,
                    error,
                )
                continue
            error = None
            break
        outcome = NOTIFY_FAILED if error is not None else NOTIFY_DELIVERED
        if outcome == NOTIFY_FAILED:
            error = f"after {attempts} attempt(s): {error}"
        recorded = self.store.finish_notification(
            claim.id, outcome, attempts, error, holder=self.holder
        )
        if recorded is None:
            return None  # our claim lapsed meanwhile: the new holder records its own
        if self.metrics is not None:
            self.metrics.notification_sent(receiver.name, outcome)
        if self.on_finished is not None:
            self.on_finished(receiver.name, claim.event, claim.execution_id)
        return outcome

    def _pause(self, seconds: float, claim_id: int, keep: Callable[[int], bool]) -> bool:
        """Wait before a retry, keeping the claim; False when stopping or lost."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._stop.wait(min(left, self.claim_lease_s / 4)):
                return False
            if not keep(claim_id):
                return False
        return True
