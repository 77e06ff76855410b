"""The tier configuration and the tiered queue without an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_runbook.collector.settings import CollectorSettings
from vllm_runbook.collector.tiers import (
    ON_DEADLINE_KEY,
    TierConfig,
    TierConfigError,
    TieredRequestQueue,
    prefill_chunk_cap,
    running_by_tier,
    running_demand,
    scaled_limits,
    tier_quotas,
)


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    priority: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    extra_args: dict[str, Any] | None = None
    sampling_params: Any = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_params = SimpleNamespace(extra_args=self.extra_args)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_prompt_tokens


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
        ({"VLLM_RUNBOOK_TIER_DEADLINES": "0.1,0"}, "three positive seconds or none"),
        ({"VLLM_RUNBOOK_TIER_DEADLINES": "0.1,-1,none"}, "three positive seconds or none"),
        ({"VLLM_RUNBOOK_TIER_DEADLINES": "fast,1,none"}, "expected comma-separated numbers"),
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
    assert settings.tiers.deadlines == (0.1, 1.0, None)  # the report's, by default
    assert TierConfig.from_env({"VLLM_RUNBOOK_TIER_DEADLINES": "0.2, none, 30"}).deadlines == (
        0.2,
        None,
        30.0,
    )
    assert TierConfig.from_env({"VLLM_RUNBOOK_TIER_DEADLINES": "off,off,off"}).deadlines == (
        None,
        None,
        None,
    )
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


SHARES = (0.40, 0.45, 0.15)


def test_tier_quotas_split_the_budget_by_share_and_lend_what_a_tier_cannot_use() -> None:
    # Every tier wants more than the budget: 40 / 45 / 15 % exactly.
    assert tier_quotas(1000, SHARES, (5000, 5000, 5000)) == [400, 450, 150]
    # 2048 x (0.4, 0.45, 0.15) = 819.2, 921.6, 307.2: the spare token to the
    # largest remainder (warm).
    assert tier_quotas(2048, SHARES, (9999, 9999, 9999)) == [819, 922, 307]
    # Hot wants 30 of its 400: the other 370 split 45:15 between warm and cold
    # (970 x 0.75 = 727.5, x 0.25 = 242.5; the tie to the hotter tier).
    assert tier_quotas(1000, SHARES, (30, 5000, 5000)) == [30, 728, 242]
    # An idle warm tier lends its share: hot 30 of 372, cold the rest.
    assert tier_quotas(512, SHARES, (30, 0, 1000)) == [30, 0, 482]
    # Hot and warm want less than theirs: cold takes what is left.
    assert tier_quotas(512, SHARES, (30, 100, 1500)) == [30, 100, 382]
    # One tier alone: the whole budget; less demand than budget: the demand.
    assert tier_quotas(512, SHARES, (0, 0, 800)) == [0, 0, 512]
    assert tier_quotas(100, SHARES, (10, 10, 10)) == [10, 10, 10]
    assert tier_quotas(100, SHARES, (0, 0, 0)) == [0, 0, 0]


def test_running_demand_sums_what_each_tier_still_computes() -> None:
    decoding = FakeRequest("h0", 30, 0.0, num_computed_tokens=29)  # one token: a decode
    prefilling = FakeRequest("c0", 1500, 0.0, num_computed_tokens=512)
    warm = FakeRequest("w0", 300, 0.0, num_computed_tokens=299)
    running = [decoding, prefilling, warm]
    tiers = [0, 2, 1]
    assert running_demand(tiers, running) == [1, 1, 988]


def test_chunked_shares_offer_only_tiers_with_budget_left() -> None:
    clock = [0.0]
    queue = _queue(clock)
    for rid, n, t in [("h0", 30, 0.0), ("w0", 300, 1.0), ("c0", 2000, 2.0)]:
        queue.add_request(FakeRequest(rid, n, t))
    assert queue.tier_tokens() == [30, 300, 2000]
    queue.begin_step(0.0, [0, 0, 0], (4, 4, 4))
    assert queue.demand(512) == [30, 300, 512]  # at most the budget each
    left = tier_quotas(512, SHARES, queue.demand(512))
    assert left == [30, 300, 182]
    queue.set_quotas(left, chunked=True)
    left[0] = 0  # the hot tier's quota was spent by the scheduler (the ledger)
    assert queue.peek_request().request_id == "w0"
    left[1] = 0
    assert queue.peek_request().request_id == "c0"
    left[2] = 0
    assert not queue  # every share spent: vLLM stops admitting this step
    queue.end_step()
    assert queue.peek_request().request_id == "h0"  # outside a step: plain order


def test_without_chunked_prefill_tiers_admit_whole_prompts_by_deficit_round_robin() -> None:
    """Budget 2,048 a step, hot prompts of 100 and cold ones of 1,500 always
    waiting (vLLM without chunked prefill schedules a prompt whole or stops).
    The quotas are 1,489 / 559 (shares 0.40 : 0.15 of 2,048); the cold tier
    saves its 559 a step and, with 1,500, goes first in the third step; the
    hot tier fills the rest. Over 12 steps the prompt tokens split 18,000 :
    6,000 (75 : 25; the shares say 73 : 27, whole prompts cannot split finer)."""
    clock = [0.0]
    queue = _queue(clock)
    for i in range(400):
        queue.add_request(FakeRequest(f"h{i}", 100, float(i)))
    for i in range(6):
        queue.add_request(FakeRequest(f"c{i}", 1500, float(i)))
    admitted: list[str] = []
    tokens = [0, 0, 0]
    for _ in range(12):
        queue.begin_step(0.0, [0, 0, 0], (999, 999, 999))
        quotas = tier_quotas(2048, SHARES, queue.demand(2048))
        assert quotas == [1489, 0, 559]
        queue.set_quotas(quotas, chunked=False)
        budget, step = 2048, ""
        while queue and budget > 0:
            request = queue.peek_request()
            if request.num_tokens > budget:
                break  # what vLLM does without chunked prefill
            queue.pop_request()
            budget -= request.num_tokens
            tokens[0 if request.request_id[0] == "h" else 2] += request.num_tokens
            step += request.request_id[0]
        queue.end_step()
        admitted.append(step)
    # 20 hot (2,000 tokens) or one cold and 5 hot (2,000) per step.
    assert admitted == ["h" * 20, "h" * 20, "c" + "h" * 5] * 4
    assert tokens == [18_000, 0, 6_000]


def _deadline_queue(clock: list[float]) -> TieredRequestQueue:
    config = TierConfig(aging_seconds=10.0, deadlines=(0.1, 1.0, None))
    return TieredRequestQueue(config, lambda: clock[0], lambda r: r.arrival_time)


def test_deadlines_demote_one_tier_or_abort_where_the_client_asked() -> None:
    clock = [0.0]
    queue = _deadline_queue(clock)
    abort = {ON_DEADLINE_KEY: "abort"}
    for rid, n, t, args in [
        ("h0", 10, 0.00, None),
        ("h1", 10, 0.05, abort),
        ("w0", 500, 0.00, None),
        ("c0", 2000, 0.00, abort),  # cold has no deadline
        ("h2", 10, 0.09, None),
    ]:
        queue.add_request(FakeRequest(rid, n, t, extra_args=args))
    clock[0] = 0.12  # h0 waited 0.12 s (> 0.1): demoted; h1, h2 not yet
    expired = queue.expire(clock[0])
    assert [(e.request.request_id, e.tier, e.aborted) for e in expired] == [("h0", 0, False)]
    assert queue.tier_counts() == [2, 2, 1]
    clock[0] = 0.2  # h1 (asked for an abort) and h2 past 0.1 s
    expired = queue.expire(clock[0])
    assert [(e.request.request_id, e.tier, e.aborted) for e in expired] == [
        ("h1", 0, True),
        ("h2", 0, False),
    ]
    assert [round(e.waited, 2) for e in expired] == [0.15, 0.11]
    assert queue.tier_counts() == [0, 3, 1]  # h1 removed (the caller aborts it)
    # In the warm tier by arrival (w0 and h0 both at 0.0: w0 was queued first).
    assert [r.request_id for r in queue] == ["w0", "h0", "h2", "c0"]
    clock[0] = 1.05  # warm's deadline from arrival: h0 and w0 demoted to cold
    expired = queue.expire(clock[0])
    assert sorted(e.request.request_id for e in expired) == ["h0", "w0"]
    assert queue.tier_counts() == [0, 1, 3]
    clock[0] = 2.0  # h2 past warm's deadline too; cold has none: nothing else moves
    assert [(e.request.request_id, e.tier) for e in queue.expire(clock[0])] == [("h2", 1)]
    assert queue.tier_counts() == [0, 0, 4]
    clock[0] = 500.0
    assert queue.expire(clock[0]) == []
    # Aging still works against starvation: after 20 s (two periods of 10 s)
    # the demoted requests compete as hot ones again, in arrival order.
    assert [r.request_id for r in queue] == ["c0", "w0", "h0", "h2"]


def test_an_admitted_or_preempted_request_has_no_deadline() -> None:
    clock = [0.0]
    queue = _deadline_queue(clock)
    h0, h1 = FakeRequest("h0", 10, 0.0), FakeRequest("h1", 10, 0.0)
    queue.add_request(h0)
    queue.add_request(h1)
    assert queue.pop_request() is h0  # admitted before its deadline
    preempted = FakeRequest("h9", 10, 0.0, num_preemptions=1)
    queue.add_request(preempted)
    clock[0] = 5.0
    assert [e.request.request_id for e in queue.expire(clock[0])] == ["h1"]
    assert queue.tier_counts() == [1, 1, 0]  # h9 stays hot; h1 went warm
