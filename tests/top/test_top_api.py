"""The service's routes `runbook top --server` reads: /api/engines (each
configured agent's state, or why not) and /api/whoami (the credentials' name)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.rules.config import Automation, EngineConfig
from vllm_runbook.runbooks.service.app import Credentials, create_app
from vllm_runbook.runbooks.service.webhooks import Router
from vllm_runbook.runbooks.store import Journal, upgrade

from tests.fake_agent import AgentHTTP, FakeAgent


def test_engines_answer_each_agents_state_or_why_not_and_whoami_names_the_token(
    tmp_path: Path,
) -> None:
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    agent = AgentHTTP(FakeAgent())
    engines = (
        EngineConfig.model_validate({"name": "cpu-0", "agent": agent.url}),
        EngineConfig.model_validate({"name": "cpu-1", "agent": "http://127.0.0.1:9"}),
    )
    store = Journal(db)
    app = create_app(
        store,
        Router(engines, Automation(), {}, frozenset()),
        Credentials(token="t0ken", name="oncall"),
        engines=engines,
        engine_timeout_s=2,
    )
    try:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            up, down = client.get("/api/engines/state").json()
            assert (up["name"], up["agent"], up["up"], up["error"]) == (
                "cpu-0", agent.url, True, None,
            )  # fmt: skip
            assert AgentState.model_validate(up["state"]) == agent.agent.state()
            assert down == {
                "name": "cpu-1",
                "agent": "http://127.0.0.1:9",
                "up": False,
                "error": "engine http://127.0.0.1:9 unreachable: [Errno 111] Connection refused",
                "state": None,
            }
            assert client.get("/api/whoami", headers={"Authorization": "Bearer t0ken"}).json() == {
                "who": "oncall"
            }
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answer = client.get("/api/whoami", headers=headers)
                assert (answer.status_code, answer.json()) == (401, {"error": "unauthorized"})
    finally:
        agent.close()
        store.close()
