"""An answered delivery is durable: when the store cannot keep what it is given,
`runbook serve` answers 503 (Alertmanager retries) and /healthz says so.

SQLite: the database file removed or replaced under a running service (its
connections would go on writing into the old, unlinked file). PostgreSQL: a
database that answers reads but takes no writes."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from vllm_runbook.runbooks.store import Journal, upgrade

from tests.journal.conftest import PG_SERVER
from tests.service.processes import RunbookServe
from tests.service.test_service_webhooks import (
    AUTH,
    CONFIG,
    TOKEN,
    counts,
    make_client,
    payload,
)

ENV = {"RUNBOOK_WEBHOOK_TOKEN": TOKEN}


def deliver(url: str, fingerprint: str) -> httpx.Response:
    return httpx.post(
        url + "/webhooks/alertmanager",
        json=payload(fingerprint=fingerprint),
        headers=AUTH,
        timeout=30,
    )


def fingerprints(db_url: str) -> list[str]:
    store = Journal(db_url)
    try:
        return sorted(str(e.alert_fingerprint) for e in store.list_executions())
    finally:
        store.close()


def serve(tmp_path: Path, db_url: str, name: str) -> Any:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    return RunbookServe.run(cfg, tmp_path / f"{name}.log", "--db", db_url, "--no-rules", env=ENV)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_sqlite_file_removed_or_replaced_under_the_service_answers_503(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "runbook.db"
    url = f"sqlite:///{path}"
    other = tmp_path / "other.db"  # what an operator moves over it (a restore, say)
    upgrade(f"sqlite:///{other}")
    with contextlib.closing(Journal(f"sqlite:///{other}")) as restored:
        restored.create_execution("warmup", "http://elsewhere:1", trigger="cli", who="restore")
    with serve(tmp_path, url, "first") as served:
        r = deliver(served.url, "before")  # in the file that is about to go
        assert r.status_code == 200, r.text
        if how == "removed":
            path.unlink()
        else:
            os.replace(other, path)
        for i in range(3):
            r = deliver(served.url, f"after-{i}")
            assert r.status_code == 503, r.text  # Alertmanager retries
            assert r.json() == {"error": "store unavailable; retry later"}
        health = httpx.get(served.url + "/healthz", timeout=10)
        assert health.status_code == 503
        assert f"its file {path} was {how}" in health.json()["error"]
        reads = httpx.get(served.url + "/api/executions", timeout=10)
        assert reads.status_code == 503  # not the old file's journal, as if current
    assert path.exists() == (how == "replaced")  # nothing made a new, empty one there
    # A restart reads the file now at the path. No delivery was answered 200
    # since the change, and Alertmanager's retry is stored there.
    with serve(tmp_path, url, "second") as served:
        assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200
        assert deliver(served.url, "after-0").status_code == 200
    kept = ["after-0"] if how == "removed" else ["None", "after-0"]  # None: the restored run
    assert fingerprints(url) == kept


def test_healthz_says_whether_the_store_takes_writes_sqlite(
    sqlite_url: str, tmp_path: Path
) -> None:
    client = make_client(sqlite_url, tmp_path)
    assert client.get("/healthz").json() == {"status": "ok"}
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    shutil.copy(path, tmp_path / "elsewhere.db")
    path.unlink()
    r = client.get("/healthz")
    assert r.status_code == 503 and "was removed after this process opened it" in r.text
    r = client.post("/webhooks/alertmanager", json=payload(), headers=AUTH)
    assert r.status_code == 503
    assert not path.exists()  # nothing created a new, empty database there


@pytest.mark.service
def test_healthz_and_webhooks_on_a_postgresql_that_takes_no_writes(
    fresh_pg_database: str, tmp_path: Path
) -> None:
    upgrade(fresh_pg_database)
    name = fresh_pg_database.rsplit("/", 1)[1]
    admin = create_engine(f"{PG_SERVER}/test", isolation_level="AUTOCOMMIT")

    def read_only(on: bool) -> None:
        with admin.connect() as conn:
            value = "on" if on else "off"
            conn.execute(
                text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {value}')
            )
            # Sessions take the setting when they start: end the service's.
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )

    try:
        with serve(tmp_path, fresh_pg_database, "pg") as served:
            assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200
            read_only(True)
            health = httpx.get(served.url + "/healthz", timeout=10)
            assert health.status_code == 503, health.text
            assert "read-only transaction" in health.json()["error"]
            assert httpx.get(served.url + "/api/executions", timeout=10).status_code == 200
            r = deliver(served.url, "ro-1")
            assert r.status_code == 503, r.text
            assert counts(fresh_pg_database) == (0, 0)
            read_only(False)
            assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200
            assert deliver(served.url, "ro-1").status_code == 200  # Alertmanager's retry
        assert counts(fresh_pg_database) == (1, 1)
    finally:
        read_only(False)
        admin.dispose()
