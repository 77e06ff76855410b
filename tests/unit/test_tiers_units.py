"""The tier configuration and the tiered queue without an engine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from vllm_runbook.collector.settings import CollectorSettings
from vllm_runbook.collector.tiers import (
    TierConfig,
    TierConfigError,
    TieredRequestQueue,
    prefill_chunk_cap,
    running_by_tier,
    scaled_limits,
)


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    priority: int = 0


def test_report_limits_scaled_to_max_num_seqs() -> None:
    assert scaled_limits(56) == (16, 32, 8)
    assert scaled_limits(256) == (73, 146, 37)
    assert scaled_limits(2) == (1, 1, 1)  # never 0: every tier can run something
    assert TierConfig().limits_for(56) == (16, 32, 8)
    assert TierConfig(limits=(2, 3, 4)).limits_for(56) == (2, 3, 4)


def test_tier_of_uses_half_open_boundaries() -> None:
    config = TierConfig()
    assert [config.tier_of(n) for n in (1, 255, 256, 1023, 1024, 9000)] == [0, 0, 1, 1, 2, 2]
    requests = [FakeRequest(str(n), n, 0.0) for n in (10, 300, 2000, 20, 5000)]
    assert running_by_tier(config.boundaries, requests) == [2, 1, 2]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VLLM_RUNBOOK_TIER_BOUNDARIES": "1024,256"}, "two increasing positive"),
        ({"VLLM_RUNBOOK_TIER_BOUNDARIES": "256"}, "two increasing positive"),
        ({"VLLM_RUNBOOK_TIER_BOUNDARIES": "a,b"}, "expected comma-separated numbers"),
        ({"VLLM_RUNBOOK_TIER_LIMITS": "16,0,8"}, "three integers >= 1"),
        ({"VLLM_RUNBOOK_TIER_SHARES": "0.5,0.5,0.5"}, "summing to 1"),
        ({"VLLM_RUNBOOK_TIER_AGING_SECONDS": "0"}, "positive number of seconds"),
        ({"VLLM_RUNBOOK_TIER_AGING_SECONDS": "soon"}, "expected seconds"),
    ],
)
def test_bad_tier_settings_are_refused_clearly(env: dict[str, str], message: str) -> None:
    with pytest.raises(TierConfigError, match=message):
        TierConfig.from_env(env)


def test_settings_from_env() -> None:
    settings = CollectorSettings.from_env(
        {"VLLM_RUNBOOK_POLICY": "Tiered", "VLLM_RUNBOOK_TIER_BOUNDARIES": "128, 2048"}
    )
    assert settings.policy == "tiered"
    assert settings.tiers.boundaries == (128, 2048)
    assert CollectorSettings.from_env({}).policy is None
    with pytest.raises(
        ValueError, match="VLLM_RUNBOOK_POLICY must be one of fcfs, priority, tiered"
    ):
        CollectorSettings.from_env({"VLLM_RUNBOOK_POLICY": "hrrn"})


def test_prefill_chunk_cap_lends_idle_shares() -> None:
    shares = (0.40, 0.45, 0.15)
    assert prefill_chunk_cap(1000, shares, (True, True, True), 256) == 600
    assert prefill_chunk_cap(1000, shares, (True, False, True), 256) == 272  # 1 - 0.40/0.55
    assert prefill_chunk_cap(1000, shares, (True, False, False), 256) == 256  # floor: a hot prompt
    assert prefill_chunk_cap(100, shares, (True, False, False), 256) == 100


def _queue(clock: list[float]) -> TieredRequestQueue:
    return TieredRequestQueue(
        TierConfig(aging_seconds=10.0), lambda: clock[0], lambda r: r.arrival_time
    )


def test_queue_orders_by_priority_tier_arrival_and_ages() -> None:
    clock = [0.0]
    queue = _queue(clock)
    for rid, n, t, p in [
        ("c0", 2000, 0.0, 0),
        ("w0", 500, 1.0, 0),
        ("h0", 10, 2.0, 0),
        ("c9", 3000, 3.0, -1),
    ]:
        queue.add_request(FakeRequest(rid, n, t, p))
    assert [r.request_id for r in queue] == ["c9", "h0", "w0", "c0"]
    clock[0] = 9.0
    assert [r.request_id for r in queue] == ["c9", "h0", "w0", "c0"]  # nothing aged yet
    clock[0] = 12.0  # w0 waited 11 s: hot, and arrived before h0; c0 12 s: warm
    assert [r.request_id for r in queue] == ["c9", "w0", "h0", "c0"]
    clock[0] = 20.0  # c0 waited 20 s: hot, and it arrived first
    assert [r.request_id for r in queue] == ["c9", "c0", "w0", "h0"]
    assert [queue.pop_request().request_id for _ in range(4)] == ["c9", "c0", "w0", "h0"]
    assert not queue and len(queue) == 0


def test_queue_limits_apply_only_inside_a_step() -> None:
    clock = [0.0]
    queue = _queue(clock)
    for rid, n, t in [("h0", 10, 0.0), ("h1", 10, 1.0), ("c0", 2000, 2.0), ("c1", 2000, 3.0)]:
        queue.add_request(FakeRequest(rid, n, t))
    running = [1, 0, 0]
    queue.begin_step(0.0, running, (1, 1, 1))
    assert queue.peek_request().request_id == "c0"  # the hot tier is full while c0 waits
    assert queue.pop_request().request_id == "c0"
    assert running == [1, 0, 1]
    assert not queue  # both full, each while the other waits: vLLM stops admitting
    assert len(queue) == 3
    queue.end_step()
    assert queue and queue.peek_request().request_id == "h0"


def test_queue_lends_slots_when_no_other_tier_waits_but_keeps_the_hot_ones() -> None:
    clock = [0.0]
    queue = _queue(clock)
    for i in range(5):
        queue.add_request(FakeRequest(f"c{i}", 2000, float(i)))
    running = [0, 0, 5]
    # 10 slots, 3 of them the hot tier's: the cold tier borrows up to 7.
    queue.begin_step(0.0, running, (3, 3, 1), max_active=10)
    assert [queue.pop_request().request_id for _ in range(2)] == ["c0", "c1"]
    assert running == [0, 0, 7]
    assert not queue  # c2 would take a free hot slot
    queue.end_step()
    running = [2, 0, 7]  # two hot requests run: one hot slot is free
    queue.begin_step(0.0, running, (3, 3, 1), max_active=10)
    assert not queue
    queue.end_step()
    running = [3, 0, 6]  # all hot slots taken, one slot free: nothing to keep
    queue.begin_step(0.0, running, (3, 3, 1), max_active=10)
    assert queue.peek_request().request_id == "c2"
    assert queue.pop_request().request_id == "c2"
    assert not queue  # 10 of 10
    queue.end_step()
    queue.begin_step(0.0, [3, 0, 7], (3, 3, 1), max_active=0)  # no reserve given
    assert queue.pop_request().request_id == "c3"


def test_a_skipped_request_given_back_does_not_count_as_running() -> None:
    clock = [0.0]
    queue = _queue(clock)
    h0 = FakeRequest("h0", 10, 0.0)
    queue.add_request(h0)
    queue.add_request(FakeRequest("c0", 2000, 1.0))
    running = [0, 0, 0]
    queue.begin_step(0.0, running, (1, 1, 1))
    skipped = queue.pop_request()
    assert skipped is h0 and running == [1, 0, 0]
    queue.prepend_requests([skipped])
    assert running == [0, 0, 0] and len(queue) == 2
    queue.remove_requests([h0])
    assert [r.request_id for r in queue] == ["c0"]
