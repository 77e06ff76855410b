"""Incidents: one open row per (alert, engine), written by the rules engine's
SQL sink, read by the CLI and the dashboards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import case, delete, select, update
from vllm_runbook.runbooks.store.base import StoreBase, iso
from vllm_runbook.runbooks.store.models import (
    INCIDENT_STATES,
    Incident,
    incident_open_key,
)


class IncidentStore(StoreBase):
    """Open, refresh, resolve and list incidents."""

    def record_incident(
        self,
        alert: str,
        engine: str,
        *,
        state: str,
        severity: str,
        value: float | None,
        first_seen: datetime,
        last_seen: datetime,
        labels: dict[str, str] | None = None,
        resolved_at: datetime | None = None,
    ) -> IncidentRecord | None:
        """Open, update or resolve the one open incident of (alert, engine).

        pending / firing: updates the open incident (its first_seen stays) or
        opens one, in one statement keyed on the open_key unique constraint,
        so two writers cannot open two; a firing incident is never set back
        to pending. resolved: closes the open incident
        (resolved_at defaults to last_seen); None when none was open.
        """
        if state not in INCIDENT_STATES:
            raise ValueError(f"incident state {state!r} not in {INCIDENT_STATES}")
        if state == "resolved":
            return self._resolve_incident(alert, engine, value, last_seen, resolved_at or last_seen)
        values = {
            "alert": alert,
            "engine": engine,
            "severity": severity,
            "state": state,
            "value": _finite(value),
            "first_seen": first_seen,
            "last_seen": last_seen,
            "labels": dict(labels or {}),
            "open_key": incident_open_key(alert, engine),
        }
        insert = self._insert()(Incident).values(**values)
        refreshed = {k: insert.excluded[k] for k in ("severity", "value", "last_seen", "labels")}
        # Once fired, an incident stays firing until resolved (a restarted
        # evaluator re-detects it as pending first).
        refreshed["state"] = case(
            (Incident.state == "firing", "firing"), else_=insert.excluded.state
        )
        stmt = insert.on_conflict_do_update(index_elements=["open_key"], set_=refreshed).returning(
            Incident
        )
        with self.session(write=True) as s:
            return IncidentRecord.from_row(s.scalars(stmt).one())

    def _resolve_incident(
        self, alert: str, engine: str, value: float | None, last_seen: datetime, at: datetime
    ) -> IncidentRecord | None:
        with self.session(write=True) as s:
            row = s.scalars(
                select(Incident)
                .where(Incident.open_key == incident_open_key(alert, engine))
                .with_for_update()
            ).first()
            if row is None:
                return None
            row.state, row.resolved_at = "resolved", at
            row.last_seen = max(row.last_seen, last_seen)
            if value is not None:
                row.value = _finite(value)
            s.flush()
            return IncidentRecord.from_row(row)

    def discard_pending_incident(self, alert: str, engine: str) -> bool:
        """Forget an open incident that never fired (its condition cleared within `for`)."""
        with self.session(write=True) as s:
            gone = s.execute(
                delete(Incident).where(
                    Incident.open_key == incident_open_key(alert, engine),
                    Incident.state == "pending",
                )
            )
            return gone.rowcount == 1  # type: ignore[attr-defined]

    def touch_incidents(self, seen: Sequence[tuple[str, str, float | None, datetime]]) -> int:
        """Refresh last_seen and value of open incidents: (alert, engine, value, last_seen)."""
        count = 0
        with self.session(write=True) as s:
            for alert, engine, value, last_seen in seen:
                done = s.execute(
                    update(Incident)
                    .where(Incident.open_key == incident_open_key(alert, engine))
                    .values(value=_finite(value), last_seen=last_seen)
                    .execution_options(synchronize_session=False)
                )
                count += done.rowcount  # type: ignore[attr-defined]
        return count

    def resolve_stale_incidents(
        self, last_seen_before: datetime, *, at: datetime
    ) -> list[IncidentRecord]:
        """Resolve open incidents nobody saw since `last_seen_before`.

        After a restart the evaluator has forgotten what was open; an
        incident whose condition cleared meanwhile is closed here instead of
        staying open forever. Pending ones that never fired are discarded.
        """
        if last_seen_before.tzinfo is None or at.tzinfo is None:
            raise ValueError("times must be timezone-aware")
        stale = Incident.open_key.is_not(None), Incident.last_seen < last_seen_before
        with self.session(write=True) as s:
            s.execute(delete(Incident).where(*stale, Incident.state == "pending"))
            rows = list(s.scalars(select(Incident).where(*stale).with_for_update()))
            for row in rows:
                row.state, row.resolved_at = "resolved", at
            s.flush()
            return [IncidentRecord.from_row(r) for r in rows]

    def list_incidents(
        self,
        *,
        open_only: bool = False,
        engine: str | None = None,
        alert: str | None = None,
        limit: int = 100,
    ) -> list[IncidentRecord]:
        """Newest first (by first_seen, then id)."""
        query = select(Incident)
        if open_only:
            query = query.where(Incident.open_key.is_not(None))
        if engine is not None:
            query = query.where(Incident.engine == engine)
        if alert is not None:
            query = query.where(Incident.alert == alert)
        query = query.order_by(Incident.first_seen.desc(), Incident.id.desc()).limit(limit)
        with self.session() as s:
            return [IncidentRecord.from_row(r) for r in s.scalars(query)]


def _finite(value: float | None) -> float | None:
    # NaN and ±Inf are not portable through JSON and some drivers: store NULL.
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class IncidentRecord:
    id: int
    alert: str
    engine: str
    severity: str
    state: str
    value: float | None
    first_seen: datetime
    last_seen: datetime
    resolved_at: datetime | None
    labels: dict[str, str]

    @property
    def open(self) -> bool:
        return self.state != "resolved"

    @classmethod
    def from_row(cls, row: Incident) -> IncidentRecord:
        return cls(
            id=row.id,
            alert=row.alert,
            engine=row.engine,
            severity=row.severity,
            state=row.state,
            value=row.value,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
            resolved_at=row.resolved_at,
            labels=dict(row.labels or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "alert": self.alert,
            "engine": self.engine,
            "severity": self.severity,
            "state": self.state,
            "value": self.value,
            "first_seen": iso(self.first_seen),
            "last_seen": iso(self.last_seen),
            "resolved_at": iso(self.resolved_at),
            "labels": self.labels,
        }
