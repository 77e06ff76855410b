"""Who may read the journal over HTTP: anyone on loopback; off loopback only
the webhook's credentials or the read token."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from vllm_runbook.runbooks.service.serve_cli import build

from tests.service.test_service_webhooks import payload

WEBHOOK_TOKEN = "webhook-token-for-reads"
READ_TOKEN = "read-only-token"
READS = (
    "/api/executions",
    "/api/incidents",
    "/api/pending",
    "/api/engines",
    "/metrics",
    "/openapi.json",
)

CONFIG = """\
engines:
  - name: engine-a
    agent: http://127.0.0.1:9
    labels: {instance: "10.1.2.3:8000"}
automation:
  oom-pressure: auto
webhook:
  username: alertmanager
  password_file: PASSWORD
"""


def client_for(host: str, tmp_path: Path, sqlite_url: str) -> TestClient:
    """The app `runbook serve --host HOST` would serve (nothing is bound)."""
    password = tmp_path / "password"
    password.write_text("basic-password\n")
    config = tmp_path / "runbook.yaml"
    config.write_text(CONFIG.replace("PASSWORD", str(password)))
    service = build(str(config), sqlite_url, host, worker=False, rules=False)
    return TestClient(service.app, base_url="http://127.0.0.1")


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def with_read_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBOOK_READ_TOKEN", READ_TOKEN)
    monkeypatch.delenv("RUNBOOK_WEBHOOK_TOKEN", raising=False)


def _deliver(client: TestClient) -> None:
    r = client.post(
        "/webhooks/alertmanager", json=payload(), headers=basic("alertmanager", "basic-password")
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_on_loopback_reads_need_no_credentials(
    host: str, tmp_path: Path, sqlite_url: str, with_read_token: None
) -> None:
    client = client_for(host, tmp_path, sqlite_url)
    _deliver(client)
    rows = client.get("/api/executions").json()
    assert [(r["runbook"], r["engine"]) for r in rows] == [("oom-pressure", "http://127.0.0.1:9")]
    assert client.get("/api/incidents").status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "runbook.example"])
def test_off_loopback_reads_need_the_webhook_credentials_or_the_read_token(
    host: str, tmp_path: Path, sqlite_url: str, with_read_token: None
) -> None:
    client = client_for(host, tmp_path, sqlite_url)
    _deliver(client)
    refused = [
        {},
        {"Authorization": "Bearer wrong"},
        basic("alertmanager", "wrong"),
        {"Authorization": f"Basic {READ_TOKEN}"},
        {"Authorization": READ_TOKEN},
    ]
    for path in READS:
        for headers in refused:
            r = client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json() == {"error": "unauthorized"}  # nothing of the journal
            assert r.headers["www-authenticate"].startswith("Bearer")
        for headers in (
            basic("alertmanager", "basic-password"),
            {"Authorization": f"Bearer {READ_TOKEN}"},
        ):
            assert client.get(path, headers=headers).status_code == 200, (path, headers)
    rows = client.get("/api/executions", headers={"Authorization": f"Bearer {READ_TOKEN}"}).json()
    assert [r["runbook"] for r in rows] == ["oom-pressure"]
    # The read token reads; it does not post webhooks.
    r = client.post(
        "/webhooks/alertmanager", json=payload(), headers={"Authorization": f"Bearer {READ_TOKEN}"}
    )
    assert r.status_code == 401
    assert client.get("/healthz").status_code == 200  # liveness stays open for probes


def test_off_loopback_without_a_read_token_only_the_webhook_credentials_read(
    tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNBOOK_READ_TOKEN", raising=False)
    monkeypatch.setenv("RUNBOOK_WEBHOOK_TOKEN", WEBHOOK_TOKEN)
    config = tmp_path / "runbook.yaml"
    config.write_text(CONFIG.split("webhook:")[0])
    service = build(str(config), sqlite_url, "0.0.0.0", worker=False, rules=False)
    client = TestClient(service.app, base_url="http://127.0.0.1")
    for path in READS:
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer "}).status_code == 401
        ok = client.get(path, headers={"Authorization": f"Bearer {WEBHOOK_TOKEN}"})
        assert ok.status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
def test_the_schema_and_the_metrics_follow_the_reads_and_no_swagger_ui_is_served(
    host: str, tmp_path: Path, sqlite_url: str, with_read_token: None
) -> None:
    client = client_for(host, tmp_path, sqlite_url)
    reader = {"Authorization": f"Bearer {READ_TOKEN}"}
    open_reads = host == "127.0.0.1"
    for path in ("/metrics", "/openapi.json"):
        r = client.get(path)
        assert r.status_code == (200 if open_reads else 401), path
        assert client.get(path, headers=reader).status_code == 200
    metrics = client.get("/metrics", headers=reader).text
    assert "vllm_runbook_service_webhooks_received_total" in metrics
    schema = client.get("/openapi.json", headers=reader).json()
    assert {"/api/pending", "/api/executions/{execution_id}/approve"} <= set(schema["paths"])
    assert "/openapi.json" not in schema["paths"]
    # Swagger UI and ReDoc would load a CDN's script into the service's origin: none.
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert client.get(path, headers=reader).status_code == 404, path
