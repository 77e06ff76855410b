"""The autopilot on a real CPU engine (256 KV blocks of 32, budget 512,
max_num_seqs 32), stepped by hand under closed-loop load."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.auth import find_local_token

from tests.engines import InProcessEngine, runbook_cli, while_stepping

pytestmark = pytest.mark.engine

STARTUP_SEQS = 32


@pytest.fixture(scope="module")
def pilot_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(
        tiny_model,
        max_num_seqs=STARTUP_SEQS,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=256,
    )
    yield eng
    eng.close()


def post(engine: InProcessEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    token = find_local_token(engine.collector.server.port)
    return httpx.post(
        engine.collector.server.url + path,
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def post_while_stepping(engine: InProcessEngine, path: str, body: dict[str, Any]) -> dict:
    box: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: box.update(r=post(engine, path, body)))
    thread.start()
    while_stepping(engine, thread)
    assert box["r"].status_code == 200, box["r"].text
    return dict(box["r"].json())


@dataclass
class ClosedLoop:
    """`clients` requests always in flight: a finished one is replaced at once."""

    engine: InProcessEngine
    clients: int
    prompt: int
    output: int
    tag: str
    ids: Iterator[int] = field(default_factory=itertools.count)
    # After each step: (max_num_seqs in force, running, cumulative preemptions).
    trace: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for _ in range(self.clients):
            self._add()

    def _add(self) -> None:
        i = next(self.ids)
        self.engine.add(f"{self.tag}-{i}", self.prompt + 13 * i % 64, self.output, offset=29 * i)

    def run(self, steps: int) -> None:
        s, c = self.engine.scheduler, self.engine.collector
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished:
                    self._add()
            self.trace.append((s.max_num_active_reqs, len(s.running), c.stats.preemptions))

    def drain(self) -> None:
        self.engine.run_until_done()


def test_backs_off_under_preemption_and_stays_within_bounds(
    pilot_engine: InProcessEngine,
) -> None:
    eng, c = pilot_engine, pilot_engine.collector
    cli = runbook_cli("set", "--engine", c.server.url, "autopilot=on", "--json")
    assert cli.returncode == 0, cli.stderr
    [change] = json.loads(cli.stdout)
    assert change["changes"] == [{"knob": "autopilot", "before": False, "after": True}]
    assert eng.value(M.AUTOPILOT_ENABLED.name) == 1
    assert eng.value(M.AUTOPILOT_KV_TARGET.name) == pytest.approx(0.9)
    start = c.stats.preemptions

    load = ClosedLoop(eng, 48, 300, 300, "long")
    load.run(2400)
    limits = [limit for limit, _, _ in load.trace]
    preempted = [p - start for _, _, p in load.trace]
    assert preempted[-1] > 0  # the workload really overflows 32 sequences
    first = next(i for i, p in enumerate(preempted) if p)
    assert limits[first] == STARTUP_SEQS and min(limits) < STARTUP_SEQS
    # Never above the startup value, never below one.
    assert all(1 <= limit <= STARTUP_SEQS for limit in limits)
    down = eng.value(M.AUTOPILOT_CHANGES.series_name, direction="down")
    assert down is not None and down >= 1
    # Preemptions die down: the last third of the run preempts less than the first.
    third = len(preempted) // 3
    assert preempted[-1] - preempted[-third] < preempted[third], preempted[::100]
    state = httpx.get(c.server.url + "/v1/state").json()
    assert state["autopilot"]["enabled"] is True
    assert state["autopilot"]["limit"] == eng.scheduler.max_num_active_reqs == limits[-1]
    assert state["knobs"]["autopilot"] is True

    # Off: the knobs stay where the autopilot left them.
    result = post_while_stepping(eng, "/v1/knobs", {"autopilot": "off"})
    assert result["changes"] == [{"knob": "autopilot", "before": True, "after": False}]
    held = eng.scheduler.max_num_active_reqs
    assert held == limits[-1] and held < STARTUP_SEQS
    load.run(300)
    assert {limit for limit, _, _ in load.trace[-300:]} == {held}
    assert eng.value(M.AUTOPILOT_ENABLED.name) == 0
    load.drain()
    status = runbook_cli("status", "--engine", c.server.url)
    assert "autopilot off: peak KV target 0.90..0.95" in status.stdout, status.stdout
    assert post(eng, "/v1/restore", {}).json()["after"]["max_num_seqs"] == STARTUP_SEQS


def test_climbs_when_there_is_room_and_survives_a_policy_switch(
    pilot_engine: InProcessEngine,
) -> None:
    eng, c = pilot_engine, pilot_engine.collector
    assert post(eng, "/v1/knobs", {"max_num_seqs": 2}).status_code == 200
    result = post(eng, "/v1/knobs", {"autopilot": True, "autopilot_target": 0.8}).json()
    assert result["after"]["autopilot"] is True and result["after"]["max_num_seqs"] == 2
    up_before = eng.value(M.AUTOPILOT_CHANGES.series_name, direction="up") or 0
    start = c.stats.preemptions
    load = ClosedLoop(eng, 40, 40, 16, "short")  # 40 × ≤ 4 blocks: all fit at once
    load.run(600)
    limits = [limit for limit, _, _ in load.trace]
    assert limits[-1] > 4 and all(b >= a for a, b in itertools.pairwise(limits))
    assert c.stats.preemptions == start
    assert (eng.value(M.AUTOPILOT_CHANGES.series_name, direction="up") or 0) > up_before
    reached = limits[-1]

    # A policy switch rebuilds the queues; the autopilot keeps its limit and goes on.
    switched = post_while_stepping(eng, "/v1/knobs", {"policy": "priority"})
    assert switched["after"]["policy"] == "priority" and switched["after"]["autopilot"] is True
    assert switched["after"]["max_num_seqs"] >= reached
    load.run(400)
    assert eng.collector.autopilot.enabled and load.trace[-1][0] >= reached
    assert max(limit for limit, _, _ in load.trace) <= STARTUP_SEQS

    # Restore: the autopilot off, every knob (its target too) at its startup value.
    restored = post_while_stepping(eng, "/v1/restore", {})
    assert restored["after"] == {
        "max_num_batched_tokens": 512,
        "max_num_seqs": STARTUP_SEQS,
        "policy": "fcfs",
        "autopilot": False,
        "autopilot_target": 0.9,
    }
    moved = {"max_num_seqs"} if restored["before"]["max_num_seqs"] != STARTUP_SEQS else set()
    assert {ch["knob"] for ch in restored["changes"]} == {
        "autopilot",
        "autopilot_target",
        "policy",
        *moved,
    }
    load.run(100)
    assert {limit for limit, _, _ in load.trace[-100:]} == {STARTUP_SEQS}
    load.drain()
    assert eng.value(M.AUTOPILOT_ENABLED.name) == 0


def test_an_error_turns_off_the_autopilot_only(
    pilot_engine: InProcessEngine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, c = pilot_engine, pilot_engine.collector
    assert post(eng, "/v1/knobs", {"max_num_seqs": 3, "autopilot": "on"}).status_code == 200

    def broken(limit: int) -> int:
        raise RuntimeError("injected")

    monkeypatch.setattr(c.control, "apply_autopilot", broken)
    load = ClosedLoop(eng, 24, 40, 8, "broken")
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.collector"):
        load.run(400)  # long enough for a climb: its apply fails
    lines = [r for r in caplog.records if "autopilot turned off" in r.getMessage()]
    assert len(lines) == 1 and "RuntimeError: injected" in lines[0].getMessage()
    assert not c.autopilot.enabled and c.enabled  # the collector goes on
    assert eng.value(M.AUTOPILOT_ENABLED.name) == 0 and eng.value(M.COLLECTOR_UP.name) == 1
    assert eng.scheduler.max_num_active_reqs == 3  # the knobs stay
    state = httpx.get(c.server.url + "/v1/state").json()
    assert state["autopilot"]["error"] == "RuntimeError: injected"
    load.drain()
    assert all(f"broken-{i}" in eng.finished for i in range(24))
    monkeypatch.undo()
    post(eng, "/v1/restore", {}).raise_for_status()


def test_bad_values_are_refused_in_one_line(pilot_engine: InProcessEngine) -> None:
    url = pilot_engine.collector.server.url
    for arg, message in (
        ("autopilot=maybe", "autopilot must be on or off, got 'maybe'"),
        ("autopilot_target=1.5", "autopilot_target must be in (0, 1], got '1.5'"),
        ("autopilot_target=0", "autopilot_target must be in (0, 1], got '0'"),
    ):
        cli = runbook_cli("set", "--engine", url, arg)
        assert cli.returncode == 2 and message in cli.stderr, cli.stderr
        assert cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr
    r = post(pilot_engine, "/v1/knobs", {"autopilot": "maybe"})
    assert r.status_code == 400 and r.json()["error"] == "autopilot must be on or off, got 'maybe'"
    r = post(pilot_engine, "/v1/knobs", {"autopilot_target": 2})
    assert r.status_code == 400 and "autopilot_target must be in (0, 1]" in r.json()["error"]
    assert httpx.get(url + "/v1/state").json()["knobs"]["autopilot"] is False


def test_switched_on_from_the_environment_at_start(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_RUNBOOK_AUTOPILOT", "on")
    monkeypatch.setenv("VLLM_RUNBOOK_AUTOPILOT_TARGET", "0.8")
    eng = InProcessEngine.start(tiny_model, max_num_seqs=8, num_gpu_blocks_override=64)
    try:
        assert eng.value(M.AUTOPILOT_ENABLED.name) == 1
        assert eng.value(M.AUTOPILOT_KV_TARGET.name) == pytest.approx(0.8)
        assert eng.value(M.AUTOPILOT_KV_HIGH.name) == pytest.approx(0.85)
        state = httpx.get(eng.collector.server.url + "/v1/state").json()
        assert (state["knobs"]["autopilot"], state["startup"]["autopilot"]) == (True, False)
        assert state["autopilot"]["limit"] == 8 and state["autopilot"]["ceiling"] == 8
        # restore: the autopilot off (its startup value), the target back to the engine's.
        restored = post(eng, "/v1/restore", {}).json()
        assert restored["changes"] == [{"knob": "autopilot", "before": True, "after": False}]
        assert eng.value(M.AUTOPILOT_ENABLED.name) == 0
    finally:
        eng.close()


def test_advisory_from_the_environment_exports_its_target_and_changes_nothing(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLM_RUNBOOK_AUTOPILOT=advisory: the controller is fed every step and
    decides as if on; the max_num_seqs it would set is exported (and on
    /v1/state), the knobs stay where they are."""
    monkeypatch.setenv("VLLM_RUNBOOK_AUTOPILOT", "advisory")
    eng = InProcessEngine.start(tiny_model, max_num_seqs=8, num_gpu_blocks_override=64)
    try:
        c = eng.collector
        assert eng.value(M.AUTOPILOT_ENABLED.name) == 0
        assert eng.value(M.AUTOPILOT_ADVISED_MAX_NUM_SEQS.name) == 8
        load = ClosedLoop(eng, 12, 300, 100, "advisory")
        while load.trace == [] or load.trace[-1][2] == 0:
            load.run(1)  # until the first preemption: 8 × 400 tokens overflow 64 × 32
        limits = {limit for limit, _, _ in load.trace}
        assert limits == {8}  # the scheduler's limit never moved
        state = httpx.get(c.server.url + "/v1/state").json()
        pilot = state["autopilot"]
        assert (pilot["enabled"], pilot["advisory"], state["knobs"]["autopilot"]) == (
            False,
            True,
            False,
        )
        last = pilot["last_change"]
        assert last["reason"] == "preemption" and 1 <= last["max_num_seqs"] < 8
        assert pilot["limit"] == last["max_num_seqs"]
        assert eng.value(M.AUTOPILOT_ADVISED_MAX_NUM_SEQS.name) == last["max_num_seqs"]
        assert eng.value(M.AUTOPILOT_CHANGES.series_name, direction="down") == 1
        load.run(40)  # the storm goes on: still nothing applied
        assert {limit for limit, _, _ in load.trace} == {8}
        assert eng.scheduler.max_num_active_reqs == 8
        assert state["knobs"]["max_num_seqs"] == 8
        # Switched on by hand, it acts from where the engine is; no advice is exported.
        post_while_stepping(eng, "/v1/knobs", {"autopilot": "on"})
        assert eng.value(M.AUTOPILOT_ADVISED_MAX_NUM_SEQS.name) is None
        assert eng.value(M.AUTOPILOT_ENABLED.name) == 1
    finally:
        eng.close()
