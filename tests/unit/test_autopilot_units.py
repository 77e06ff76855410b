"""The autopilot controller on a fake engine: a closed-loop workload over a
KV cache of fixed size, where each running sequence grows one token a step
and the latest admitted is preempted when the cache is full."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from vllm_runbook.collector.autopilot import (
    BAND,
    Autopilot,
    Decision,
    parse_switch,
    parse_target,
)

BLOCK = 32


@dataclass
class Seq:
    prompt: int
    output: int
    done: int = 0

    @property
    def blocks(self) -> int:
        return math.ceil((self.prompt + self.done) / BLOCK)


@dataclass
class FakeEngine:
    """`clients` closed-loop clients; prompts/outputs cycle through `lengths`."""

    blocks: int
    clients: int
    limit: int
    lengths: list[tuple[int, int]]
    running: list[Seq] = field(default_factory=list)
    waiting: list[Seq] = field(default_factory=list)
    step_no: int = 0
    preemptions: int = 0
    finished: int = 0
    _next: int = 0

    def __post_init__(self) -> None:
        self.waiting = [self._new() for _ in range(self.clients)]

    def _new(self) -> Seq:
        # Staggered start: a request enters with part of its output done, so
        # the cohort is spread over a lifetime like a steady closed loop.
        prompt, output = self.lengths[self._next % len(self.lengths)]
        self._next += 1
        return Seq(prompt, output)

    def used(self) -> int:
        return sum(s.blocks for s in self.running)

    def step(self, pilot: Autopilot | None) -> tuple[int, Decision | None]:
        if pilot is not None and pilot.pending is not None:
            self.limit = pilot.pending.limit
            pilot.pending = None
        usage = self.used() / self.blocks
        while self.waiting and len(self.running) < self.limit:
            seq = self.waiting.pop(0)
            if self.used() + seq.blocks > self.blocks:
                self.waiting.insert(0, seq)
                break
            self.running.append(seq)
        preempted = 0
        for seq in self.running:
            seq.done += 1
        while self.used() > self.blocks:
            victim = self.running.pop()
            victim.done = 0
            self.waiting.insert(0, victim)
            preempted += 1
        self.preemptions += preempted
        for seq in [s for s in self.running if s.done >= s.output]:
            self.running.remove(seq)
            self.finished += 1
            self.waiting.append(self._new())
            if pilot is not None:
                pilot.on_request_finished(seq.output, 1)
        self.step_no += 1
        decision = None
        if pilot is not None and pilot.enabled:
            decision = pilot.observe(
                self.step_no,
                self.limit,
                32,
                len(self.running),
                len(self.waiting),
                preempted,
                usage,
            )
        return preempted, decision


def run(engine: FakeEngine, pilot: Autopilot | None, steps: int) -> list[int]:
    limits = []
    for _ in range(steps):
        engine.step(pilot)
        limits.append(engine.limit)
    return limits


def best_static(blocks: int, lengths: list[tuple[int, int]], steps: int = 6000) -> int:
    """The highest limit without a preemption in the fake engine."""
    best = 1
    for limit in range(1, 33):
        eng = FakeEngine(blocks, 64, limit, lengths)
        run(eng, None, steps)
        if eng.preemptions == 0:
            best = limit
    return best


LONG = [(300 + 37 * i % 300, 300) for i in range(8)]
SHORT = [(40 + 7 * i % 40, 60) for i in range(8)]


def test_backs_off_under_preemption_then_settles_without_preempting() -> None:
    pilot = Autopilot()
    eng = FakeEngine(256, 64, 32, LONG)
    pilot.enable(32, 0)
    limits = run(eng, pilot, 4000)
    assert pilot.changes_down >= 1
    assert min(limits) < 32
    settled = eng.preemptions
    tail = run(eng, pilot, 6000)
    assert eng.preemptions - settled <= 2  # at most a failed probe or two
    assert max(tail) - min(tail) <= 2
    best = best_static(256, LONG)
    assert min(tail) >= best - 2, (best, min(tail))


def test_climbs_while_requests_wait_and_the_cache_has_room() -> None:
    pilot = Autopilot()
    eng = FakeEngine(256, 64, 2, SHORT)
    pilot.enable(2, 0)
    limits = run(eng, pilot, 3000)
    # Short requests fit 32 at once: it climbs all the way, never down, never above.
    assert limits[-1] == 32 and pilot.changes_up >= 2 and pilot.changes_down == 0
    assert all(b >= a for a, b in itertools.pairwise(limits))
    assert eng.preemptions == 0


def test_no_climb_when_nobody_waits() -> None:
    pilot = Autopilot()
    pilot.enable(4, 0)
    for step in range(1, 2000):
        assert pilot.observe(step, 4, 32, running=2, waiting=0, preempted=0, kv_usage=0.1) is None
    assert pilot.changes_up == 0


def test_never_below_one_nor_above_the_ceiling() -> None:
    pilot = Autopilot()
    pilot.enable(1, 0)
    assert pilot.observe(1, 1, 32, running=1, waiting=5, preempted=1, kv_usage=1.0) is None
    pilot.enable(30, 0)
    decisions = [
        pilot.observe(s, pilot.limit, 31, running=pilot.limit, waiting=9, preempted=0, kv_usage=0.1)
        for s in range(1, 20_000)
    ]
    assert max(d.limit for d in decisions if d) == 31


def test_a_failed_probe_steps_back_and_holds() -> None:
    pilot = Autopilot()
    pilot.enable(10, 0)
    epoch = pilot.epoch_length()
    step = 0
    decision = None
    while decision is None:
        step += 1
        decision = pilot.observe(step, 10, 32, running=10, waiting=4, preempted=0, kv_usage=0.6)
    assert decision == Decision(13, "room")  # 10 × 0.9 / 0.6 = 15: half way, rounded up
    pilot.pending = None
    step += 1
    back = pilot.observe(step, 13, 32, running=12, waiting=4, preempted=1, kv_usage=0.99)
    assert back == Decision(10, "failed probe")
    # Back in effect (10 running), a quiet cache does not tempt it above 10 for a while.
    for _ in range(3 * epoch):
        step += 1
        assert pilot.observe(step, 10, 32, running=10, waiting=4, preempted=0, kv_usage=0.5) is None


def test_a_peak_over_the_band_cuts_proportionally() -> None:
    pilot = Autopilot(target=0.8)
    assert pilot.high == pytest.approx(0.8 + BAND)
    pilot.enable(20, 0)
    decision = None
    step = 0
    while decision is None:
        step += 1
        decision = pilot.observe(step, 20, 32, running=20, waiting=0, preempted=0, kv_usage=0.96)
    assert decision == Decision(16, "peak over target")  # ⌊20 × 0.8 / 0.96⌋


def test_preemption_cut_is_a_fifth_of_what_ran() -> None:
    pilot = Autopilot()
    pilot.enable(32, 0)
    assert pilot.observe(1, 32, 32, running=29, waiting=30, preempted=1, kv_usage=1.0) == Decision(
        24, "preemption"
    )
    # Still draining (more running than the new limit): no second cut.
    assert pilot.observe(2, 24, 32, running=27, waiting=30, preempted=2, kv_usage=1.0) is None


def test_lifetime_sets_the_epoch() -> None:
    pilot = Autopilot()
    for _ in range(200):
        pilot.on_request_finished(300, 2)
    assert pilot.epoch_length() == 301  # EMA converges on 302 from below


@pytest.mark.parametrize("text", ["maybe", "", "2"])
def test_bad_switch(text: str) -> None:
    with pytest.raises(ValueError, match="on or off"):
        parse_switch(text)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, "nan", "x", True, None])
def test_bad_target(value: object) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        parse_target(value)


def test_good_values() -> None:
    assert parse_switch("ON") is True and parse_switch("off") is False
    assert parse_target("0.95") == 0.95 and parse_target(1) == 1.0


def test_settings_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    from vllm_runbook.collector.settings import CollectorSettings

    assert CollectorSettings.from_env({}).autopilot is False
    on = CollectorSettings.from_env(
        {"VLLM_RUNBOOK_AUTOPILOT": "on", "VLLM_RUNBOOK_AUTOPILOT_TARGET": "0.85"}
    )
    assert (on.autopilot, on.autopilot_target) == (True, 0.85)
    # A bad value leaves the autopilot off, not the collector unstarted.
    bad = CollectorSettings.from_env(
        {"VLLM_RUNBOOK_AUTOPILOT": "on", "VLLM_RUNBOOK_AUTOPILOT_TARGET": "2"}
    )
    assert (bad.autopilot, bad.autopilot_target) == (False, 0.9)
    assert "autopilot left off" in caplog.text and "got '2'" in caplog.text
