"""IncidentSink onto the runbook store: incidents survive the process and replicas see them.

One open incident per (alert, engine). An alert defined at two severities
(VllmPaddingHigh: warning and critical) is one incident: it carries the
highest severity active now, is firing once any of its severities fired,
and resolves when none is active any more. A pending incident whose
condition cleared within `for` never fired: it is discarded, not resolved
(Prometheus forgets it too).

A write the store refuses (database down) is kept in order and retried at
the next event or refresh, so an outage delays incidents instead of losing
them; the evaluation cycle never raises for it.

`refresh` (call it after each cycle) keeps last_seen and value of open
incidents current at most every `touch_every` seconds, and resolves
incidents nobody has seen for `stale_after` seconds: those a previous run
left open when it stopped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from vllm_runbook.rules.incidents import IncidentEvent, OpenAlert, engine_name
from vllm_runbook.runbooks.store import Journal, StoreError

log = logging.getLogger(__name__)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
MAX_BACKLOG = 10_000


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class SqlIncidentSink:
    def __init__(
        self,
        store: Journal,
        *,
        touch_every: float = 30.0,
        stale_after: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.touch_every = touch_every
        self.stale_after = stale_after
        self.clock = clock
        # (alert, engine name) -> {severity: state} of what the evaluator holds open
        self._active: dict[tuple[str, str], dict[str, str]] = {}
        self._fired: set[tuple[str, str]] = set()
        self._backlog: deque[Callable[[], object]] = deque()
        self._last_touch = float("-inf")
        self._failing = False

    def record(self, event: IncidentEvent) -> None:
        key = (event.alert, engine_name(event.engine))
        severities = self._active.setdefault(key, {})
        if event.state in ("pending", "firing"):
            severities[event.severity] = event.state
            if event.state == "firing":
                self._fired.add(key)
        else:
            severities.pop(event.severity, None)
        if severities:
            self._write(self._upsert(key, severities, event))
        else:
            del self._active[key]
            if key in self._fired:
                self._fired.discard(key)
                self._write(self._resolve(key, event))
            else:
                self._write(lambda: self.store.discard_pending_incident(*key))
        self.flush()

    def refresh(self, open_alerts: Sequence[OpenAlert], now: float | None = None) -> None:
        """Bring last_seen/value of open incidents up to date; close stale ones."""
        now = self.clock() if now is None else now
        if now - self._last_touch < self.touch_every:
            self.flush()
            return
        self._last_touch = now
        latest: dict[tuple[str, str], OpenAlert] = {}
        for a in open_alerts:
            key = (a.alert, engine_name(a.engine))
            if key not in latest or a.last_seen > latest[key].last_seen:
                latest[key] = a
        seen = [(k[0], k[1], a.value, _dt(a.last_seen)) for k, a in latest.items()]
        self._write(lambda: self.store.touch_incidents(seen))
        cutoff, at = _dt(now - self.stale_after), _dt(now)
        self._write(lambda: self.store.resolve_stale_incidents(cutoff, at=at))
        self.flush()

    def flush(self) -> bool:
        """Apply queued writes in order; False (and they stay queued) while the store fails."""
        while self._backlog:
            try:
                self._backlog[0]()
            except StoreError as exc:
                if not self._failing:
                    log.warning(
                        "incident store failing, %d writes queued: %s", len(self._backlog), exc
                    )
                self._failing = True
                return False
            self._backlog.popleft()
        if self._failing:
            log.info("incident store works again")
            self._failing = False
        return True

    # -- writes -----------------------------------------------------------------
    def _write(self, op: Callable[[], object]) -> None:
        if len(self._backlog) >= MAX_BACKLOG:
            self._backlog.popleft()
            log.error("incident store backlog full: dropped the oldest write")
        self._backlog.append(op)

    def _upsert(
        self, key: tuple[str, str], severities: dict[str, str], event: IncidentEvent
    ) -> Callable[[], object]:
        firing = [s for s, st in severities.items() if st == "firing"]
        severity = max(firing or severities, key=lambda s: SEVERITY_RANK.get(s, -1))
        state = "firing" if key in self._fired else "pending"
        labels = {**event.labels, "severity": severity}
        return lambda: self.store.record_incident(
            key[0],
            key[1],
            state=state,
            severity=severity,
            value=event.value,
            first_seen=_dt(event.first_seen),
            last_seen=_dt(event.last_seen),
            labels=labels,
        )

    def _resolve(self, key: tuple[str, str], event: IncidentEvent) -> Callable[[], object]:
        return lambda: self.store.record_incident(
            key[0],
            key[1],
            state="resolved",
            severity=event.severity,
            value=event.value,
            first_seen=_dt(event.first_seen),
            last_seen=_dt(event.last_seen),
            resolved_at=_dt(event.at),
        )
