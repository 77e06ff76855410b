"""Notifications: every execution event to the configured receivers.

    notifier = Notifier(store, receivers_from(config.notifications), metrics=metrics)
    notifier.start()      # a feed thread + one delivery thread per receiver
    notifier.stop()

Events are read from the journal, not pushed by the executor: the feed polls
the executions written since it last looked and derives, from each record,
the events its history implies (`events_of`): awaiting approval, started,
then succeeded | no measurable change | failed | rolled back | refused |
interrupted, and reverted. So every path that writes the journal (the
webhook, the worker, `runbook exec`, `runbook approve` on another machine, a
crashed run settled later) notifies, and the executor is never blocked or
even aware of it.

Each (execution, event, receiver) is claimed in the store's outbox before it
is sent (a unique key): among replicas watching one database the one whose
claim wins delivers, once. A delivery is retried with exponential backoff on
its receiver's own thread (a slow or dead receiver delays only itself); its
fate is recorded in the outbox (visible in `runbook history ID` and on the
page) and counted in `vllm_runbook_service_notifications_total`.

Receivers: `webhook` posts the event as JSON (optionally with a bearer
token); `slack` posts `{"text": ...}` (a Slack-compatible incoming webhook),
the text rendered from templates/notification.txt.j2 in the sandbox. Alert
labels and notes are untrusted: in the text every value is one line and, for
Slack, escaped (render.py), so it can add no line, mention or link; the
webhook's JSON carries them in their own fields (`alert`, `execution`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Protocol

import httpx
from vllm_runbook.rules.config import NotificationsConfig
from vllm_runbook.runbooks.render import PLAIN, SLACK, render_notification
from vllm_runbook.runbooks.store import ExecutionRecord, Store, StoreError
from vllm_runbook.runbooks.store.models import (
    AWAITING_APPROVAL,
    FAILED,
    INTERRUPTED_REASON,
    NOTIFY_DELIVERED,
    NOTIFY_FAILED,
    REFUSED,
    REVERTED,
    ROLLED_BACK,
    SUCCEEDED,
    utcnow,
)

log = logging.getLogger("vllm_runbook.notify")

AWAITING: Final = "awaiting approval"
STARTED: Final = "started"
NO_CHANGE: Final = "no measurable change"
EVENTS: Final = (
    AWAITING,
    STARTED,
    "succeeded",
    NO_CHANGE,
    "failed",
    "rolled back",
    "refused",
    "interrupted",
    "reverted",
)
# How far back the feed looks when it starts: events written while no
# replica ran are still sent (claims make a second look harmless).
START_LOOKBACK: Final = timedelta(minutes=5)
# Re-read this much before the newest change seen: clocks of replicas writing
# one database differ a little, and a transaction may commit late.
OVERLAP: Final = timedelta(seconds=5)


def alert_name(record: ExecutionRecord) -> str | None:
    """The alert behind an execution: its `who` is `alertmanager:NAME` or `rules:NAME`."""
    source, sep, name = record.who.partition(":")
    return name if sep and source in ("alertmanager", "rules") else None


def events_of(record: ExecutionRecord) -> list[str]:
    """The events an execution's record implies so far, in order.

    Dry runs and reverts (executions that restore another) are not
    remediations: they notify nothing (the reverted one says `reverted`).
    """
    if record.dry_run or record.reverts_id is not None:
        return []
    events = []
    if record.reason == AWAITING_APPROVAL or record.decision is not None:
        events.append(AWAITING)
    if record.started_at is not None:
        events.append(STARTED)
    if record.interrupted or (record.status == FAILED and record.error == INTERRUPTED_REASON):
        events.append("interrupted")
    elif record.status == FAILED:
        outcome = (record.verification or {}).get("outcome")
        events.append(NO_CHANGE if outcome == "not improved" else "failed")
    elif record.status == SUCCEEDED:
        events.append("succeeded")
    elif record.status == ROLLED_BACK:
        events.append("rolled back")
    elif record.status == REFUSED:
        events.append("refused")
    elif record.status == REVERTED:
        events.append("reverted")
    return events


class Sender(Protocol):
    """Sends one event; raises on failure (the notifier retries)."""

    def __call__(self, receiver: Receiver, event: str, record: ExecutionRecord) -> None: ...


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
    record: ExecutionRecord, event: str, page_url: str | None = None, receiver_format: str = PLAIN
) -> str:
    """The human text of an event (the webhook's `text`; SLACK: Slack's `text`)."""
    link = f"{page_url.rstrip('/')}/#execution-{record.id}" if page_url else None
    return render_notification(
        record,
        alert_name=alert_name(record),
        event=event,
        link=link,
        receiver_format=receiver_format,
    )


def payload(record: ExecutionRecord, event: str, page_url: str | None = None) -> dict[str, Any]:
    """The generic webhook's JSON body."""
    return {
        "event": event,
        "execution_id": record.id,
        "runbook": record.runbook,
        "engine": record.engine,
        "alert": alert_name(record),
        "text": message(record, event, page_url),
        "execution": record.to_dict(),
    }


class HttpSender:
    """POSTs with httpx: JSON for `webhook`, `{"text"}` for `slack`; 2xx is success."""

    def __init__(self, timeout_s: float, page_url: str | None = None) -> None:
        self.client = httpx.Client(timeout=timeout_s, follow_redirects=False)
        self.page_url = page_url

    def __call__(self, receiver: Receiver, event: str, record: ExecutionRecord) -> None:
        headers = {"Authorization": f"Bearer {receiver.token}"} if receiver.token else {}
        if receiver.type == "slack":
            body: dict[str, Any] = {"text": message(record, event, self.page_url, SLACK)}
        else:
            body = payload(record, event, self.page_url)
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


class Notifier:
    """The feed thread and one delivery thread per receiver (see the module doc)."""

    def __init__(
        self,
        store: Store,
        receivers: list[Receiver],
        *,
        retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 5.0,
        page_url: str | None = None,
        interval_s: float = 1.0,
        sender: Sender | None = None,
        metrics: Any = None,
        on_finished: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.store = store
        self.receivers = list(receivers)
        self.retries = retries
        self.backoff_s = backoff_s
        self.interval_s = interval_s
        self._http = None if sender is not None else HttpSender(timeout_s, page_url)
        self.sender: Sender = sender or self._http  # type: ignore[assignment]
        self.metrics = metrics
        self.on_finished = on_finished
        self.since = utcnow() - START_LOOKBACK
        self._stop = threading.Event()
        self._queues: dict[str, queue.Queue[tuple[int, str, int]]] = {
            r.name: queue.Queue() for r in self.receivers
        }
        self._threads = [threading.Thread(target=self._feed, name="notify-feed", daemon=True)] + [
            threading.Thread(target=self._deliver, args=(r,), name=f"notify-{r.name}", daemon=True)
            for r in self.receivers
        ]

    @classmethod
    def from_config(cls, store: Store, config: NotificationsConfig, **kwargs: Any) -> Notifier:
        return cls(
            store,
            receivers_from(config),
            retries=config.retries,
            backoff_s=config.backoff_seconds,
            timeout_s=config.timeout_seconds,
            page_url=config.page_url,
            **kwargs,
        )

    def start(self) -> Notifier:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)
        if self._http is not None:
            self._http.close()

    # --- the feed ------------------------------------------------------------------

    def _feed(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except StoreError as exc:
                log.warning("notifications: store unavailable (%s); retrying", exc)
            except Exception:
                log.exception("notifications: unexpected error; continuing")
            self._stop.wait(self.interval_s)

    def poll(self) -> int:
        """Claim the events written since the last poll; returns how many were queued."""
        queued = 0
        newest: datetime | None = None
        for record in self.store.executions_changed_since(self.since - OVERLAP):
            if record.updated_at is not None and (newest is None or record.updated_at > newest):
                newest = record.updated_at
            for event in events_of(record):
                for receiver in self.receivers:
                    claim = self.store.claim_notification(record.id, event, receiver.name)
                    if claim is not None:
                        self._queues[receiver.name].put((claim, event, record.id))
                        queued += 1
        if newest is not None and newest > self.since:
            self.since = newest
        return queued

    # --- delivery ------------------------------------------------------------------

    def _deliver(self, receiver: Receiver) -> None:
        inbox = self._queues[receiver.name]
        while not self._stop.is_set():
            try:
                claim, event, execution_id = inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.deliver(receiver, claim, event, execution_id)
            except Exception:
                log.exception("notifications: %s: unexpected error", receiver.name)

    def deliver(self, receiver: Receiver, claim: int, event: str, execution_id: int) -> str:
        """Send one claimed event, retrying with backoff; record and count its fate."""
        record = self.store.get_execution(execution_id)
        attempts, error = 0, None
        for attempt in range(self.retries + 1):
            # 1 s, 2 s, 4 s, ... (backoff_s doubled) before a retry; a stop cuts it short.
            if attempt and self._stop.wait(self.backoff_s * 2 ** (attempt - 1)):
                break
            attempts += 1
            try:
                self.sender(receiver, event, record)
            except Exception as exc:  # every failure of a receiver is retried alike
                error = _why(exc)
                log.warning(
                    "notification %s of execution #%d to %s: attempt %d failed: %s",
                    event,
                    execution_id,
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
        self.store.finish_notification(claim, outcome, attempts, error)
        if self.metrics is not None:
            self.metrics.notification_sent(receiver.name, outcome)
        if self.on_finished is not None:
            self.on_finished(receiver.name, event, execution_id)
        return outcome
