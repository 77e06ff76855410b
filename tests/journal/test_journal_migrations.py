"""Alembic: `upgrade head` then `check` (no model drift), on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect
from vllm_runbook.runbooks.store import (
    Journal,
    StoreError,
    current_revision,
    head_revision,
    upgrade,
)
from vllm_runbook.runbooks.store.schema import alembic_config

from alembic import command

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "alembic_version",
    "executions",
    "steps",
    "incidents",
    "webhook_events",
    "leases",
    "notifications",
    "execution_events",
    "notification_cursors",
}


def alembic(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The developer path: `alembic -c alembic.ini ...` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "RUNBOOK_DB_URL": url},
        timeout=120,
    )


def check_upgrade_then_check(url: str) -> None:
    up = alembic(url, "upgrade", "head")
    assert up.returncode == 0, up.stderr
    check = alembic(url, "check")
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected." in check.stdout + check.stderr
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    assert set(inspect(engine).get_table_names()) == TABLES
    engine.dispose()


def test_alembic_upgrade_and_check_sqlite(tmp_path: Path) -> None:
    check_upgrade_then_check(f"sqlite:///{tmp_path}/a.db")


@pytest.mark.service
def test_alembic_upgrade_and_check_postgres(fresh_pg_database: str) -> None:
    check_upgrade_then_check(fresh_pg_database)


def test_programmatic_upgrade_is_idempotent_and_reversible(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/p.db"
    assert current_revision(url) is None
    head = head_revision()
    assert head == "0005"
    assert upgrade(url) == head
    assert upgrade(url) == head  # second start of the service: nothing to do
    Journal(url).create_execution("warmup", "e", trigger="cli", who="me")
    command.downgrade(alembic_config(url), "base")
    assert current_revision(url) is None
    assert upgrade(url) == head


@pytest.mark.service
def test_programmatic_upgrade_postgres_from_two_processes(fresh_pg_database: str) -> None:
    # Two replicas starting at once: the advisory lock serialises them.
    code = (
        "import sys; from vllm_runbook.runbooks.store import upgrade; print(upgrade(sys.argv[1]))"
    )
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, fresh_pg_database],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["0005", "0005"]


def test_upgrade_of_a_newer_database_is_a_clear_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/n.db"
    upgrade(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'ffff'")
    engine.dispose()
    with pytest.raises(StoreError, match="Can't locate revision identified by 'ffff'"):
        upgrade(url)


def test_migrations_located_without_the_repository(tmp_path: Path) -> None:
    # As from an installed package: another cwd, no alembic.ini anywhere near.
    code = (
        "import sys; from vllm_runbook.runbooks.store import upgrade; print(upgrade(sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{tmp_path}/i.db"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ),
        timeout=120,
    )
    assert (out.returncode, out.stdout) == (0, "0005\n"), out.stderr


def _upgrade_from_0002_with_an_outbox(url: str) -> None:
    """0002 → 0003 on a journal that notified: each event already in the
    outbox gets its event row and key (the new feed does not send it again);
    a row left queued by a replica that died is claimable."""
    upgrade(url, "0002")
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.exec_driver_sql(
            'INSERT INTO executions (id, runbook, engine, "trigger", who, dry_run, status, '
            "created_at, updated_at) VALUES (7, 'oom-pressure', 'e', 'cli', 'me', false, "
            "'succeeded', '2026-12-01 10:00:00', '2026-12-01 10:00:05')"
        )
        for i, (event, receiver, status) in enumerate(
            [
                ("started", "ops", "delivered"),
                ("started", "chat", "delivered"),
                ("succeeded", "ops", "queued"),
            ]
        ):
            conn.exec_driver_sql(
                "INSERT INTO notifications (execution_id, event, receiver, status, attempts, "
                f"created_at) VALUES (7, '{event}', '{receiver}', '{status}', {1 - i // 2}, "
                f"'2026-12-01 10:00:0{i}')"
            )
    assert upgrade(url) == "0005"
    store = Journal(url)
    events = store.events_of_execution(7)
    assert [e.event for e in events] == ["started", "succeeded"]
    keys = {e.event: e.key for e in events}
    rows = store.notifications([7])[7]
    assert [(n.event, n.receiver, n.status, n.event_key, n.claims) for n in rows] == [
        ("started", "ops", "delivered", keys["started"], 0),
        ("started", "chat", "delivered", keys["started"], 0),
        ("succeeded", "ops", "queued", keys["succeeded"], 0),
    ]
    [claim] = store.claim_notifications("ops", "replica-b", 30.0)
    assert (claim.execution_id, claim.event, claim.event_key) == (7, "succeeded", keys["succeeded"])
    # A later change of the execution derives nothing already recorded.
    store.transition(7, "reverted")
    assert [e.event for e in store.events_of_execution(7)] == ["started", "succeeded", "reverted"]
    store.close()
    engine.dispose()


def test_upgrade_from_0002_keeps_the_outbox_sqlite(tmp_path: Path) -> None:
    _upgrade_from_0002_with_an_outbox(f"sqlite:///{tmp_path}/o.db")


@pytest.mark.service
def test_upgrade_from_0002_keeps_the_outbox_postgres(fresh_pg_database: str) -> None:
    _upgrade_from_0002_with_an_outbox(fresh_pg_database)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.service)]
)
def test_0004_sizes_the_deliveries_stored_before(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'm.db'}"
        if backend == "sqlite"
        else str(request.getfixturevalue("fresh_pg_database"))
    )
    upgrade(url, "0002")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO webhook_events (received_at, group_key, status, payload, processed) "
            "VALUES ('2026-12-01 10:00:00', '{}', 'firing', '{\"alerts\": [\"é\"]}', true)"
        )
    assert upgrade(url) == "0005"
    with engine.connect() as conn:
        stored, size = conn.exec_driver_sql(
            "SELECT CAST(payload AS TEXT), payload_bytes FROM webhook_events"
        ).one()
    engine.dispose()
    assert size == len(stored.encode()) == len('{"alerts": ["é"]}'.encode())
    store = Journal(url)
    assert store.webhook_events_size() == (1, 18)
    assert store.prune_webhook_events(max_age_s=None, max_bytes=17).by_size == 1
    store.close()


def test_0005_adds_the_hold_in_place_and_its_downgrade_keeps_the_changes_as_succeeded(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    upgrade(url, "0004")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            'INSERT INTO executions (runbook, engine, "trigger", who, dry_run, status, '
            "created_at, updated_at) VALUES ('latency-spike', 'e', 'cli', 'me', false, "
            "'pending', '2026-12-01 10:00:00', '2026-12-01 10:00:00')"
        )
    engine.dispose()
    assert upgrade(url) == "0005"
    store = Journal(url)
    (record,) = store.list_executions()
    before = store.get_execution(record.id)
    assert (before.hold_since, before.hold_note, before.hold_for_person, before.premature) == (
        None,
        None,
        False,
        False,
    )
    store.transition(record.id, "running")
    store.transition(record.id, "succeeded")
    held = store.hold(record.id, "waiting")
    assert (held.status, held.display_status, held.hold_note) == ("succeeded", "holding", "waiting")
    assert held.hold_since is not None
    store.close()
    command.downgrade(alembic_config(url), "0004")
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT status FROM executions").scalar() == "succeeded"
    engine.dispose()
