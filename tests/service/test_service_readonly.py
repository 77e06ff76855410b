"""A SQLite file made read-only under a running `runbook serve` (docs/service.md,
"Health"): the service's open connections keep writing, so its deliveries are
stored and answered 200; the next start cannot write and answers 503 to
`/healthz` and to a delivery, storing nothing. Either way no 200 is answered
for a delivery that is not in the file.

Root overrides file permissions: the service runs under `setpriv` without
CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, as an ordinary service user would."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from vllm_runbook.runbooks.demo.servers import (
    free_port,
    logged_process,
    start_logged,
    stop_group,
)

from tests.engines import runbook_cli_command, runbook_cli_env
from tests.service.chromium import wait_until
from tests.service.test_service_webhooks import payload

pytestmark = pytest.mark.service

TOKEN = "readonly-webhook-token"
NO_OVERRIDE = ["--bounding-set", "-dac_override,-dac_read_search"]


def deliver(url: str, fingerprint: str) -> int:
    request = urllib.request.Request(
        url + "/webhooks/alertmanager",
        json.dumps(payload(fingerprint=fingerprint)).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None  # not listening yet


def stored(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT count(*) FROM webhook_events").fetchone()[0])


def test_a_file_made_read_only_under_the_service(sqlite_url: str, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv (to run the service without DAC override)")
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    (tmp_path / "webhook.token").write_text(TOKEN + "\n")
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "database": sqlite_url,
                "engines": [
                    {
                        "name": "cpu-0",
                        "agent": "http://127.0.0.1:9",
                        "labels": {"instance": "10.1.2.3:8000"},
                    }
                ],
                "automation": {"oom-pressure": "approve"},
                "webhook": {"token_file": str(tmp_path / "webhook.token")},
            }
        )
    )

    def command(port: int) -> list[str]:
        serve = runbook_cli_command("serve", "--config", str(cfg), "--port", str(port))
        return [setpriv, *NO_OVERRIDE, *serve, "--no-rules", "--no-worker"]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with logged_process(command(port), tmp_path / "serve.log", url + "/healthz", 90):
        assert deliver(url, "fp-before") == 200
        db.chmod(0o444)
        assert deliver(url, "fp-after") == 200
        assert health(url) == 200
    # What was answered 200 is in the file.
    assert stored(db) == 2

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_logged(command(port), tmp_path / "serve-again.log", runbook_cli_env())
    try:
        answer = wait_until("the restarted service answers", lambda: health(url), 90)
        assert answer == 503
        assert deliver(url, "fp-restarted") == 503
    finally:
        stop_group(proc, 45)
    assert stored(db) == 2
