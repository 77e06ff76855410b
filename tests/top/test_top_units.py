"""`runbook top` without an engine: each cell's exact text, the API's shapes read
into rows, the keyboard's approve/reject (with its confirmation) on a scripted
source, an agent that goes away while the view runs, and the CLI's refusals."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from textual.widgets import DataTable, Footer
from vllm_runbook.collector.agent_api import TierNow
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.operate.top.app import Confirm, TopApp
from vllm_runbook.runbooks.operate.top.model import (
    AWAITING,
    EngineView,
    ExecutionView,
    Finding,
    Snapshot,
    engine_row,
    execution_row,
    executions_from,
    finding_from_incident,
    finding_row,
    knob,
    pct,
    seconds,
)
from vllm_runbook.runbooks.operate.top.sources import AgentSource, DecisionFailed, ServiceError
from vllm_runbook.runbooks.service.api import Execution, Incident

from tests.fake_agent import STARTUP, AgentHTTP, FakeAgent, agent_state


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.4567, "45.7%"), (1.0, "100.0%"), (0.0, "0.0%"), (None, "–"), (float("nan"), "–")],
)
def test_a_ratio_reads_as_a_percentage(value: float | None, text: str) -> None:
    assert pct(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0ms"),
        (0.85, "850ms"),
        (4.23, "4.2s"),
        (42.4, "42s"),
        (185.0, "3m05s"),
        (7620.0, "2h07m"),
        (None, "–"),
        (-1.0, "–"),
    ],
)
def test_a_duration_reads_as_a_person_says_it(value: float | None, text: str) -> None:
    assert seconds(value) == text


def test_a_knob_changed_at_runtime_shows_its_startup_value() -> None:
    assert knob(512, 512) == "512"
    assert knob(256, 512) == "256/512*"


def _pressured_state() -> Any:
    knobs = {**STARTUP, "max_num_batched_tokens": 256, "max_num_seqs": 12, "autopilot": True}
    state = agent_state(
        knobs,
        {
            "kv_cache_usage": 0.75,
            "kv_hit_ratio": 0.5,
            "block_fragmentation": 0.125,
            "requests_running": 12,
            "requests_waiting": 3,
            "preemptions_per_minute": 3.0,
            "engine_e2e_latency_p99": 1.25,
        },
    )
    now = {
        "hot": TierNow(waiting=2, running=5, oldest_waiting_seconds=0.5),
        "warm": TierNow(waiting=0, running=6, oldest_waiting_seconds=0.0),
        "cold": TierNow(waiting=1, running=1, oldest_waiting_seconds=75.0),
    }
    return state.model_copy(update={"tiers": state.tiers.model_copy(update={"now": now})})


def test_an_engine_row_reads_exactly() -> None:
    assert engine_row(EngineView("cpu-0", _pressured_state())) == (
        "cpu-0",
        "75.0%",
        "50.0%",
        "12.5%",
        "12",
        "2/0/1",
        "500ms/–/1m15s",
        "3.0",
        "1.2s",
        "256/512*",
        "12/32*",
        "priority",
        "on 0.90 seqs 12",
    )


def test_an_idle_engine_without_a_tier_view_shows_the_totals() -> None:
    # tiers.now is null while the scheduler lock was busy: the totals instead.
    row = engine_row(EngineView("cpu-0", agent_state()))
    assert row == (
        "cpu-0", "0.0%", "–", "0.0%", "0", "0 all", "–", "0.0", "–",
        "512", "32", "priority", "off",
    )  # fmt: skip


def test_a_down_engine_is_one_word_and_dashes() -> None:
    row = engine_row(EngineView("cpu-1", None, "engine http://x unreachable"))
    assert row == ("cpu-1", "DOWN", *["–"] * 11)


def test_executions_in_progress_and_awaiting_approval_from_the_api() -> None:
    def row(ident: int, status: str, **extra: Any) -> Execution:
        return Execution.model_validate(
            {
                "id": ident,
                "runbook": "oom-pressure",
                "engine": "cpu-0",
                "trigger": "alert",
                "who": "alertmanager",
                "alert_fingerprint": None,
                "alert_starts_at": None,
                "dry_run": False,
                "status": status,
                "display_status": status,
                "interrupted": False,
                "reason": None,
                "error": None,
                "checks": None,
                "verification": None,
                "reverts_id": None,
                "hostname": None,
                "pid": None,
                "created_at": "2026-12-02T10:00:00+00:00",
                "started_at": None,
                "finished_at": None,
                "steps": [],
                "decision": None,
                "decided_by": None,
                "decided_at": None,
                "decision_note": None,
                **extra,
            }
        )

    recent = [
        row(5, "pending"),
        row(4, "succeeded"),
        row(3, "verifying"),
        row(2, "running", display_status="interrupted"),
        row(1, "refused"),
    ]
    views = executions_from(recent, [row(5, "pending")])
    created = 1796205600.0  # 2026-12-02T10:00:00Z
    assert views == (
        ExecutionView(3, "oom-pressure", "cpu-0", "verifying", "alertmanager", created),
        ExecutionView(5, "oom-pressure", "cpu-0", AWAITING, "alertmanager", created),
    )
    assert execution_row(views[1], created + 65) == (
        "5", "oom-pressure", "cpu-0", "awaiting approval", "alertmanager", "1m05s",
    )  # fmt: skip


def test_a_firing_incident_reads_as_a_finding() -> None:
    finding = finding_from_incident(
        Incident.model_validate(
            {
                "id": 1,
                "alert": "VllmOOMPressure",
                "severity": "critical",
                "engine": "cpu-0",
                "state": "firing",
                "value": 0.987654,
                "first_seen": "2026-12-02T10:00:00Z",
                "last_seen": "2026-12-02T10:00:00Z",
                "resolved_at": None,
                "labels": {},
            }
        )
    )
    assert finding == Finding("VllmOOMPressure", "critical", "cpu-0", 0.987654, 1796205600.0)
    assert finding_row(finding, 1796205600.0 + 12) == (
        "VllmOOMPressure", "critical", "cpu-0", "0.9877", "12s",
    )  # fmt: skip


# -- the app, on a scripted source ------------------------------------------------------


class Scripted:
    """A source that answers one snapshot and records the answers asked of it."""

    description = "scripted"
    cannot_decide = "no"

    def __init__(self, snapshot: Snapshot, who: str | None = "ann") -> None:
        self.current = snapshot
        self.who = who
        self.decisions: list[tuple[int, str]] = []

    def snapshot(self) -> Snapshot:
        return self.current

    def decide(self, execution_id: int, verb: str, note: str | None = None) -> str:
        self.decisions.append((execution_id, verb))
        if execution_id == 9:
            raise DecisionFailed("execution #9 expired")
        return f"execution #{execution_id} {verb}d by {self.who}"

    def close(self) -> None:
        pass


def _snapshot() -> Snapshot:
    now = time.time()
    return Snapshot(
        taken_at=now,
        engines=(EngineView("cpu-0", _pressured_state()), EngineView("cpu-1", None, "gone")),
        findings=(Finding("VllmOOMPressure", "critical", "cpu-0", 0.98, now - 30),),
        executions=(
            ExecutionView(3, "oom-pressure", "cpu-0", "running", "alertmanager", now - 5),
            ExecutionView(7, "oom-pressure", "cpu-0", AWAITING, "alertmanager", now - 60),
            ExecutionView(9, "latency-spike", "cpu-1", AWAITING, "alertmanager", now - 900),
        ),
        problems=("cpu-1: gone",),
    )


def _cells(app: TopApp, table: str) -> list[list[str]]:
    t = app.query_one(f"#{table}", DataTable)
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]


def test_keys_approve_and_reject_after_a_confirmation() -> None:
    source = Scripted(_snapshot())

    async def drive() -> None:
        app = TopApp(source, interval=60, snapshot=source.current)  # type: ignore[arg-type]
        async with app.run_test(size=(160, 45)) as pilot:
            assert [r[0] for r in _cells(app, "engines")] == ["cpu-0", "cpu-1"]
            assert _cells(app, "engines")[1][1] == "DOWN"
            assert _cells(app, "findings")[0][:3] == ["VllmOOMPressure", "critical", "cpu-0"]
            assert [r[0] for r in _cells(app, "executions")] == ["3", "7", "9"]
            # The running one cannot be answered: no question is asked.
            await pilot.press("a")
            await pilot.pause()
            assert not isinstance(app.screen, Confirm) and source.decisions == []
            # Down to #7: approve, then say no: nothing is sent.
            await pilot.press("down", "a")
            await pilot.pause()
            assert isinstance(app.screen, Confirm)
            question = str(app.screen.query_one("#question").render())
            assert question == "Approve execution #7: oom-pressure on cpu-0, as ann?"
            await pilot.press("n")
            await pilot.pause()
            assert source.decisions == [] and app.message == "#7: not approved"
            # The status line is on screen, above the footer (not under it).
            status, footer = app.query_one("#status"), app.query_one(Footer)
            assert status.display and status.region.height >= 1
            assert status.region.bottom <= footer.region.y
            assert "#7: not approved" in str(status.render())
            # Again, yes: sent once, and the answer is shown.
            await pilot.press("a")
            await pilot.pause()
            await pilot.press("y")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert source.decisions == [(7, "approve")]
            assert app.message == "execution #7 approved by ann"
            # #9: reject; the source refuses it (too late): said, not raised.
            await pilot.press("down", "r")
            await pilot.pause()
            await pilot.press("y")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert source.decisions == [(7, "approve"), (9, "reject")]
            assert app.message == "#9 not rejected: execution #9 expired"

    asyncio.run(drive())


def test_a_view_without_credentials_asks_nothing() -> None:
    source = Scripted(_snapshot(), who=None)

    async def drive() -> None:
        app = TopApp(source, interval=60, snapshot=source.current)  # type: ignore[arg-type]
        async with app.run_test(size=(160, 45)) as pilot:
            await pilot.press("down", "a")
            await pilot.pause()
            assert not isinstance(app.screen, Confirm) and source.decisions == []

    asyncio.run(drive())


def test_an_agent_that_goes_away_shows_as_down_and_the_view_goes_on() -> None:
    http = AgentHTTP(FakeAgent())
    name = http.url.removeprefix("http://")
    source = AgentSource([http.url], timeout=2)
    try:
        source.check()

        async def drive() -> None:
            app = TopApp(source, interval=60)
            async with app.run_test(size=(160, 45)) as pilot:
                await app.workers.wait_for_complete()
                await pilot.pause()
                assert _cells(app, "engines") == [
                    # FakeAgent's PRESSURE: a full cache, 24 running, 40 waiting.
                    [name, "100.0%", "–", "0.0%", "24", "40 all", "30s", "60.0", "–",
                     "512", "32", "priority", "off"],
                ]  # fmt: skip
                http.close()
                await pilot.press("g")  # refresh now
                await app.workers.wait_for_complete()
                await pilot.pause()
                assert _cells(app, "engines") == [[name, "DOWN", *["–"] * 11]]
                status = str(app.query_one("#status").render())
                assert f"{name}: engine {http.url} unreachable" in status

        asyncio.run(drive())
    finally:
        source.close()


# -- the command's refusals: one line, one code ---------------------------------------------


def test_an_unreachable_engine_or_service_is_one_line_and_its_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["top", "--engine", "http://127.0.0.1:9"]) == ExitCode.ENGINE
    assert capsys.readouterr().err == (
        "runbook: error: engine http://127.0.0.1:9 unreachable: [Errno 111] Connection refused\n"
    )
    assert main(["top", "--server", "http://127.0.0.1:9"]) == ExitCode.SERVICE
    assert capsys.readouterr().err == (
        "runbook: error: service http://127.0.0.1:9 unreachable: [Errno 111] Connection refused\n"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["top"], "give --engine URL (repeatable) or --engines-file FILE"),
        (
            ["top", "--server", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9"],
            "give --server URL or --engine URL, not both",
        ),
        (
            ["top", "--engine", "http://127.0.0.1:9", "--token-file", "t"],
            "--token-file is the service's: give it with --server URL",
        ),
        (["top", "--engine", "ftp://x"], "not an engine agent URL: 'ftp://x'"),
        (
            ["top", "--engine", "http://127.0.0.1:9", "--engine", "127.0.0.1:9"],
            "an engine is given twice (127.0.0.1:9, 127.0.0.1:9)",
        ),
        (["top", "--interval", "0", "--engine", "x"], None),
    ],
)
def test_bad_usage_is_one_line_and_code_2(
    args: list[str], error: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("runbook: error: ")
    if error is not None:
        assert err == f"runbook: error: {error}\n"


def test_a_refresh_that_fails_keeps_the_last_view_and_says_why() -> None:
    source = Scripted(_snapshot())

    def down() -> Snapshot:
        raise ServiceError("service http://127.0.0.1:9 unreachable: [Errno 111] Connection refused")

    async def drive() -> None:
        app = TopApp(source, interval=60, snapshot=source.current)  # type: ignore[arg-type]
        async with app.run_test(size=(160, 45)) as pilot:
            before = _cells(app, "engines")
            source.snapshot = down  # type: ignore[method-assign]
            await pilot.press("g")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert _cells(app, "engines") == before
            assert app.message.startswith("refresh failed (")
            assert app.message.endswith(
                "), showing the last: service http://127.0.0.1:9 unreachable: "
                "[Errno 111] Connection refused"
            )

    asyncio.run(drive())


def test_with_engines_the_keys_answer_in_the_journal_as_runbook_approve_does(
    tmp_path: Any,
) -> None:
    from datetime import UTC, datetime

    from vllm_runbook.runbooks.store import Journal, upgrade
    from vllm_runbook.runbooks.store.models import ApprovalState

    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    journal = Journal(db)
    now = datetime.now(UTC)
    ids = [
        journal.create_execution(
            runbook, "cpu-0", trigger="alert", who="alertmanager", alert_fingerprint=fp,
            alert_starts_at=now, reason=ApprovalState.AWAITING,
        )[0].id
        for runbook, fp in (("oom-pressure", "fp1"), ("latency-spike", "fp2"))
    ]  # fmt: skip
    http = AgentHTTP(FakeAgent())
    source = AgentSource([http.url], timeout=2, journal=True, journal_url=db, who="ann")
    try:

        async def drive() -> None:
            app = TopApp(source, interval=60)
            async with app.run_test(size=(160, 45)) as pilot:
                await app.workers.wait_for_complete()
                await pilot.pause()
                rows = _cells(app, "executions")
                assert [r[:4] for r in rows] == [
                    [str(ids[0]), "oom-pressure", "cpu-0", "awaiting approval"],
                    [str(ids[1]), "latency-spike", "cpu-0", "awaiting approval"],
                ]
                for keys in (("a", "y"), ("down", "r", "y")):
                    await pilot.press(*keys)
                    await app.workers.wait_for_complete()
                    await pilot.pause()
                assert app.message == (
                    f"execution #{ids[1]} (latency-spike on cpu-0) rejected by ann; nothing runs"
                )

        asyncio.run(drive())
    finally:
        source.close()
        http.close()
    approved, rejected = (journal.get_execution(i) for i in ids)
    journal.close()
    assert (approved.decision, approved.decided_by, approved.status) == (
        "approved", "ann", "pending",
    )  # fmt: skip
    assert (rejected.decision, rejected.decided_by, rejected.status) == (
        "rejected", "ann", "refused",
    )  # fmt: skip
