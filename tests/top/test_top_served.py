"""`runbook top` against a served CPU engine, headless (textual's pilot): the
engine's row read live from its agent, a finding of the embedded evaluator,
a knob changed at runtime, then the engine stopped under the running view."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import pytest
import yaml
from textual.widgets import DataTable
from vllm_runbook.runbooks.operate.cli import build_parser
from vllm_runbook.runbooks.operate.cli.top import build_source
from vllm_runbook.runbooks.operate.top.app import TopApp

from tests.engines import ServedEngine, runbook_cli

pytestmark = [pytest.mark.engine, pytest.mark.served]


def _cells(app: TopApp, table: str) -> list[list[str]]:
    t = app.query_one(f"#{table}", DataTable)
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]


async def _refresh(app: TopApp, pilot: object) -> None:
    await pilot.press("g")  # type: ignore[attr-defined]
    await app.workers.wait_for_complete()
    await pilot.pause()  # type: ignore[attr-defined]


def test_top_shows_a_served_engine_live_and_then_down(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No journal here: the executions table says so instead.
    monkeypatch.setenv("RUNBOOK_DB_URL", f"sqlite:///{tmp_path / 'absent.db'}")
    config = tmp_path / "runbook.yaml"
    # The hit-ratio rule at once (its shipped `for` is 5m): the evaluator's finding.
    config.write_text(
        yaml.safe_dump({"rules": {"overrides": {"VllmKVCacheHitRatioLow": {"for": "0s"}}}})
    )
    stack = contextlib.ExitStack()
    with stack:
        served = stack.enter_context(
            ServedEngine.run(
                tiny_model,
                tmp_path / "engine.log",
                # The hit ratio's window outlasts the test, so it stays exact.
                env={"VLLM_RUNBOOK_WINDOW_SECONDS": "600"},
            )
        )
        # One 100-token prompt twice: vLLM caches full blocks of 32, so 96 of
        # the 200 tokens looked up are hits (48 %).
        for _ in range(2):
            assert served.complete(100, max_tokens=4, offset=7)["usage"]["prompt_tokens"] == 100
        assert runbook_cli("set", "--engine", served.agent_url, "max_num_seqs=16").returncode == 0
        name = served.agent_url.removeprefix("http://")
        args = build_parser().parse_args(
            ["top", "--engine", served.agent_url, "--config", str(config), "--interval", "600"]
        )
        source = build_source(args)

        async def drive() -> None:
            app = TopApp(source, interval=600)
            async with app.run_test(size=(160, 45)) as pilot:
                await app.workers.wait_for_complete()
                await pilot.pause()
                [row] = _cells(app, "engines")
                assert row[:8] == [name, "0.0%", "48.0%", "0.0%", "0", "0/0/0", "–/–/–", "0.0"]
                assert re.fullmatch(r"\d+ms|\d+\.\ds|\d+s", row[8]), row[8]  # a P99 was measured
                assert row[9:] == ["512", "16/32*", "fcfs", "off"]
                [finding] = _cells(app, "findings")
                assert finding[:4] == ["VllmKVCacheHitRatioLow", "warning", name, "0.48"]
                assert _cells(app, "executions") == []
                status = str(app.query_one("#status").render())
                assert "executions: no journal" in status

                stack.close()  # the engine stops under the running view
                await _refresh(app, pilot)
                assert _cells(app, "engines") == [[name, "DOWN", *["–"] * 11]]
                status = str(app.query_one("#status").render())
                assert f"{name}: engine {served.agent_url} unreachable" in status
                header = str(app.query_one("#header").render())
                assert "0/1 engines up" in header

        try:
            asyncio.run(drive())
        finally:
            source.close()
