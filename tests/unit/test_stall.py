"""The collector's stall reasons (collector/stall.py) from the step stamps, on a
fake clock: each reason at its exact threshold, and none for an idle engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.stall import ADMISSION_FACTOR, HUNG_FACTOR, StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(
    waiting: int = 0, running: int = 0, free: int = 90, usable: int = 100
) -> tuple[StallWatch, Any, Any, Clock]:
    clock = Clock()
    sched = SimpleNamespace(waiting=[0] * waiting, kv_holding_waiting=[], running=[0] * running)
    stats = SimpleNamespace(
        steps=0,
        updates=0,
        scheduled_at=0.0,
        updated_at=0.0,
        admitted_at=0.0,
        queue_empty_at=0.0,
        step_seconds_usual=0.0,
        usable_blocks=usable,
        block_pool=SimpleNamespace(get_num_free_blocks=lambda: free),
    )
    return StallWatch(sched, stats, stall_seconds=10.0, clock=clock), sched, stats, clock  # type: ignore[arg-type]


def step(stats: Any, clock: Clock, seconds: float = 0.01, returned: bool = True) -> None:
    stats.steps += 1
    stats.scheduled_at = clock.now
    clock.now += seconds
    if returned:
        stats.updates += 1
        stats.updated_at = clock.now


def test_idle_engine_is_never_stalled() -> None:
    w, _, stats, clock = watch()
    step(stats, clock)
    clock.now += 3600
    assert w.reason() is None
    assert w.last_step_age() == pytest.approx(3600)


def test_no_steps_while_requests_wait() -> None:
    w, _, stats, clock = watch(waiting=3)
    step(stats, clock)
    clock.now += 10.0
    assert w.reason() is None  # at the threshold: not yet
    clock.now += 0.001
    assert w.reason() == "no_steps"
    samples = {(s.spec.name, s.extra_labels): s.value for s in w.samples()}
    assert samples[(M.ENGINE_STALLED.name, ())] == 1.0
    assert samples[(M.ENGINE_STALL_REASON.name, ("no_steps",))] == 1.0
    assert samples[(M.ENGINE_STALL_REASON.name, ("step_hung",))] == 0.0


def test_a_step_that_does_not_come_back() -> None:
    w, _, stats, clock = watch(running=2)
    stats.step_seconds_usual = 1.0  # slow steps: 20 s before a step counts as hung
    step(stats, clock, returned=False)
    clock.now += 15.0
    assert w.reason() is None  # past stall_seconds, within 20 x the usual step
    clock.now = stats.scheduled_at + HUNG_FACTOR * 1.0 + 0.001
    assert w.reason() == "step_hung"


def test_nothing_admitted_while_kv_is_free() -> None:
    w, _, stats, clock = watch(waiting=2, running=1)
    stats.admitted_at = clock.now
    for _ in range(int(ADMISSION_FACTOR * 10.0 / 0.5)):
        step(stats, clock, seconds=0.5)  # decode steps go on; nothing new admitted
    assert w.reason() is None
    step(stats, clock, seconds=0.5)
    assert w.reason() == "admission_stalled"


def test_no_admission_with_a_full_cache_is_not_a_deadlock() -> None:
    w, _, stats, clock = watch(waiting=2, running=1, free=5)
    for _ in range(100):
        step(stats, clock, seconds=0.5)
    assert w.reason() is None
