"""The service's API as models (service/api.py): the OpenAPI document has a
schema for every /api route's answer, real answers validate against their
models and those schemas, and the models change nothing a client sees (the
journal's `to_dict` shapes, field for field and in order)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel
from vllm_runbook.rules.config import Automation, EngineConfig
from vllm_runbook.runbooks.service.api import (
    ApiError,
    Decision,
    Engines,
    EngineStates,
    Executions,
    Incidents,
    PendingApprovals,
    WhoAmI,
)
from vllm_runbook.runbooks.service.app import Credentials, create_app
from vllm_runbook.runbooks.service.webhooks import Router
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import ExecutionStatus

from tests.fake_agent import AgentHTTP, FakeAgent
from tests.service.test_service_webhooks import payload

TOKEN = "api-models-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APPROVE = "/api/executions/{execution_id}/approve"
REJECT = "/api/executions/{execution_id}/reject"
# Every /api route and the model of its 200 answer.
ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("get", "/api/executions"): Executions,
    ("get", "/api/incidents"): Incidents,
    ("get", "/api/pending"): PendingApprovals,
    ("get", "/api/engines"): Engines,
    ("get", "/api/engines/state"): EngineStates,
    ("get", "/api/whoami"): WhoAmI,
    ("post", APPROVE): Decision,
    ("post", REJECT): Decision,
}


@dataclass
class Served:
    app: FastAPI
    client: TestClient
    store: Journal
    router: Router
    agent: AgentHTTP


@pytest.fixture
def served(sqlite_url: str) -> Iterator[Served]:
    """A service over one in-memory agent (cpu-0) and one that is down (cpu-1);
    oom-pressure awaits approval."""
    agent = AgentHTTP(FakeAgent())
    engines = (
        EngineConfig.model_validate(
            {"name": "cpu-0", "agent": agent.url, "labels": {"instance": "10.1.2.3:8000"}}
        ),
        EngineConfig.model_validate({"name": "cpu-1", "agent": "http://127.0.0.1:9"}),
    )
    store = Journal(sqlite_url)
    router = Router(
        engines,
        Automation.model_validate({"oom-pressure": "approve"}),
        {},
        frozenset({"oom-pressure", "latency-spike"}),
    )
    app = create_app(
        store, router, Credentials(token=TOKEN, name="oncall"), engines=engines, engine_timeout_s=2
    )
    try:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            yield Served(app, client, store, router, agent)
    finally:
        agent.close()
        store.close()


def _journal(served: Served) -> tuple[int, int]:
    """Two executions awaiting approval (from webhooks), one that ran with its
    steps, checks and verification (as `runbook exec` records it), two incidents."""
    ids = []
    for alert, fingerprint in (("VllmOOMPressure", "4f2c0a1b9e"), ("VllmOOMPressure", "77aa")):
        answer = served.client.post(
            "/webhooks/alertmanager",
            json=payload(alert, "oom-pressure", fingerprint=fingerprint),
            headers=AUTH,
        )
        assert answer.status_code == 200, answer.text
        ids += [e["id"] for e in answer.json()["executions"]]
    store = served.store
    ran, _ = store.create_execution("batch-too-large", "cpu-0", trigger="cli", who="ann")
    store.transition(ran.id, ExecutionStatus.RUNNING)
    store.record_checks(ran.id, {"running": {"value": 21}, "p99_latency": {"value": None}})
    store.add_step(ran.id, "note", {"note": "nothing to read"}, status="skipped")
    step = store.add_step(ran.id, "set_knobs", {"max_num_seqs": 12}, before={"max_num_seqs": 32})
    store.finish_step(step.id, "applied", after={"max_num_seqs": 12}, applied_at_step=519)
    store.record_verification(
        ran.id, {"signal": "preemptions_per_minute", "before": 124.0, "after": 0.5, "outcome": "x"}
    )
    store.transition(ran.id, ExecutionStatus.SUCCEEDED)
    seen = datetime(2026, 12, 2, 10, 0, 0, 123456, tzinfo=UTC)
    store.record_incident(
        "VllmOOMPressure", "cpu-0", state="firing", severity="critical", value=0.987654,
        first_seen=seen, last_seen=seen, labels={"instance": "10.1.2.3:8000"},
    )  # fmt: skip
    store.record_incident(
        "VllmLatencySpike", "cpu-0", state="pending", severity="warning", value=None,
        first_seen=seen, last_seen=seen,
    )  # fmt: skip
    first, second = ids
    return first, second


def _schema(doc: dict[str, Any], method: str, path: str, status: str = "200") -> dict[str, Any]:
    response = doc["paths"][path][method]["responses"][status]
    return dict(response["content"]["application/json"]["schema"])


def _conforms(doc: dict[str, Any], body: Any, schema: dict[str, Any]) -> None:
    """`body` validates against `schema` of the OpenAPI document (its $refs resolved there)."""
    jsonschema.Draft202012Validator(
        {**schema, "components": doc["components"]}, format_checker=None
    ).validate(body)


def _same(body: Any, before: Any) -> None:
    """The same JSON, names, values and order of fields alike."""
    assert json.dumps(body) == json.dumps(before)


def test_the_openapi_document_has_a_schema_for_every_api_answer(served: Served) -> None:
    doc = served.client.get("/openapi.json").json()
    routes = {
        (method.lower(), route.path)
        for route in served.app.routes
        if isinstance(route, APIRoute) and route.path.startswith("/api/")
        for method in route.methods
    }
    assert routes == set(ANSWERS)  # a new /api route needs its model here
    assert {path for path in doc["paths"] if path.startswith("/api/")} == {p for _, p in ANSWERS}
    schemas = doc["components"]["schemas"]
    for (method, path), model in ANSWERS.items():
        assert _schema(doc, method, path) == {"$ref": f"#/components/schemas/{model.__name__}"}
        # The component is the model's own schema (its definitions inlined as components).
        own = model.model_json_schema(
            mode="serialization", ref_template="#/components/schemas/{model}"
        )
        own.pop("$defs", None)
        assert schemas[model.__name__] == own, model.__name__
    items = schemas["Executions"]["items"]
    assert items == {"$ref": "#/components/schemas/Execution"}
    assert schemas["Execution"]["properties"]["steps"]["items"] == {
        "$ref": "#/components/schemas/Step"
    }
    assert "state" in schemas["EngineState"]["properties"]  # the agent's AgentState
    assert "AgentState" in schemas
    # Refusals are documented with their shape.
    for path in (APPROVE, REJECT):
        for status in ("404", "409", "410"):
            assert _schema(doc, "post", path, status) == {"$ref": "#/components/schemas/ApiError"}
    assert _schema(doc, "get", "/api/executions", "401") == {
        "$ref": "#/components/schemas/ApiError"
    }


def test_real_answers_validate_against_their_models_and_keep_the_journals_json(
    served: Served,
) -> None:
    awaiting, other = _journal(served)
    client, store = served.client, served.store
    doc = client.get("/openapi.json").json()

    def answer(method: str, path: str, url: str | None = None, **kwargs: Any) -> Any:
        response = client.request(method.upper(), url or path, headers=AUTH, **kwargs)
        assert response.status_code == 200, (path, response.text)
        body = response.json()
        model = ANSWERS[(method, path)]
        parsed = model.model_validate(body)
        _same(parsed.model_dump(mode="json"), body)  # the model keeps every field
        _conforms(doc, body, _schema(doc, method, path))
        return body

    executions = answer("get", "/api/executions")
    _same(executions, [r.to_dict() for r in store.list_executions(limit=50)])
    [ran] = [e for e in Executions.model_validate(executions).root if e.trigger == "cli"]
    assert [(s.action, s.status) for s in ran.steps] == [
        ("note", "skipped"),
        ("set_knobs", "applied"),
    ]
    assert ran.steps[1].applied_at_step == 519 and ran.checks is not None
    assert (ran.verification or {})["outcome"] == "x"

    incidents = answer("get", "/api/incidents")
    _same(incidents, [r.to_dict() for r in store.list_incidents()])
    firing = answer("get", "/api/incidents", "/api/incidents?open_only=true")
    assert {i.alert for i in Incidents.model_validate(firing).root} == {
        "VllmOOMPressure",
        "VllmLatencySpike",
    }

    pending = answer("get", "/api/pending")
    # Newest first (a page at a time: tests/service/test_service_pending_pages.py).
    _same(pending, [r.to_dict() for r in reversed(store.pending_approvals())])
    assert [e.id for e in PendingApprovals.model_validate(pending).root] == [other, awaiting]

    inventory = served.router.inventory
    assert inventory is not None
    _same(answer("get", "/api/engines"), [e.as_dict() for e in inventory.entries()])

    up, down = answer("get", "/api/engines/state")
    _same(
        up,
        {
            "name": "cpu-0",
            "agent": served.agent.url,
            "up": True,
            "error": None,
            "state": served.agent.agent.state().model_dump(mode="json"),
        },
    )
    assert (down["name"], down["up"], down["state"]) == ("cpu-1", False, None)
    assert EngineStates.model_validate([up, down]).root[0].state == served.agent.agent.state()

    _same(answer("get", "/api/whoami"), {"who": "oncall"})

    approve = f"/api/executions/{awaiting}/approve"
    decided = answer("post", APPROVE, approve, json={"note": "go"})
    _same(decided["execution"], store.get_execution(awaiting).to_dict())
    assert Decision.model_validate(decided).execution.decided_by == "oncall"
    rejected = answer("post", REJECT, f"/api/executions/{other}/reject")
    assert Decision.model_validate(rejected).execution.status == ExecutionStatus.REFUSED

    # A refusal: ApiError's shape, as documented.
    again = client.post(approve, headers=AUTH, json={})
    assert again.status_code == 410, again.text
    refusal = ApiError.model_validate(again.json())
    assert refusal.execution is not None and refusal.execution.id == awaiting
    _same(again.json()["execution"], store.get_execution(awaiting).to_dict())
    _conforms(doc, again.json(), _schema(doc, "post", APPROVE, "410"))
    missing = client.post("/api/executions/999999/approve", headers=AUTH, json={})
    assert missing.status_code == 404
    assert ApiError.model_validate(missing.json()).execution is None


def test_the_models_import_without_the_service() -> None:
    code = (
        "import sys\n"
        "import vllm_runbook.runbooks.service.api\n"
        "loaded = {'fastapi', 'starlette', 'sqlalchemy', 'uvicorn'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_demos_event_feed_reads_the_answers_as_models(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_runbook.runbooks.demo import live

    awaiting, _ = _journal(served)
    service = "http://runbook.test"

    def get(url: str, timeout: float) -> Any:
        return served.client.get(url.removeprefix(service), headers=AUTH)

    monkeypatch.setattr(live.httpx, "get", get)
    lines: list[str] = []
    feed = live.EventFeed(service, lines.append)
    feed.poll()
    assert feed.fired == {"VllmOOMPressure"}  # the pending finding has not fired
    assert set(feed.executions) == {e.id for e in served.store.list_executions(limit=200)}
    assert feed.executions[awaiting].reason == "awaiting approval"
    [ran] = [e for e in feed.executions.values() if e.trigger == "cli"]
    assert lines == [
        "finding VllmOOMPressure fired on cpu-0 (value 0.988, critical)",
        *(
            f"  runbook oom-pressure chosen for alertmanager:VllmOOMPressure (automation auto) "
            f"→ execution #{n}"
            for n in sorted(feed.executions)
            if n != ran.id
        ),
        f"  runbook batch-too-large chosen for ann (automation auto) → execution #{ran.id}",
        f"  #{ran.id} checks: running 21, p99_latency -",
        f"  #{ran.id} note: skipped, nothing to read",
        f"  #{ran.id} action set_knobs: before max_num_seqs=32",
        f"  #{ran.id} action set_knobs: after max_num_seqs=12 (engine step 519)",
        f"  #{ran.id} verification: preemptions_per_minute 124 → 0.5 (x)",
        f"  #{ran.id} succeeded",
    ]
    feed.poll()  # nothing new: nothing printed again
    assert len(lines) == 10
