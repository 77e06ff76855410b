"""The hook on a real vLLM Scheduler (no engine): it changes no decision while
no knob is changed, its bookkeeping is exact, and the knobs, the tiered
policy and the autopilot act through the scheduler as they do in an engine.

These are the project's scheduler-level tests that `make compat` runs against
every vLLM version of the matrix (see docs/install.md).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
from vllm_runbook.collector.control import parse_command

from tests.scheduler.conftest import Step, build_scheduler, make_request, run_until_idle, step

# (id, prompt tokens, max output tokens, priority, arrival)
WORKLOAD = [
    ("a", 300, 40, 1, 0.0),
    ("b", 17, 45, 0, 0.1),
    ("c", 129, 30, 2, 0.2),
    ("d", 64, 50, 0, 0.3),
    ("e", 520, 20, 1, 0.4),
    ("f", 5, 60, 0, 0.5),
    ("g", 250, 35, 0, 0.6),
]


# Eight short prompts that grow to 8 blocks each in a cache of 30: preemptions.
GROWING = [(f"p{i}", 16 + i, 100, i % 3, 0.1 * i) for i in range(8)]


def drive(scheduler: Any, late: int = 3, workload: list[Any] = WORKLOAD) -> list[Step]:
    """The workload: four requests at once, the rest arriving one per step,
    one aborted mid-way; every step's decisions."""
    from vllm.v1.request import RequestStatus

    steps: list[Step] = []
    for spec in workload[:4]:
        scheduler.add_request(make_request(*spec))
    pending = list(workload[4:])
    while scheduler.has_unfinished_requests() or pending:
        if pending:
            scheduler.add_request(make_request(*pending.pop(0)))
        steps.append(step(scheduler))
        abort = workload[3][0]
        if len(steps) == late and abort in scheduler.requests:
            scheduler.finish_requests([abort], RequestStatus.FINISHED_ABORTED)
        assert len(steps) < 500
    return steps


@pytest.mark.parametrize(
    ("policy", "num_blocks", "prefix"),
    [("fcfs", 1000, False), ("priority", 1000, True), ("fcfs", 30, False), ("priority", 30, False)],
    ids=["fcfs", "priority-prefix-cache", "fcfs-preempting", "priority-preempting"],
)
def test_the_hook_changes_no_decision(
    model_dir: str, policy: str, num_blocks: int, prefix: bool
) -> None:
    kwargs: dict[str, Any] = {
        "policy": policy,
        "num_blocks": num_blocks,
        "enable_prefix_caching": prefix,
    }
    workload = GROWING if num_blocks == 30 else WORKLOAD
    plain = drive(build_scheduler(model_dir, hooked=False, **kwargs), workload=workload)
    hooked_scheduler = build_scheduler(model_dir, **kwargs)
    hooked = drive(hooked_scheduler, workload=workload)
    assert hooked == plain
    collector = hooked_scheduler.runbook_collector
    assert collector is not None and collector.enabled, collector and collector.error
    # The bookkeeping is exact: every step, every token scheduled, every preemption.
    stats = collector.stats
    assert stats.steps == len(plain)
    assert stats.scheduled_tokens == sum(sum(s.scheduled.values()) for s in plain)
    assert stats.preemptions == sum(len(s.preempted) for s in plain)
    if num_blocks == 30:
        assert stats.preemptions > 0  # the small cache does preempt


def test_bookkeeping_of_requests_and_tiers(model_dir: str) -> None:
    sched = build_scheduler(
        model_dir, max_num_seqs=2, env={"VLLM_RUNBOOK_TIER_BOUNDARIES": "32,256"}
    )
    for rid, n in (("hot", 10), ("warm", 100), ("cold", 300), ("hot2", 20)):
        sched.add_request(make_request(rid, n, max_tokens=2))
    collector = sched.runbook_collector
    counts = collector.queues.tier_counts()
    assert (counts.waiting, counts.running) == ([2, 1, 1], [0, 0, 0])
    first = step(sched)
    assert sorted(first.scheduled) == ["hot", "warm"]  # FCFS, two at a time
    counts = collector.queues.tier_counts()
    assert (counts.waiting, counts.running) == ([1, 0, 1], [1, 1, 0])
    steps = [first, *run_until_idle(sched)]
    assert collector.enabled, collector.error
    assert collector.stats.steps == len(steps)
    assert collector.requests.log.by_reason["length"] == 4  # every one ran to max_tokens
    counts = collector.queues.tier_counts()
    assert (counts.waiting, counts.running) == ([0, 0, 0], [0, 0, 0])


def apply(sched: Any, body: dict[str, Any]) -> Any:
    """A knob command applied between steps, as the agent does when the engine is idle."""
    return sched.runbook_collector.control.submit(parse_command(body))


def test_budget_knob_caps_the_next_step(model_dir: str) -> None:
    sched = build_scheduler(model_dir, max_num_batched_tokens=256)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 200, max_tokens=2))
    result = apply(sched, {"max_num_batched_tokens": 96})
    assert result.after.max_num_batched_tokens == 96
    first = step(sched)
    assert sum(first.scheduled.values()) == 96
    apply(sched, {"max_num_batched_tokens": 192})
    assert sum(step(sched).scheduled.values()) == 192
    apply(sched, {"max_num_batched_tokens": 512, "clamp": True})
    assert sched.max_num_scheduled_tokens == 256  # never above the startup value
    assert sched.runbook_collector.enabled


def test_admission_knob_limits_running_requests(model_dir: str) -> None:
    sched = build_scheduler(model_dir, max_num_seqs=8)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=30 + i))
    assert step(sched).running == 6
    assert apply(sched, {"max_num_seqs": 2}).after.max_num_seqs == 2
    for i in range(6, 10):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=5))
    # The six running drain (none preempted) and nothing is admitted until
    # fewer than two run; from then on exactly two run while requests wait.
    running = [s.running for s in run_until_idle(sched)]
    assert running[:5] == [6] * 5  # r0 finishes after 30 tokens
    drained = running.index(2)
    assert all(a >= b for a, b in itertools.pairwise(running[: drained + 1]))
    assert max(running[drained:]) == 2
    assert sched.runbook_collector.enabled


def test_quiet_steps_take_the_fast_path_until_a_part_wakes_them(model_dir: str) -> None:
    """A step with nothing for any part but the statistics takes the hook's
    fast path (engine_collector.py, `settle_quiet`); arrivals and first
    schedules are still counted there, and a command queued by another thread
    while the engine steps wakes it: applied before the next step, quiet again
    once its change has settled."""
    import threading

    sched = build_scheduler(model_dir, max_num_seqs=2)
    collector = sched.runbook_collector
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=40, arrival=0.1 * i))
    assert not collector.quiet  # the first step says how the warm-up went
    step(sched)
    assert collector.quiet
    # r2 waits for its first schedule: read lazily, the head that was
    # scheduled dropped by the reader, not by the steps.
    since = collector.requests.arrived["r2"]
    assert collector.requests.oldest_waiting_since == since
    for _ in range(45):  # r0 and r1 finish after 40 tokens, then r2 runs
        step(sched)
    assert collector.quiet and collector.requests.first_schedules == 3
    assert collector.requests.oldest_waiting_since is None
    assert not collector.requests.never_scheduled
    sched.add_request(make_request("late", 20, max_tokens=60))
    assert "late" in step(sched).scheduled and collector.quiet
    assert collector.requests.first_schedules == 4
    assert len(sched.running) == 2

    results: list[Any] = []
    command = parse_command({"max_num_seqs": 1})
    submitter = threading.Thread(
        target=lambda: results.append(collector.control.submit(command, idle=lambda: False))
    )
    submitter.start()
    for _ in range(500):
        if collector.control.pending:
            break
        time.sleep(0.01)
    assert not collector.quiet  # woken: its state first, then the flag
    step(sched)  # applied before this step's schedule()
    submitter.join(timeout=10)
    assert results[0].after.max_num_seqs == 1
    assert collector.changes.settling is not None and not collector.quiet  # 2 run, limit 1
    for s in run_until_idle(sched):
        if s.running <= 1 and collector.changes.settling is None:
            break
    step(sched)
    assert collector.quiet, "quiet again once the change settled"
    assert collector.enabled, collector.error


def test_tiered_policy_serves_the_hot_tier_first(model_dir: str) -> None:
    env = {"VLLM_RUNBOOK_TIER_BOUNDARIES": "32,256"}

    def first_admitted(policy_body: dict[str, Any] | None) -> list[str]:
        sched = build_scheduler(model_dir, max_num_seqs=1, env=env)
        if policy_body:
            apply(sched, policy_body)
        sched.add_request(make_request("cold", 300, max_tokens=1, arrival=1.0))
        sched.add_request(make_request("warm", 100, max_tokens=1, arrival=2.0))
        sched.add_request(make_request("hot", 10, max_tokens=1, arrival=3.0))
        order = []
        for s in run_until_idle(sched):
            order += [rid for rid in s.scheduled if rid not in order]
        assert sched.runbook_collector.enabled, sched.runbook_collector.error
        return order

    assert first_admitted(None) == ["cold", "warm", "hot"]
    assert first_admitted({"policy": "tiered"}) == ["hot", "warm", "cold"]


def test_policy_switch_keeps_every_request(model_dir: str) -> None:
    sched = build_scheduler(model_dir, max_num_seqs=1)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 40, max_tokens=2, priority=5 - i, arrival=i))
    step(sched)
    for body in ({"policy": "priority"}, {"policy": "tiered"}, {"policy": "fcfs"}):
        apply(sched, body)
        # Every unfinished request is queued or running exactly once.
        queued = [r.request_id for r in sched.waiting] + [r.request_id for r in sched.running]
        assert sorted(queued) == sorted(sched.requests)
        step(sched)
    for _ in run_until_idle(sched):
        pass
    collector = sched.runbook_collector
    assert collector.enabled and collector.requests.log.by_reason["length"] == 5
    assert not sched.requests


def test_autopilot_cuts_max_num_seqs_after_a_preemption(model_dir: str) -> None:
    sched = build_scheduler(
        model_dir,
        max_num_seqs=8,
        num_blocks=24,
        env={"VLLM_RUNBOOK_AUTOPILOT": "on"},
    )
    assert sched.runbook_collector.autopilot.enabled
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 30, max_tokens=60))
    for _ in range(200):
        s = step(sched)
        if s.preempted:
            break
    else:
        raise AssertionError("the small cache never preempted")
    limit = 8
    expected = max(1, min(math.floor(0.8 * min(s.running + len(s.preempted), limit)), limit - 1))
    assert sched.max_num_active_reqs == limit  # decided after the step ...
    step(sched)
    assert sched.max_num_active_reqs == expected  # ... applied at the next one
    assert sched.runbook_collector.autopilot.changes_down == 1
    assert sched.runbook_collector.enabled


def test_the_collector_fails_open_on_a_scheduler_it_does_not_know(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A future vLLM that renamed a field the collector reads at start (here
    the served model name): no collector, one log line, and the same
    decisions as vLLM's own class."""
    from vllm_runbook.collector import settings

    def renamed(cls: Any, vllm_config: Any) -> Any:
        raise AttributeError("'ModelConfig' object has no attribute 'served_model_name'")

    plain = drive(build_scheduler(model_dir, hooked=False))
    monkeypatch.setattr(settings.EngineIdentity, "of", classmethod(renamed))
    with caplog.at_level("ERROR", logger="vllm_runbook.collector"):
        sched = build_scheduler(model_dir)
    assert sched.runbook_collector is None
    assert [r.getMessage() for r in caplog.records if r.name == "vllm_runbook.collector"] == [
        "vllm-runbook: collector not started; the engine runs without it"
    ]
    assert drive(sched) == plain


def test_a_failing_step_disables_the_collector_not_the_scheduler(model_dir: str) -> None:
    plain = drive(build_scheduler(model_dir, hooked=False))
    sched = build_scheduler(model_dir)
    collector = sched.runbook_collector

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    collector.stats.on_update = broken
    assert drive(sched) == plain
    assert not collector.enabled and collector.error == "RuntimeError: boom"
