"""Alertmanager deliveries → durable events → at most one execution per episode.

Contract (DESIGN.md): authenticate, validate, store durably, then answer 2xx;
4xx for a malformed payload (nothing stored); 5xx when the store is down so
Alertmanager retries. Delivery is at least once and HA peers send duplicates:
an execution is keyed by (runbook, engine, fingerprint, startsAt) in the
database, so any number of deliveries, on any number of replicas, creates one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import update

from rules.config import Automation, EngineConfig
from runbooks.client import normalize_url
from runbooks.service.alertmanager import Alert, WebhookPayload
from runbooks.store import Store
from runbooks.store.models import WebhookEvent

log = logging.getLogger("vllm_runbook.service")


@dataclass(frozen=True)
class Router:
    """Alert → runbook (its `runbook` label, else the rule catalog's) and
    alert → engine (the inventory entry whose labels the alert carries, or
    whose name is the alert's `instance`)."""

    engines: tuple[EngineConfig, ...]
    automation: Automation
    alert_runbooks: Mapping[str, str | None] = field(default_factory=dict)
    known_runbooks: frozenset[str] = frozenset()

    def runbook(self, alert: Alert) -> str | None:
        name = alert.labels.get("runbook") or self.alert_runbooks.get(alert.alertname)
        return name if name in self.known_runbooks else None

    def engine(self, alert: Alert) -> EngineConfig | None:
        for engine in self.engines:
            if engine.labels and all(alert.labels.get(k) == v for k, v in engine.labels.items()):
                return engine
        instance = alert.labels.get("instance")
        return next((e for e in self.engines if e.name == instance), None)


@dataclass
class Outcome:
    event_id: int
    executions: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    resolved: list[dict[str, str]] = field(default_factory=list)  # episodes to revert

    def as_dict(self) -> dict[str, Any]:
        return {"event": self.event_id, "executions": self.executions, "skipped": self.skipped}


def ingest(store: Store, router: Router, payload: WebhookPayload, raw: dict[str, Any]) -> Outcome:
    """Store the delivery, then turn its firing alerts into pending executions.

    Raises StoreUnavailable (→ 503) before or after the event is stored; a
    retry re-runs this idempotently.
    """
    with store.session(write=True) as s:
        event = WebhookEvent(group_key=payload.groupKey, status=payload.status, payload=raw)
        s.add(event)
        s.flush()
        outcome = Outcome(event.id)
    for alert in payload.alerts:
        _route(store, router, alert, outcome)
    with store.session(write=True) as s:
        s.execute(
            update(WebhookEvent).where(WebhookEvent.id == outcome.event_id).values(processed=True)
        )
    return outcome


def _route(store: Store, router: Router, alert: Alert, outcome: Outcome) -> None:
    def skip(reason: str) -> None:
        outcome.skipped.append(
            {"alert": alert.alertname, "fingerprint": alert.fingerprint, "reason": reason}
        )

    runbook = router.runbook(alert)
    if runbook is None:
        return skip("no runbook for this alert")
    engine = router.engine(alert)
    if engine is None:
        return skip("no engine in the inventory matches the alert's labels")
    if alert.status == "resolved":
        outcome.resolved.append(
            {
                "runbook": runbook,
                "engine": normalize_url(engine.agent),
                "fingerprint": alert.fingerprint,
                "startsAt": alert.startsAt.isoformat(),
            }
        )
        return skip("resolved")
    mode = router.automation.mode(runbook)
    if mode == "notify":
        log.warning(
            "alert %s on %s: runbook %s not automated (notify)",
            alert.alertname,
            engine.name,
            runbook,
        )
        return skip("automation: notify")
    record, created = store.create_execution(
        runbook,
        # Executions are keyed by the agent URL, as `runbook exec` keys them.
        normalize_url(engine.agent),
        trigger="alert",
        who=f"alertmanager:{alert.alertname}",
        alert_fingerprint=alert.fingerprint,
        alert_starts_at=alert.startsAt,
        reason="awaiting approval" if mode == "approve" else None,
    )
    outcome.executions.append(
        {
            "id": record.id,
            "runbook": runbook,
            "engine": record.engine,
            "created": created,
            "mode": mode,
        }
    )
