"""The service-wide circuit breaker on a real CPU engine.

The change: the `restore` runbook puts max_num_seqs back to its startup value
(32) after an operator capped it at 8. Under short prompts the KV cache holds
32 sequences: nothing is preempted and the breaker stays silent. Under long
prompts it holds about 21: raising the cap starts a preemption storm, the
breaker trips on the preemptions per finished request, reverts the restore
(max_num_seqs back to 8), journals the measurements and counts the trip.

The other way round: a storm at 32 sequences, then oom-pressure's fix (the
budget halved, max_num_seqs cut to 24, just above what the cache holds, the
autopilot handed over). Its residual preemptions are above the absolute 1 %
but far below the storm's rate before it: the breaker does not roll the fix
back into the storm."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.runbooks.engine.client import EngineClient
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.model.config import BreakerConfig
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.service.breaker import BREAKER_WHO, PREEMPTION_RATE, REASONS, Breaker
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import Journal

from tests.catalogs import catalog_with
from tests.engines import InProcessEngine, while_stepping

pytestmark = pytest.mark.engine

# 256 blocks of 32 tokens. Long: 256 + 128 tokens = 12 blocks a request, so
# 32 running need 384 blocks (a storm) and 8 need 96. Short: 32 + 16 tokens,
# 2 blocks a request: 32 running need 64.
LONG, SHORT = (256, 128), (32, 16)
# 512 + 256 tokens = 24 blocks a request: the cache holds 10 of them, and
# few finish per second (the breaker's first judgement sees the cap's residue).
LONGER = (512, 256)
CONFIG = BreakerConfig(min_finished=10, interval="1s")
REQUEST_IDS = itertools.count()  # one engine for the module: ids never repeat


@pytest.fixture(scope="module")
def breaker_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(
        tiny_model, max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks_override=256
    )
    yield eng
    eng.close()


# oom-pressure's shape with fixed values: the cut lands just above what the
# cache holds of LONGER (10), so some preemptions remain until the autopilot
# cuts further.
OOM_FIX_STEPS = [
    {"action": "scale_max_num_batched_tokens", "params": {"factor": 0.5}},
    {"action": "set_max_num_seqs", "params": {"value": 12}},
    {"action": "set_autopilot", "params": {"enabled": True}},
]


class Setup:
    def __init__(self, engine: InProcessEngine, store: Journal, catalog: Path) -> None:
        self.engine = engine
        self.url = str(engine.collector.server.url)
        self.client = EngineClient(self.url)
        self.store = store
        self.executor = Executor(
            store, load_catalog([catalog], registry=engine_registry()), engine_registry()
        )
        self.ids: list[str] = []
        self.metrics = ServiceMetrics(engine_names={self.client.url: "e0"})
        self.breaker = Breaker(store, self.executor, CONFIG, on_trip=self.metrics.breaker_tripped)

    def add(self, n: int, shape: tuple[int, int]) -> None:
        for _ in range(n):
            i = next(REQUEST_IDS)
            self.ids.append(f"b{i}")
            self.engine.add(f"b{i}", shape[0], max_tokens=shape[1], offset=41 * i)

    def in_thread(self, fn: Any) -> Any:
        """Run `fn` (which talks to the agent) while the engine steps."""
        out: list[Any] = []
        thread = threading.Thread(target=lambda: out.append(fn()))
        thread.start()
        while_stepping(self.engine, thread)
        thread.join()
        return out[0]

    def trips(self, reason: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "vllm_runbook_service_breaker_trips_total", {"engine": "e0", "reason": reason}
        )

    def cap_then_restore(self, shape: tuple[int, int]) -> int:
        """Load the engine, cap max_num_seqs at 8 (an operator), then run `restore`."""
        self.add(40, shape)
        self.in_thread(lambda: self.client.set_knobs(max_num_seqs=8))
        for _ in range(20):
            self.engine.step()
        result = self.in_thread(lambda: self.executor.execute("restore", self.url, approved=True))
        assert result.record.status == "succeeded"
        assert self.client.state().knobs.max_num_seqs == 32
        return int(result.record.id)


@pytest.fixture
def setup(breaker_engine: InProcessEngine, store: Journal, tmp_path: Path) -> Iterator[Setup]:
    s = Setup(breaker_engine, store, catalog_with(tmp_path, "oom-pressure", steps=OOM_FIX_STEPS))
    yield s
    # What is left is not the next test's: abort it rather than serve it.
    breaker_engine.engine.abort_request([i for i in s.ids if i not in breaker_engine.finished])
    while breaker_engine.engine.has_unfinished_requests():
        breaker_engine.step()
    s.client.restore()


def test_a_change_that_starts_no_storm_leaves_the_breaker_silent(setup: Setup) -> None:
    preempted = setup.client.state().stats.preemptions_total
    setup.cap_then_restore(SHORT)
    while setup.engine.engine.has_unfinished_requests():
        setup.engine.step()
    assert setup.client.state().stats.preemptions_total == preempted  # no storm
    assert setup.in_thread(setup.breaker.tick) == []
    (change,) = setup.breaker.newest_changes().values()  # watched, judged fine
    m = setup.breaker.measure(change)
    assert m is not None and m.preemptions == 0 and m.finished > 0
    assert setup.client.state().knobs.max_num_seqs == 32
    assert [setup.trips(r) for r in REASONS] == [0.0, 0.0, 0.0]
    assert setup.store.list_executions(who=BREAKER_WHO) == []


def test_a_preemption_storm_trips_the_breaker_and_the_change_is_rolled_back(
    setup: Setup,
) -> None:
    preempted = setup.client.state().stats.preemptions_total
    original = setup.cap_then_restore(LONG)
    trips: list[Any] = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not trips and time.monotonic() < deadline:
            trips.extend(setup.breaker.tick())
            time.sleep(0.2)

    thread = threading.Thread(target=watch)
    thread.start()
    while thread.is_alive():
        if setup.engine.engine.has_unfinished_requests():
            setup.engine.step()
        else:
            time.sleep(0.01)
    thread.join()
    [(change, trip)] = trips
    assert (change.execution_id, change.before, change.after) == (
        original,
        {"max_num_seqs": 8},
        {"max_num_seqs": 32},
    )
    assert trip.reason == PREEMPTION_RATE
    assert setup.client.state().stats.preemptions_total > preempted  # the storm was real
    assert setup.client.state().knobs.max_num_seqs == 8  # rolled back
    assert setup.store.get_execution(original).status == "reverted"
    [revert] = setup.store.list_executions(who=BREAKER_WHO)
    assert (revert.reverts_id, revert.status) == (original, "succeeded")
    assert revert.verification is not None
    measured = revert.verification["breaker"]["measurement"]
    assert measured["preemptions"] >= 1
    assert measured["preemptions"] / max(measured["requests_finished"], 10) > 0.01
    assert revert.verification["breaker"]["why"].startswith(
        f"circuit breaker: {measured['preemptions']} preemptions per "
        f"{measured['requests_finished']} finished requests"
    )
    assert [setup.trips(r) for r in REASONS] == [1.0, 0.0, 0.0]


def test_oom_pressures_fix_is_not_rolled_back_into_the_storm_it_stopped(setup: Setup) -> None:
    from vllm_runbook.runbooks.service.breaker import judge

    def loaded_while(alive: Any) -> None:
        """Step with 40 long requests in flight (a closed loop) while `alive()`."""
        while alive():
            unfinished = sum(1 for i in setup.ids if i not in setup.engine.finished)
            setup.add(max(0, 40 - unfinished), LONGER)
            setup.engine.step()

    # The storm: 40 long requests at 32 sequences (768 blocks wanted, 256 there).
    # At least 8 s of it (the history the fix is compared with), and until it
    # preempted: a loaded machine steps slower, and the cache fills later.
    start = setup.client.state().stats.preemptions_total
    storm_end = time.monotonic() + 8
    give_up = time.monotonic() + 120
    preempted = {"at": 0.0, "seen": False}

    def storming() -> bool:
        now = time.monotonic()
        if not preempted["seen"] and now - preempted["at"] >= 1.0:
            preempted["at"] = now
            preempted["seen"] = setup.client.state().stats.preemptions_total > start
        return now < give_up and (now < storm_end or not preempted["seen"])

    loaded_while(storming)
    assert setup.client.state().stats.preemptions_total > start  # the storm is real
    # The fix lands between steps, and the engine steps until its cap is in
    # effect (the running above it drained); then it waits while the fix
    # verifies, so the cap's residue (it is above what the cache holds) comes
    # in the breaker's watch, not in the verification's.
    fixed: list[Any] = []
    run = threading.Thread(
        target=lambda: fixed.append(
            setup.executor.execute(
                "oom-pressure", setup.url, approved=True, condition_seconds=0, verify_seconds=3
            )
        )
    )
    run.start()
    scheduler, control = setup.engine.scheduler, setup.engine.collector.control
    while run.is_alive():
        draining = len(scheduler.running) > scheduler.max_num_active_reqs
        if control.pending or draining:
            setup.engine.step()
        else:
            time.sleep(0.005)
    [fix] = fixed
    assert fix.record.status == "succeeded", json.dumps(fix.record.verification, default=str)
    knobs = setup.client.state().knobs
    assert (knobs.max_num_batched_tokens, knobs.autopilot) == (256, True)
    judged: list[Any] = []

    def watch() -> None:
        # Tick until the fix's after-window holds its residue and the breaker's
        # minimum of finished requests (a judgement on a full denominator).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            judged.extend(setup.breaker.tick())
            changes = list(setup.breaker.newest_changes().values())
            m = setup.breaker.measure(changes[0]) if changes else None
            if m is None or (m.finished >= CONFIG.min_finished and m.preemptions > 0):
                judged.append(m)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch)
    thread.start()
    loaded_while(thread.is_alive)
    thread.join()
    *trips, m = judged
    assert trips == [] and m is not None  # no trip: the fix is still watched
    assert m.before is not None and m.before.preemptions > 0
    before_rate = m.before.preemptions / max(m.before.finished, CONFIG.min_finished)
    after_rate = m.preemptions / max(m.finished, CONFIG.min_finished)
    # What it measured: residual preemptions, over the absolute limit, far
    # below the storm's rate before the fix (an absolute breaker would trip).
    print(f"breaker: before {before_rate:.2%} ({m.before}), after {after_rate:.2%} ({m})")
    assert CONFIG.preemption_rate < after_rate < before_rate / 2, (m, before_rate, after_rate)
    assert judge(m, CONFIG) is not None
    assert setup.store.get_execution(fix.record.id).status == "succeeded"
    assert setup.store.list_executions(who=BREAKER_WHO) == []
    assert setup.client.state().knobs.max_num_batched_tokens == 256
    assert [setup.trips(r) for r in REASONS] == [0.0, 0.0, 0.0]
