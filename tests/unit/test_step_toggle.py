"""The step toggle of the collector-overhead benchmark (benchmarks/hook_toggle.py)
on a stand-in scheduler and a fake clock: which steps a block measures, what
it counts, the kinds' rotation, and a collector error voiding the run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toggle() -> ModuleType:
    path = ROOT / "benchmarks" / "hook_toggle.py"
    spec = importlib.util.spec_from_file_location("hook_toggle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hook_toggle"] = module
    spec.loader.exec_module(module)
    return module


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def engine(toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """A scheduler with the toggle in front of a stand-in for the hooked one:
    each step takes 1 s plus its number, samples one token per request."""

    class Base:
        def __init__(self) -> None:
            self.requests: dict[str, Any] = {}
            self.runbook_collector = SimpleNamespace(enabled=True, error=None)
            self.enabled_at: list[bool] = []

        def add_request(self, request: str) -> None:
            self.requests[request] = request

        def schedule(self) -> str:
            self.enabled_at.append(self.runbook_collector.enabled)
            return "output"

        def update_from_output(self, scheduler_output: Any, runner_output: Any) -> dict[str, Any]:
            return {}

    class Toggled(toggle._StepToggle, Base):
        pass

    clock = Clock()
    monkeypatch.setattr(toggle.time, "perf_counter", clock)
    monkeypatch.setenv(toggle.STEP_LOG_ENV, str(tmp_path / "blocks.jsonl"))
    scheduler = Toggled()
    scheduler.clock = clock
    return scheduler


def run_round(scheduler: Any, steps: int, running: int = 4) -> None:
    for i in range(running):
        scheduler.add_request(f"r{i}")
    for step in range(steps):
        out = scheduler.schedule()
        scheduler.clock.now += 1.0 + step
        sampled = SimpleNamespace(sampled_token_ids=[[7]] * running)
        scheduler.update_from_output(out, sampled)
    scheduler.requests.clear()  # the round's requests finished: the engine is idle


def logged(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "blocks.jsonl").read_text().splitlines()]


def test_a_block_measures_its_steps_after_the_first_and_drops_the_round_end(
    toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    n = toggle.BLOCK_STEPS
    scheduler = engine(toggle, monkeypatch, tmp_path)
    run_round(scheduler, 2 * n + n // 2)  # round 0: two whole blocks, then part of one
    run_round(scheduler, 3 * n)  # round 1: its last block has no next step to end it
    scheduler.add_request("flush")
    blocks = [x["block"] for x in logged(tmp_path)]
    # Steps 1..n-1 of each block: 1 + step seconds each, one token per request.
    first = sum(1.0 + s for s in range(1, n))
    second = sum(1.0 + s for s in range(n + 1, 2 * n))
    tokens = 4 * (n - 1)
    assert blocks == [
        [0, 0, first, tokens, n - 1],
        [0, 1, second, tokens, n - 1],
        [1, 1, first, tokens, n - 1],
        [1, 2, second, tokens, n - 1],
    ]


def test_the_collector_is_on_in_on_blocks_only_and_kinds_rotate_by_round(
    toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    n = toggle.BLOCK_STEPS
    scheduler = engine(toggle, monkeypatch, tmp_path)
    for _ in range(3):
        run_round(scheduler, 3 * n)
    # Round r's block j is kind (r + j) % 3; "on" (kind 0) alone enables the collector.
    expected = [(r + j) % 3 == 0 for r in range(3) for j in range(3) for _ in range(n)]
    assert scheduler.enabled_at == expected


def test_a_collector_error_is_logged_and_voids_the_run(
    toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    n = toggle.BLOCK_STEPS
    scheduler = engine(toggle, monkeypatch, tmp_path)
    run_round(scheduler, n)
    scheduler.runbook_collector.error = "ValueError: boom"
    run_round(scheduler, 2 * n)
    scheduler.add_request("flush")
    assert {"error": "ValueError: boom"} in logged(tmp_path)


def test_with_a_busy_wait_the_third_kind_waits_in_each_of_its_steps_with_the_hook_off(
    toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    n = toggle.BLOCK_STEPS
    waits: list[tuple[float, int, bool]] = []
    scheduler = engine(toggle, monkeypatch, tmp_path)
    monkeypatch.setattr(
        toggle,
        "busy_wait",
        lambda s: waits.append(
            (s, scheduler._runbook_blocks.kind, scheduler.runbook_collector.enabled)
        ),
    )
    monkeypatch.setenv(toggle.BUSY_ENV, "250")
    for _ in range(3):
        run_round(scheduler, 3 * n)
    # Round r's block j is kind (r + j) % 3: kind 2 in one block of each round.
    assert waits == [(250e-6, 2, False)] * (3 * n)
    scheduler.add_request("flush")
    # The busy blocks are logged as kind 2, as "off B" is without the wait (a
    # round's last block is not: no step ends it).
    assert [x["block"][:2] for x in logged(tmp_path)] == [
        [0, 0],
        [0, 1],
        [1, 1],
        [1, 2],
        [2, 2],
        [2, 0],
    ]


def test_without_a_busy_wait_no_kind_waits(
    toggle: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    n = toggle.BLOCK_STEPS
    waits: list[float] = []
    monkeypatch.setattr(toggle, "busy_wait", waits.append)
    monkeypatch.delenv(toggle.BUSY_ENV, raising=False)
    scheduler = engine(toggle, monkeypatch, tmp_path)
    for _ in range(3):
        run_round(scheduler, 3 * n)
    assert waits == []
