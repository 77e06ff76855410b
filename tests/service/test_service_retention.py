"""Stored Alertmanager deliveries are kept for `retention.max_age` and up to
`retention.max_size` in total, newest first; the service prunes the rest with a
job on its scheduler. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import select
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import WebhookEvent

from tests.service.processes import RunbookServe
from tests.service.test_service_webhooks import AUTH, CONFIG, TOKEN, payload

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def add_events(store: Journal, rows: list[tuple[datetime, int]]) -> list[int]:
    """Deliveries received at each time, of each size (bytes); their ids."""
    with store.session(write=True) as s:
        events = [
            WebhookEvent(
                group_key="{}",
                status="firing",
                payload={"n": i},
                processed=True,
                received_at=at,
                payload_bytes=size,
            )
            for i, (at, size) in enumerate(rows)
        ]
        s.add_all(events)
        s.flush()
        return [e.id for e in events]


def kept(store: Journal) -> list[int]:
    with store.session() as s:
        return list(s.scalars(select(WebhookEvent.id).order_by(WebhookEvent.id)))


def test_prune_by_age_then_by_size(db_url: str) -> None:
    store = Journal(db_url)
    minutes = [-120, -90, -61, -59, -30, -10, 0]
    ids = add_events(store, [(T0 + timedelta(minutes=m), 100) for m in minutes])
    assert store.webhook_events_size() == (7, 700)
    # Older than an hour at T0: the first three.
    pruned = store.prune_webhook_events(max_age_s=3600, max_bytes=None, now=T0, batch=2)
    assert (pruned.by_age, pruned.by_size) == (3, 0)
    assert kept(store) == ids[3:]
    # 250 bytes hold the two newest of 100 bytes each.
    pruned = store.prune_webhook_events(max_age_s=3600, max_bytes=250, now=T0, batch=2)
    assert (pruned.by_age, pruned.by_size) == (0, 2)
    assert kept(store) == ids[5:]
    assert store.webhook_events_size() == (2, 200)
    # Exactly full: nothing to do.
    assert store.prune_webhook_events(max_age_s=None, max_bytes=200).total == 0
    assert kept(store) == ids[5:]
    store.close()


def test_prune_by_size_counts_newest_first_and_breaks_ties_by_id(db_url: str) -> None:
    store = Journal(db_url)
    # Three received in the same microsecond: the later id is the newer one.
    same = T0 - timedelta(seconds=5)
    ids = add_events(store, [(same, 40), (same, 30), (same, 20), (T0, 50)])
    pruned = store.prune_webhook_events(max_age_s=None, max_bytes=70)
    assert (pruned.by_age, pruned.by_size) == (0, 2)  # 50 + 20 = 70 fits, + 30 does not
    assert kept(store) == ids[2:]
    # A delivery larger than the cap is not kept either.
    assert store.prune_webhook_events(max_age_s=None, max_bytes=49).by_size == 2
    assert kept(store) == []
    store.close()


def body(fingerprint: str) -> bytes:
    """A delivery of exactly 2000 bytes."""
    doc = payload(fingerprint=fingerprint)
    doc["commonAnnotations"]["pad"] = ""
    raw = json.dumps(doc).encode()
    doc["commonAnnotations"]["pad"] = "x" * (2000 - len(raw))
    raw = json.dumps(doc).encode()
    assert len(raw) == 2000
    return raw


def pruned_metric(url: str, limit: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = f'vllm_runbook_service_webhook_events_pruned_total{{limit="{limit}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_the_service_prunes_stored_deliveries_on_its_schedule(db_url: str, tmp_path: Path) -> None:
    store = Journal(db_url)
    # Left from a week ago (default max_age 7d): pruned by the run at start.
    add_events(store, [(datetime.now(UTC) - timedelta(days=8), 500)] * 2)
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG + "retention:\n  max_size: 6000\n  interval: 1s\n")
    env = {"RUNBOOK_WEBHOOK_TOKEN": TOKEN}
    with RunbookServe.run(
        cfg, tmp_path / "serve.log", "--db", db_url, "--no-rules", env=env
    ) as served:
        deadline = time.monotonic() + 30
        while kept(store):
            assert time.monotonic() < deadline, "the deliveries of a week ago are still there"
            time.sleep(0.2)
        headers = {**AUTH, "Content-Type": "application/json"}
        events = []
        for i in range(5):
            r = httpx.post(
                served.url + "/webhooks/alertmanager",
                content=body(f"fp-{i}"),
                headers=headers,
                timeout=30,
            )
            assert r.status_code == 200, r.text
            events.append(r.json()["event"])
        # 6000 bytes hold the three newest deliveries of 2000 bytes.
        deadline = time.monotonic() + 30
        while kept(store) != events[2:]:
            assert time.monotonic() < deadline, kept(store)
            time.sleep(0.2)
        assert store.webhook_events_size() == (3, 6000)
        assert pruned_metric(served.url, "max_age") == 2
        assert pruned_metric(served.url, "max_size") == 2
    log = (tmp_path / "serve.log").read_text()
    assert "retention: deleted 2 stored deliveries (2 older than 604800 s, 0 beyond 6000" in log
    store.close()
