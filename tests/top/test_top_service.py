"""`runbook top --server`: a real `runbook serve` (subprocess, SQLite) over an
in-memory agent; the view reads its API, and approve / reject by keyboard go
through it with the webhook's credentials (read from the same configuration
the service reads), after a confirmation. A refused token is one line, exit 5."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from textual.widgets import DataTable
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli import build_parser, main
from vllm_runbook.runbooks.operate.cli.top import build_source
from vllm_runbook.runbooks.operate.top.app import Confirm, TopApp
from vllm_runbook.runbooks.store import Journal

from tests.fake_agent import AgentHTTP, FakeAgent
from tests.service.processes import RunbookServe
from tests.service.test_service_webhooks import payload

TOKEN = "top-webhook-token"


def _cells(app: TopApp, table: str) -> list[list[str]]:
    t = app.query_one(f"#{table}", DataTable)
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]


def _deliver(url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(
        url + "/webhooks/alertmanager",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_approve_and_reject_by_keyboard_through_the_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = AgentHTTP(FakeAgent())
    token_file = tmp_path / "webhook.token"
    token_file.write_text(TOKEN + "\n")
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "database": db,
                "engines": [
                    {"name": "cpu-0", "agent": agent.url, "labels": {"instance": "10.1.2.3:8000"}}
                ],
                "automation": {"oom-pressure": "approve", "latency-spike": "approve"},
                "webhook": {"token_file": str(token_file), "token_name": "oncall"},
                "approvals": {"timeout": "10m"},
                "executor": {"verify_seconds": "1s", "condition_seconds": "1s"},
            }
        )
    )
    try:
        with RunbookServe.run(cfg, tmp_path / "serve.log", "--no-rules") as svc:
            [oom] = _deliver(svc.url, payload())["executions"]
            spike = payload("VllmLatencySpike", "latency-spike", fingerprint="77aa")
            [latency] = _deliver(svc.url, spike)["executions"]
            assert oom["mode"] == latency["mode"] == "approve"
            # A firing incident, as the service's rules would record it.
            journal = Journal(db)
            seen = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
            journal.record_incident(
                "VllmOOMPressure", "cpu-0", state="firing", severity="critical",
                value=1.0, first_seen=seen, last_seen=seen,
            )  # fmt: skip
            journal.close()

            args = build_parser().parse_args(
                ["top", "--server", svc.url, "--config", str(cfg), "--interval", "600"]
            )
            source = build_source(args)
            assert source.who == "oncall"  # the token's name, as the service records it

            async def drive() -> None:
                app = TopApp(source, interval=600)
                async with app.run_test(size=(160, 45)) as pilot:
                    await app.workers.wait_for_complete()
                    await pilot.pause()
                    # The in-memory agent's state, through the service's /api/engines.
                    assert _cells(app, "engines") == [
                        ["cpu-0", "100.0%", "–", "0.0%", "24", "40 all", "30s", "60.0", "–",
                         "512", "32", "priority", "off"],
                    ]  # fmt: skip
                    [finding] = _cells(app, "findings")
                    assert finding[:4] == ["VllmOOMPressure", "critical", "cpu-0", "1"]
                    rows = _cells(app, "executions")
                    assert [r[:4] for r in rows] == [
                        [str(oom["id"]), "oom-pressure", agent.url, "awaiting approval"],
                        [str(latency["id"]), "latency-spike", agent.url, "awaiting approval"],
                    ]
                    await pilot.press("a")
                    await pilot.pause()
                    assert isinstance(app.screen, Confirm)
                    await pilot.press("y")
                    await app.workers.wait_for_complete()
                    await pilot.pause()
                    assert app.message == (
                        f"execution #{oom['id']} (oom-pressure on {agent.url}) approved by "
                        "oncall; the service runs it"
                    )
                    # The cursor stays on its row id: move to the other one, reject it.
                    table = app.query_one("#executions", DataTable)
                    table.move_cursor(row=[r[0] for r in _cells(app, "executions")].index(
                        str(latency["id"])))  # fmt: skip
                    await pilot.press("r")
                    await pilot.pause()
                    await pilot.press("y")
                    await app.workers.wait_for_complete()
                    await pilot.pause()
                    assert app.message == (
                        f"execution #{latency['id']} (latency-spike on {agent.url}) rejected by "
                        "oncall; nothing runs"
                    )

            try:
                asyncio.run(drive())
            finally:
                source.close()
            records = {r["id"]: r for r in svc.get("/api/executions")}
            approved, rejected = records[oom["id"]], records[latency["id"]]
            assert (approved["decision"], approved["decided_by"]) == ("approved", "oncall")
            assert (rejected["decision"], rejected["decided_by"]) == ("rejected", "oncall")
            assert rejected["status"] == "refused"

            # A token the service refuses: one line, exit 5 (SERVICE).
            bad = tmp_path / "bad.token"
            bad.write_text("not-the-token\n")
            code = main(["top", "--server", svc.url, "--token-file", str(bad)])
            assert code == ExitCode.SERVICE
            assert capsys.readouterr().err == (
                f"runbook: error: service {svc.url} refused the credentials (401 on /api/whoami)\n"
            )
    finally:
        agent.close()
