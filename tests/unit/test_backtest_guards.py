"""The backtest's guards over a timeline, on series handed to the replay directly.

Three engines storm at once, then the first storms again ten minutes later.
oom-pressure admits two engines at once (blast radius) and waits 600 s per
engine (cooldown); with the circuit breaker watching 2 minutes, the first
engine's storm goes on after its would-be change (preemptions per finished
request far over 1 %), so the breaker holds its knobs and refuses the second
storm before the cooldown does. Exact oracles: each decision and its reason's
first words, the knob changes from the recorded values.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from vllm_runbook.rules.backtest import Replay, steps
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks
from vllm_runbook.runbooks.operate.backtest import Simulator

T0, STEP, END = 1000.0, 15.0, 2400.0
STORMS = {"a": [(1300, 1600), (1800, 2000)], "b": [(1300, 1600)], "c": [(1300, 1600)]}


def _series(engine: str) -> dict[str, list[list[float]]]:
    def storming(t: float) -> bool:
        return any(lo <= t < hi for lo, hi in STORMS[engine])

    times = [T0 + i * 5 for i in range(int((END - T0) / 5) + 1)]
    preempted, out = 0, {}
    peaks, preemptions, finished = [], [], []
    for i, t in enumerate(times):
        preempted += 10 if storming(t) else 0
        peaks.append([t, 1.0 if storming(t) else 0.5])
        preemptions.append([t, float(preempted)])
        finished.append([t, float(i)])
    out["vllm_runbook_kv_cache_usage_peak_ratio"] = peaks
    out["vllm_runbook_preemptions_total"] = preemptions
    out["vllm:request_success_total"] = finished
    for name, value in (
        ("vllm_runbook_max_num_seqs", 16.0),
        ("vllm_runbook_max_num_batched_tokens", 512.0),
        ("vllm_runbook_kv_blocks_used", 30.0),
        ("vllm_runbook_kv_blocks_free", 1.0),
        ("vllm_runbook_num_requests_running", 10.0),
    ):
        out[name] = [[t, value] for t in times]
    return out


def _decisions(tmp_path: Path, breaker: dict[str, object]) -> list[tuple[str, str, str]]:
    runbooks = load_runbooks(None, engine_registry())
    path = tmp_path / "runbook.yaml"
    path.write_text(
        yaml.safe_dump({"automation": {"oom-pressure": "auto"}, "breaker": breaker}),
        encoding="utf-8",
    )
    config = load_config(path)
    rules = [r for r in load_catalog().bind({}) if r.alert == "VllmOOMPressure"]
    replay = Replay(
        rules,
        signals=Simulator.signals(runbooks),
        series=Simulator.extra_series(),
        history=2 * config.breaker.watch_seconds,
    )
    for engine in STORMS:
        for name, values in _series(engine).items():
            labels = {"instance": engine, "model_name": "m", "engine": "0"}
            if name == "vllm:request_success_total":
                labels["finished_reason"] = "stop"
            replay.ingest(name, labels, values)
    sim = Simulator(replay, runbooks, config, engine_registry())
    for t in steps(T0, END, STEP):
        sim.observe(t, replay.evaluate(t))
    return [
        (d.finding.engine[0], d.decision, (d.reason or "").split(":")[0]) for d in sim.decisions
    ]


def test_blast_radius_cooldown_and_changes(tmp_path: Path) -> None:
    assert _decisions(tmp_path, {"enabled": False}) == [
        ("a", "would run", ""),
        ("b", "would run", ""),
        ("c", "refused", "blast radius"),
        ("a", "refused", "cooldown"),
    ]


def test_the_breaker_holds_the_knobs_it_judged(tmp_path: Path) -> None:
    assert _decisions(tmp_path, {"watch": "2m"}) == [
        ("a", "would run", ""),
        ("b", "would run", ""),
        ("c", "refused", "blast radius"),
        ("a", "refused", "circuit breaker hold on autopilot (oom-pressure tripped it"),
    ]


def test_the_changes_are_the_actions_arithmetic(tmp_path: Path) -> None:
    runbooks = load_runbooks(None, engine_registry())
    config = load_config(None)
    replay = Replay([], signals=Simulator.signals(runbooks), series=Simulator.extra_series())
    for name, values in _series("a").items():
        replay.ingest(name, {"instance": "a", "model_name": "m", "engine": "0"}, values)
    sim = Simulator(replay, runbooks, config, engine_registry())
    changes, _ = sim.changes(runbooks["oom-pressure"], ("a", "m", "0"), 1400.0)
    # kv capacity = (30 + 1) * 10 // 30 = 10, half of it admitted; the budget halved
    assert [(c["knob"], c["before"], c["after"]) for c in changes] == [
        ("max_num_batched_tokens", 512, 256),
        ("max_num_seqs", 16, 5),
        ("autopilot", None, True),
    ]
