"""The Alertmanager webhook: auth, validation, durability, exactly-once."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from vllm_runbook.runbooks.demo.servers import free_port
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog
from vllm_runbook.runbooks.service.app import Credentials, create_app
from vllm_runbook.runbooks.service.webhooks import Router
from vllm_runbook.runbooks.store import Journal, upgrade
from vllm_runbook.runbooks.store.models import Execution, WebhookEvent

from tests.service.processes import RunbookServe

TOKEN = "test-webhook-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

CONFIG = """\
engines:
  - name: engine-a
    agent: http://127.0.0.1:9
    labels: {instance: "10.1.2.3:8000"}
automation:
  oom-pressure: auto
  latency-spike: approve
"""


def payload(
    alertname: str = "VllmOOMPressure",
    runbook: str = "oom-pressure",
    status: str = "firing",
    fingerprint: str = "4f2c0a1b9e",
) -> dict[str, Any]:
    labels = {
        "alertname": alertname,
        "instance": "10.1.2.3:8000",
        "model_name": "m",
        "engine": "0",
        "severity": "critical",
        "runbook": runbook,
    }
    return {
        "version": "4",
        "groupKey": "{}:{alertname=" + json.dumps(alertname) + "}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "vllm-runbook",
        "groupLabels": {"alertname": alertname},
        "commonLabels": labels,
        "commonAnnotations": {"summary": "KV cache full"},
        "externalURL": "http://127.0.0.1:9093",
        "futureField": {"ignored": True},
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": {"summary": "KV cache full"},
                "startsAt": "2026-11-29T10:00:00.000Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://127.0.0.1:9090/graph",
                "fingerprint": fingerprint,
            }
        ],
    }


def counts(url: str) -> tuple[int, int]:
    store = Journal(url)
    try:
        with store.session() as s:
            events = s.scalar(select(func.count()).select_from(WebhookEvent)) or 0
            execs = s.scalar(select(func.count()).select_from(Execution)) or 0
        return events, execs
    finally:
        store.close()


def make_client(url: str, tmp_path: Path) -> TestClient:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    config = load_config(cfg)
    router = Router(
        config.engines,
        config.automation,
        {r.alert: r.runbook for r in config.load_rules()},
        frozenset(load_runbook_catalog()),
    )
    return TestClient(
        create_app(Journal(url), router, Credentials(token=TOKEN)), base_url="http://127.0.0.1"
    )


def test_firing_alert_creates_one_pending_execution(sqlite_url: str, tmp_path: Path) -> None:
    client = make_client(sqlite_url, tmp_path)
    r = client.post("/webhooks/alertmanager", json=payload(), headers=AUTH)
    assert r.status_code == 200, r.text
    [execution] = r.json()["executions"]
    assert execution == {
        "id": execution["id"],
        "runbook": "oom-pressure",
        "engine": "http://127.0.0.1:9",
        "created": True,
        "mode": "auto",
    }
    again = client.post("/webhooks/alertmanager", json=payload(), headers=AUTH).json()
    assert again["executions"][0]["created"] is False  # a redelivery: same episode
    assert counts(sqlite_url) == (2, 1)  # both deliveries stored, one execution
    row = client.get("/api/executions").json()[0]
    assert row["status"] == "pending" and row["trigger"] == "alert"
    assert row["alert_fingerprint"] == "4f2c0a1b9e"


def test_routing_notify_approve_and_unknown(sqlite_url: str, tmp_path: Path) -> None:
    client = make_client(sqlite_url, tmp_path)
    body = payload("VllmLatencySpike", "latency-spike")
    [ex] = client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()["executions"]
    assert ex["mode"] == "approve"
    body = payload("VllmKVCacheHitRatioLow", "kv-hit-low")  # automation default: notify
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()
    assert r["executions"] == [] and r["skipped"][0]["reason"] == "automation: notify"
    body = payload()
    body["alerts"][0]["labels"]["instance"] = "elsewhere:1"
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()
    reason = (
        "no engine in the inventory matches the alert's labels (instance=elsewhere:1, engine=0)"
    )
    assert r["skipped"][0]["reason"] == reason
    # Nothing runs; the journal says why (a refused execution on no engine).
    [refused] = r["executions"]
    assert (refused["engine"], refused["mode"]) == ("unresolved", "refused")
    assert refused["created"] is True
    row = client.get("/api/executions").json()[0]
    assert (row["id"], row["status"], row["reason"]) == (refused["id"], "refused", reason)
    body = payload(status="resolved")
    assert (
        client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()["skipped"][0][
            "reason"
        ]
        == "resolved"
    )
    assert counts(sqlite_url) == (4, 2)


def test_discovered_engines_one_match_runs_several_refused(sqlite_url: str, tmp_path: Path) -> None:
    """Two discovered DP ranks of one pod: the alert's `engine` label picks one;
    without it the alert names two engines: refused, the answer and the journal say so."""
    from vllm_runbook.rules.config import EngineConfig
    from vllm_runbook.runbooks.service.discovery import FILE_SD, Inventory

    config = load_config(None)
    inventory = Inventory()
    pod = {"namespace": "llm", "instance": "10.1.2.3:8000"}
    inventory.update(
        FILE_SD,
        [
            EngineConfig(
                name="p-dp0", agent="http://10.1.2.3:9360", labels={**pod, "dp_rank": "0"}
            ),
            EngineConfig(
                name="p-dp1", agent="http://10.1.2.3:9361", labels={**pod, "dp_rank": "1"}
            ),
        ],
    )
    router = Router(
        config.engines,
        load_config_text(tmp_path).automation,
        {},
        frozenset(load_runbook_catalog()),
        inventory=inventory,
    )
    client = TestClient(
        create_app(Journal(sqlite_url), router, Credentials(token=TOKEN)),
        base_url="http://127.0.0.1",
    )
    [ran] = client.post("/webhooks/alertmanager", json=payload(), headers=AUTH).json()["executions"]
    assert (ran["engine"], ran["mode"]) == ("http://10.1.2.3:9360", "auto")  # engine="0"
    body = payload(fingerprint="77aa")
    del body["alerts"][0]["labels"]["engine"]
    answer = client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()
    reason = "2 engines match the alert's labels (p-dp0, p-dp1): ambiguous, nothing runs"
    assert answer["skipped"] == [
        {"alert": "VllmOOMPressure", "fingerprint": "77aa", "reason": reason}
    ]
    [refused] = answer["executions"]
    assert (refused["engine"], refused["mode"]) == ("unresolved", "refused")
    rows = {r["id"]: r for r in client.get("/api/executions").json()}
    assert (rows[refused["id"]]["status"], rows[refused["id"]]["reason"]) == ("refused", reason)
    assert rows[ran["id"]]["status"] == "pending"
    assert [e["name"] for e in client.get("/api/engines").json()] == ["p-dp0", "p-dp1"]


def load_config_text(tmp_path: Path) -> Any:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    return load_config(cfg)


def test_unauthenticated_requests_store_nothing(sqlite_url: str, tmp_path: Path) -> None:
    client = make_client(sqlite_url, tmp_path)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dTpw"}):
        r = client.post("/webhooks/alertmanager", json=payload(), headers=headers)
        assert r.status_code == 401
    assert counts(sqlite_url) == (0, 0)


def test_basic_auth_as_alertmanager_sends_it(sqlite_url: str) -> None:
    creds = Credentials(username="am", password="pw")
    import base64

    ok = "Basic " + base64.b64encode(b"am:pw").decode()
    bad = "Basic " + base64.b64encode(b"am:nope").decode()
    assert creds.check(ok) and not creds.check(bad) and not creds.check("Bearer pw")


@pytest.mark.parametrize(
    ("mutate", "status"),
    [
        (lambda p: p.update(version="3"), 422),
        (lambda p: p.pop("alerts"), 422),
        (lambda p: p["alerts"][0].pop("fingerprint"), 422),
        (lambda p: p["alerts"][0].update(startsAt="yesterday"), 422),
        (lambda p: p["alerts"][0].update(startsAt="2026-11-29T10:00:00"), 422),  # no zone
        # Not RFC 3339: pydantic alone would read these as Unix times or midnight.
        (lambda p: p["alerts"][0].update(startsAt=1764410400), 422),
        (lambda p: p["alerts"][0].update(startsAt=1764410400.5), 422),
        (lambda p: p["alerts"][0].update(startsAt="1764410400"), 422),
        (lambda p: p["alerts"][0].update(startsAt="2026-11-29"), 422),
        (lambda p: p["alerts"][0].update(startsAt="2026-11-29 10:00:00Z"), 422),
        (lambda p: p["alerts"][0].update(status="exploded"), 422),
        (lambda p: p["alerts"][0]["labels"].update(x=1), 422),
    ],
)
def test_malformed_payloads_are_4xx_and_store_nothing(
    sqlite_url: str, tmp_path: Path, mutate: Any, status: int
) -> None:
    client = make_client(sqlite_url, tmp_path)
    body = payload()
    mutate(body)
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert counts(sqlite_url) == (0, 0)
    r = client.post("/webhooks/alertmanager", content=b"{nope", headers=AUTH)
    assert r.status_code == 400
    raw = json.dumps(payload()).replace('"truncatedAlerts": 0', '"truncatedAlerts": Infinity')
    r = client.post("/webhooks/alertmanager", content=raw.encode(), headers=AUTH)
    assert r.status_code == 400 and "Infinity" in r.json()["error"]


def alert(fingerprint: str, starts_at: str, status: str = "firing") -> dict[str, Any]:
    [one] = payload(status=status, fingerprint=fingerprint)["alerts"]
    return {**one, "startsAt": starts_at}


def rejected_metric(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('vllm_runbook_service_alerts_rejected_total{reason="starts_at_out'):
            return float(line.split()[-1])
    raise AssertionError("no alerts_rejected_total series")


# Well-formed RFC 3339 times outside years 1-9999 once in UTC: Python cannot
# convert them, no database column holds them.
@pytest.mark.parametrize("starts_at", ["0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00"])
def test_an_alert_whose_time_the_journal_cannot_hold_is_rejected_alone(
    db_url: str, tmp_path: Path, starts_at: str
) -> None:
    client = make_client(db_url, tmp_path)
    body = payload()
    body["alerts"] = [
        alert("good-1", "2026-11-29T10:00:00Z"),
        alert("poison", starts_at),
        alert("poison-resolved", starts_at, status="resolved"),
        alert("good-2", "2026-11-29T10:05:00Z"),
    ]
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    answer = r.json()
    reason = f"startsAt {starts_at} is outside years 1-9999 in UTC"
    assert answer["rejected"] == [
        {"alert": "VllmOOMPressure", "fingerprint": "poison", "reason": reason},
        {"alert": "VllmOOMPressure", "fingerprint": "poison-resolved", "reason": reason},
    ]
    assert [e["created"] for e in answer["executions"]] == [True, True]
    assert answer["skipped"] == []
    assert counts(db_url) == (1, 2)  # the delivery and its two good alerts
    store = Journal(db_url)
    fingerprints = sorted(str(e.alert_fingerprint) for e in store.list_executions())
    store.close()
    assert fingerprints == ["good-1", "good-2"]
    assert rejected_metric(client) == 2
    # Alertmanager's next delivery of the group is answered the same: no retry loop.
    again = client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert again.status_code == 200 and len(again.json()["rejected"]) == 2
    assert counts(db_url) == (2, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endsAt", "0001-01-01T00:00:00Z"),  # Alertmanager's zero time: "no end yet"
        ("endsAt", "0001-01-01T00:30:00+01:00"),
        ("endsAt", "9999-12-31T23:30:00-01:00"),
        ("endsAt", "2026-11-29T10:00:00"),  # naive: endsAt is only kept in the payload
        ("startsAt", "0001-01-01T00:00:00Z"),
        ("startsAt", "9999-12-31T23:59:59.999999Z"),
        ("startsAt", "2026-11-29T10:00:00.123456789123456789Z"),  # beyond microseconds
        ("startsAt", "2026-11-29T10:00:00.5+23:59"),
    ],
)
def test_edge_times_that_can_be_stored_are(
    db_url: str, tmp_path: Path, field: str, value: str
) -> None:
    client = make_client(db_url, tmp_path)
    body = payload(fingerprint="edge")
    body["alerts"][0][field] = value
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["rejected"] == [] and r.json()["executions"][0]["created"] is True
    assert counts(db_url) == (1, 1)
    [row] = client.get("/api/executions").json()
    starts = datetime.fromisoformat(body["alerts"][0]["startsAt"].replace("Z", "+00:00"))
    # The journal keeps startsAt in UTC, to the microsecond (Python's precision).
    assert datetime.fromisoformat(row["alert_starts_at"]) == starts


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    field=st.sampled_from(
        [
            "version",
            "status",
            "alerts",
            "groupKey",
            "commonLabels",
            "alerts.0",
            "alerts.0.labels",
            "alerts.0.startsAt",
            "alerts.0.fingerprint",
            "alerts.0.status",
        ]
    ),
    value=json_values,
)
def test_fuzzed_payloads_never_5xx_and_4xx_store_nothing(
    sqlite_url: str, tmp_path: Path, field: str, value: Any
) -> None:
    client = make_client(sqlite_url, tmp_path)
    body = copy.deepcopy(payload(fingerprint=f"fp{abs(hash(json.dumps(value, default=str)))}"))
    target: Any = body
    *path, last = field.split(".")
    for part in path:
        target = target[int(part)] if part.isdigit() else target[part]
    target[int(last) if last.isdigit() else last] = value
    before = counts(sqlite_url)
    r = client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert counts(sqlite_url) == before  # no partial rows
    else:
        assert counts(sqlite_url)[0] == before[0] + 1


# -- two real replicas on PostgreSQL, and the store going down --


class TcpProxy:
    """A loopback TCP proxy to PostgreSQL that the test can cut and restore."""

    def __init__(self, target_port: int = 5432) -> None:
        self.port = free_port()
        self.target = target_port
        self.up = threading.Event()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.2)
        self._conns: list[socket.socket] = []
        self._stop = False
        self.up.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        self.up.clear()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self._conns.clear()

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self._stop = True
        self.cut()
        self._server.close()


@contextlib.contextmanager
def replica(db_url: str, config: Path, port: int) -> Iterator[str]:
    """`runbook serve` on `db_url`, without the rules engine (its log beside `config`)."""
    log = config.parent / f"replica-{port}.log"
    with RunbookServe.run(config, log, "--db", db_url, "--no-rules", port=port,
                          env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN}) as served:  # fmt: skip
        yield served.url


@pytest.mark.service
def test_duplicate_deliveries_over_two_replicas_make_one_execution(
    fresh_pg_database: str, tmp_path: Path
) -> None:
    upgrade(fresh_pg_database)
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    with (
        replica(fresh_pg_database, cfg, free_port()) as a,
        replica(fresh_pg_database, cfg, free_port()) as b,
    ):
        body = payload(fingerprint="dup-1")

        def deliver(i: int) -> dict[str, Any]:
            r = httpx.post(
                (a, b)[i % 2] + "/webhooks/alertmanager", json=body, headers=AUTH, timeout=30
            )
            assert r.status_code == 200, r.text
            return dict(r.json())

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(deliver, range(20)))
    created = [ex["created"] for r in results for ex in r["executions"]]
    assert len(created) == 20 and created.count(True) == 1
    assert len({ex["id"] for r in results for ex in r["executions"]}) == 1
    assert counts(fresh_pg_database) == (20, 1)


@pytest.mark.service
def test_store_down_answers_503_and_the_retry_is_processed(
    fresh_pg_database: str, tmp_path: Path
) -> None:
    upgrade(fresh_pg_database)
    proxy = TcpProxy()
    proxied = fresh_pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    try:
        with replica(proxied, cfg, free_port()) as url:
            proxy.cut()
            r = httpx.post(
                url + "/webhooks/alertmanager",
                json=payload(fingerprint="down-1"),
                headers=AUTH,
                timeout=30,
            )
            assert r.status_code == 503, r.text
            assert counts(fresh_pg_database) == (0, 0)
            proxy.restore()
            r = httpx.post(
                url + "/webhooks/alertmanager",
                json=payload(fingerprint="down-1"),
                headers=AUTH,
                timeout=30,
            )  # Alertmanager's retry
            assert r.status_code == 200, r.text
            assert r.json()["executions"][0]["created"] is True
        assert counts(fresh_pg_database) == (1, 1)
    finally:
        proxy.close()
