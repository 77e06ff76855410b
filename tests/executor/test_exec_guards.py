"""A shipped runbook's guard trips on a real CPU engine: kv-hit-low caps
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
from exec_harness import cli_background

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

WINDOW_S = 30
STEP_S = 0.1  # collector seconds per engine step
STARTUP = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "policy": "fcfs"}
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

    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self.sent = 0
        self.steps = 0

    def step(self) -> None:
        if self.steps % EVERY == 0:
            self.engine.add(f"s-{self.sent}", PROMPT, max_tokens=OUTPUT, offset=37 * self.sent)
            self.sent += 1
        self.steps += 1
        self.engine.step()
        time.sleep(PACE_S)


def knobs(engine: InProcessEngine) -> dict[str, Any]:
    url = str(engine.collector.server.url)
    return dict(httpx.get(url + "/v1/state", timeout=10).json()["knobs"])


def test_kv_hit_low_rolls_back_when_its_latency_guard_gets_worse(
    stream_engine: InProcessEngine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eng = stream_engine
    url = str(eng.collector.server.url)
    assert knobs(eng) == STARTUP
    collector = eng.collector
    start = collector.wall_clock()
    collector.wall_clock = lambda: start + collector.steps * STEP_S
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
    guard = v["guards"]["p99_latency_seconds"]
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
    assert execution["error"].startswith("circuit breaker: guard p99_latency_seconds got worse (")
    assert knobs(eng) == STARTUP  # the cap was rolled back on the engine
    # Let the stream drain so the module's engine is idle for the next test.
    while eng.engine.has_unfinished_requests():
        eng.step()
