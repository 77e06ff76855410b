"""Shipped runbooks judged on a real CPU engine.

batch-too-large requires its error-rate guard: before any request finished
in the window it is refused before any change (and `runbook show --engine`
says why that guard cannot be read); once requests finish it runs, and its
verification reads the P99 end-to-end latency of the requests that finished
after the cap took effect.

A shipped runbook's guard trips: kv-hit-low caps
max_num_seqs at half of what the KV cache holds; under a steady stream of
requests that the engine served at the old concurrency, the cap makes the
queue grow, so the end-to-end P99 of the requests finished after the cap
took effect rises: the circuit breaker rolls the cap back and the journal
names the guard with its before and after.

The collector's clock is driven by the engine's steps (0.1 s a step) so the
latencies are a function of the workload, not of this machine's load."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from exec_harness import cli, cli_background
from vllm_runbook.runbooks.engine.sources import SOURCES
from vllm_runbook.runbooks.run.verification import IMPROVED, NO_CHANGE, WORSE, judge

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

WINDOW_S = 30
STEP_S = 0.1  # collector seconds per engine step
STARTUP = {
    "max_num_batched_tokens": 512,
    "max_num_seqs": 32,
    "policy": "fcfs",
    "autopilot": False,
    "autopilot_target": 0.9,
}
PROMPT, OUTPUT = 256, 64
EVERY = 3  # one new request every 3 steps: ~23 run at once, KV ~80 % full
PACE_S = 0.005


@pytest.fixture(scope="module")
def stream_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    saved = os.environ.get("VLLM_RUNBOOK_WINDOW_SECONDS")
    os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = str(WINDOW_S)
    try:
        eng = InProcessEngine.start(
            tiny_model, max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks_override=256
        )
    finally:
        if saved is None:
            os.environ.pop("VLLM_RUNBOOK_WINDOW_SECONDS", None)
        else:
            os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = saved
    yield eng
    eng.close()


class Stream:
    """A steady arrival stream: one request every EVERY steps, distinct prompts."""

    def __init__(self, engine: InProcessEngine, prefix: str = "s") -> None:
        self.engine = engine
        self.prefix = prefix
        self.sent = 0
        self.steps = 0

    def step(self) -> None:
        if self.steps % EVERY == 0:
            self.engine.add(
                f"{self.prefix}-{self.sent}", PROMPT, max_tokens=OUTPUT, offset=37 * self.sent
            )
            self.sent += 1
        self.steps += 1
        self.engine.step()
        time.sleep(PACE_S)


def knobs(engine: InProcessEngine) -> dict[str, Any]:
    url = str(engine.collector.server.url)
    return dict(httpx.get(url + "/v1/state", timeout=10).json()["knobs"])


def step_clock(engine: InProcessEngine) -> None:
    """The collector's clock advances STEP_S per engine step."""
    collector = engine.collector
    start = collector.wall_clock()
    first = collector.stats.steps
    collector.wall_clock = lambda: start + (collector.stats.steps - first) * STEP_S


def drain(engine: InProcessEngine) -> None:
    while engine.engine.has_unfinished_requests():
        engine.step()


def test_batch_too_large_refuses_before_any_change_while_its_required_guard_is_unreadable(
    stream_engine: InProcessEngine, db_url: str
) -> None:
    eng = stream_engine
    url = str(eng.collector.server.url)
    assert knobs(eng) == STARTUP
    step_clock(eng)
    stream = Stream(eng, "r")
    while stream.steps < 30:  # 10 requests in, none finished (each decodes 64 tokens)
        stream.step()
    assert not eng.finished
    no_finish = f"no request finished in the last {WINDOW_S} s"

    # runbook show --engine: each reading's value, source and window, or why not.
    done = cli("show", "batch-too-large", "--engine", url, "--json")
    assert done.returncode == 0, done.stderr
    live = json.loads(done.stdout)["live"]
    rows = {(r["role"], r["name"]): r for r in live["readings"]}
    pool = eng.scheduler.kv_cache_manager.block_pool
    usable, free = pool.num_gpu_blocks - 1, pool.get_num_free_blocks()
    running = len(eng.scheduler.running)
    assert running == 10
    assert rows[("check", "running")]["value"] == running
    assert rows[("check", "max_num_seqs")]["value"] == 32
    assert rows[("check", "kv_capacity")]["value"] == usable * running // (usable - free)
    for key in (("check", "p99_latency"), ("verification", "engine_e2e_latency_p99")):
        assert rows[key]["value"] is None and rows[key]["unavailable"] == no_finish
    guard = rows[("required guard", "error_rate")]
    assert (guard["value"], guard["unavailable"]) == (None, no_finish)
    assert (guard["source"], guard["window"]) == (
        SOURCES["error_rate"].source,
        SOURCES["error_rate"].window,
    )
    assert rows[("guard", "preemptions_per_minute")]["value"] == 0
    text = cli("show", "batch-too-large", "--engine", url)
    assert text.returncode == 0, text.stderr
    (line,) = [x for x in text.stdout.splitlines() if x.lstrip().startswith("required guard")]
    assert f"unavailable: {no_finish}" in line

    # runbook exec: refused before any change.
    done = cli("exec", "batch-too-large", "--engine", url, "--yes", "--json", "--db", db_url)
    assert done.returncode == 2, done.stderr
    execution = json.loads(done.stdout)["execution"]
    assert execution["status"] == "refused"
    assert execution["steps"] == []
    assert execution["checks"]["p99_latency"]["unavailable"] == no_finish
    assert f"required guard cannot be read on this engine: error_rate ({no_finish})" in json.dumps(
        execution
    )
    assert knobs(eng) == STARTUP
    drain(eng)


def test_kv_hit_low_rolls_back_when_its_latency_guard_gets_worse(
    stream_engine: InProcessEngine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eng = stream_engine
    url = str(eng.collector.server.url)
    assert knobs(eng) == STARTUP
    step_clock(eng)
    stream = Stream(eng)
    # Steady state, then a whole trailing window (300 steps) of it.
    while stream.steps < 400:
        stream.step()
    before_running = len(eng.scheduler.running)
    proc = cli_background(
        "exec",
        "kv-hit-low",
        "--engine",
        url,
        "--yes",
        "--json",
        "--db",
        db_url,
        "--verify-seconds",
        "90",
        "--poll-seconds",
        "0.25",
    )
    while proc.poll() is None:
        stream.step()
    out, err = proc.communicate()
    execution = json.loads(out)["execution"]
    (cap,) = execution["steps"]
    v = execution["verification"]
    guard = v["guards"]["engine_e2e_latency_p99"]
    with capsys.disabled():
        print(
            f"\n[guard] {before_running} running; max_num_seqs 32 → "
            f"{(cap.get('after') or {}).get('max_num_seqs')} at step {cap.get('applied_at_step')}"
            f", in effect from step {(v.get('measurement') or {}).get('effective_step')}; "
            f"p99 latency {guard['before']} → {guard['after']} ({guard['outcome']}); "
            f"kv_hit_ratio {v['before']} → {v['after']} ({v['outcome']}); "
            f"status {execution['status']}: {execution['error']}"
        )
    assert proc.returncode == 1, err
    assert execution["status"] == "rolled_back"
    assert (cap["action"], cap["status"]) == ("set_max_num_seqs", "reverted")
    assert cap["before"] == {"max_num_seqs": 32}
    assert guard["outcome"] == "worse"
    assert guard["after"] > 1.1 * guard["before"]
    assert execution["error"].startswith(
        "circuit breaker: guard engine_e2e_latency_p99 got worse ("
    )
    assert knobs(eng) == STARTUP  # the cap was rolled back on the engine
    # Let the stream drain so the module's engine is idle for the next test.
    while eng.engine.has_unfinished_requests():
        eng.step()


def test_batch_too_large_verifies_on_the_p99_of_requests_finished_after_the_cap(
    stream_engine: InProcessEngine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eng = stream_engine
    url = str(eng.collector.server.url)
    assert knobs(eng) == STARTUP
    step_clock(eng)
    stream = Stream(eng, "b")
    while stream.steps < 400:  # steady state, then a whole window of it
        stream.step()
    proc = cli_background(
        "exec",
        "batch-too-large",
        "--engine",
        url,
        "--yes",
        "--json",
        "--db",
        db_url,
        "--verify-seconds",
        "90",
        "--poll-seconds",
        "0.25",
    )
    while proc.poll() is None:
        stream.step()
    out, err = proc.communicate()
    execution = json.loads(out)["execution"]
    (cap,) = execution["steps"]
    v = execution["verification"]
    guards = v["guards"]
    with capsys.disabled():
        print(
            f"\n[batch] max_num_seqs 32 → {(cap.get('after') or {}).get('max_num_seqs')} "
            f"(kv_capacity {cap['params'].get('kv_capacity_seqs')}) at step "
            f"{cap.get('applied_at_step')}, in effect from step "
            f"{(v.get('measurement') or {}).get('effective_step')}; p99 latency "
            f"{v['before']} → {v['after']} ({v['outcome']}) over "
            f"{(v.get('measurement') or {}).get('requests_finished')} requests finished after; "
            + "; ".join(
                f"{g} {r['before']} → {r['after']} ({r['outcome']})" for g, r in guards.items()
            )
            + f"; status {execution['status']}"
        )
    assert cap["action"] == "set_max_num_seqs" and cap["before"] == {"max_num_seqs": 32}
    assert isinstance(v["before"], float) and v["before"] > 0
    assert isinstance(v["after"], float) and v["after"] > 0
    assert v["outcome"] in (IMPROVED, NO_CHANGE, WORSE)
    assert v["outcome"] == judge(v["before"], v["after"], "decrease", improve_by=0.2, tolerance=0.1)
    assert v["measurement"]["requests_finished"] > 0
    assert guards["error_rate"]["required"] is True
    assert (guards["error_rate"]["before"], guards["error_rate"]["after"]) == (0.0, 0.0)
    expected = {IMPROVED: ("succeeded", 0), NO_CHANGE: ("failed", 1), WORSE: ("rolled_back", 1)}
    tripped = any(r["outcome"] == WORSE for r in guards.values())
    if not tripped:
        assert (execution["status"], proc.returncode) == expected[v["outcome"]], err
    if execution["status"] == "rolled_back":
        assert knobs(eng) == STARTUP
    drain(eng)
