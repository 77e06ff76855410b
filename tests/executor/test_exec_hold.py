"""The revert's hold and the judge of reverts (runbooks/run/hold.py), against the
fake agent: a fix holds while its cause does, reverts once the cause is gone
for the hold time, a finding back inside the watch re-applies what held, and
no knob turns round a third time within the hour without a person."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.hold import Holds, hold_on_resolve, premature_revert, reapply
from vllm_runbook.runbooks.service.notify import events_of
from vllm_runbook.runbooks.store import ExecutionRecord, Journal
from vllm_runbook.runbooks.store.models import utcnow

from tests.fake_agent import PRESSURE, STARTUP, URL, Clock, FakeAgent

CALM = {**PRESSURE, "oldest_waiting": 0.5, "requests_waiting": 0}
STARVING = {**PRESSURE, "oldest_waiting": 30.0}


class Later:
    """utcnow() moved on by `seconds` (the hold's clock)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> datetime:
        return utcnow() + timedelta(seconds=self.seconds)


@pytest.fixture
def make(store: Journal) -> Iterator[Callable[..., tuple[Executor, FakeAgent]]]:
    def build(agent: FakeAgent) -> tuple[Executor, FakeAgent]:
        clock = Clock()
        executor = Executor(
            store,
            load_catalog(registry=engine_registry()),
            engine_registry(),
            client_factory=lambda url: agent,  # type: ignore[arg-type,return-value]
            poll_seconds=1.0,
            sleep=clock.sleep,
            clock=clock,
        )
        return executor, agent

    yield build


def switched(executor: Executor, starts: datetime, fingerprint: str = "abc") -> ExecutionRecord:
    """latency-spike's FCFS switch for an alert episode (kept: the fake's
    starving requests are not scheduled, so its verification says no change)."""
    result = executor.execute(
        "latency-spike",
        URL,
        trigger="alert",
        who="rules:VllmRequestStarvation",
        alert_fingerprint=fingerprint,
        alert_starts_at=starts,
    )
    assert result.record.status in ("succeeded", "failed"), result.record.error
    assert executor.store.get_execution(result.record.id).steps[0].after == {"policy": "fcfs"}
    return result.record


OOM_STARTS = datetime(2026, 1, 1, tzinfo=UTC)


def oom_fixed(executor: Executor) -> ExecutionResult:
    """oom-pressure's cut for the alert episode "oom", succeeded."""
    run = executor.execute(
        "oom-pressure",
        URL,
        trigger="alert",
        who="rules:VllmOOMPressure",
        alert_fingerprint="oom",
        alert_starts_at=OOM_STARTS,
        condition_seconds=0,
    )
    assert run.record.status == "succeeded", run.record.error
    return run


def test_a_fix_holds_while_its_cause_does_and_reverts_after_the_hold(make: Any) -> None:
    executor, agent = make(FakeAgent([STARVING, STARVING, CALM]))
    starts = datetime(2026, 1, 1, tzinfo=UTC)
    fix = switched(executor, starts)
    assert agent.knobs["policy"] == "fcfs"
    agent.stats = [STARVING]  # the stream goes on after the alert resolved
    held = hold_on_resolve(executor, "latency-spike", URL, "abc", starts)
    assert held is not None and held.display_status == "holding"
    assert held.hold_note == "alert resolved; reverts once oldest_waiting < 2 for 120 s on end"
    later = Later()
    holds = Holds(executor, now=later)
    for seconds in (0, 60, 600):  # however long: the cause holds
        later.seconds = seconds
        assert holds.judge(executor.store.get_execution(fix.id)) is None
    record = executor.store.get_execution(fix.id)
    assert record.display_status == "holding" and agent.knobs["policy"] == "fcfs"
    assert record.hold_note == (
        "the cause holds (oldest_waiting ≥ 2); reverts once oldest_waiting < 2 for 120 s on end"
    )
    agent.stats = [CALM]  # the stream ended: drained
    later.seconds = 700
    assert holds.judge(executor.store.get_execution(fix.id)) is None  # 0 s of 120
    later.seconds = 819
    assert holds.judge(executor.store.get_execution(fix.id)) is None  # 119 s
    assert executor.store.get_execution(fix.id).hold_note == (
        "the cause is gone (oldest_waiting < 2); reverts after 120 s of it"
    )
    agent.stats = [STARVING]  # back for one reading: the 120 s start again
    later.seconds = 820
    assert holds.judge(executor.store.get_execution(fix.id)) is None
    agent.stats = [CALM]
    later.seconds = 830
    assert holds.judge(executor.store.get_execution(fix.id)) is None
    later.seconds = 950
    result = holds.judge(executor.store.get_execution(fix.id))
    assert result is not None and result.record.status == "succeeded"
    assert result.record.reverts_id == fix.id and result.record.who == "hold"
    assert result.record.reason == (
        f"execution #{fix.id} reverted: its alert resolved 950 s ago and "
        "oldest_waiting < 2 held for 120 s"
    )
    assert agent.knobs == STARTUP
    original = executor.store.get_execution(fix.id)
    assert original.status == "reverted"
    assert events_of(original)[0] == "started"
    assert events_of(original)[-2:] == ["holding", "reverted"]


def test_without_until_the_hold_is_time_only(make: Any) -> None:
    executor, agent = make(
        FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 0}])
    )
    oom_fixed(executor)
    held = hold_on_resolve(executor, "oom-pressure", URL, "oom", OOM_STARTS)
    assert held is not None
    assert held.hold_note == "alert resolved; reverts after a hold of 120 s"
    later = Later()
    holds = Holds(executor, now=later, healthy_period_seconds=0)
    later.seconds = 119
    assert holds.judge(executor.store.get_execution(held.id)) is None
    later.seconds = 121
    result = holds.judge(executor.store.get_execution(held.id))
    assert result is not None and result.record.status == "succeeded"
    assert [s.params["fraction"] for s in result.record.steps] == [0.5, 1.0]  # stepwise
    assert agent.knobs == STARTUP


def test_a_finding_back_within_the_watch_reapplies_and_the_next_revert_waits_for_a_person(
    make: Any, store: Journal
) -> None:
    executor, agent = make(FakeAgent([STARVING, STARVING, CALM]))
    t0 = utcnow() - timedelta(minutes=5)
    fix = switched(executor, t0)
    agent.stats = [CALM]
    hold_on_resolve(executor, "latency-spike", URL, "abc", t0, hold_seconds=0)
    revert = Holds(executor, hold_seconds=0).judge(store.get_execution(fix.id))
    assert revert is not None and agent.knobs["policy"] == "priority"
    # The starvation fires again 40 s after the revert (latency-spike watches
    # for its verification's 120 s): the service's new pending execution.
    again_at = (revert.record.finished_at or utcnow()) + timedelta(seconds=40)
    pending, _ = store.create_execution(
        "latency-spike",
        URL,
        trigger="alert",
        who="rules:VllmRequestStarvation",
        alert_fingerprint="abc",
        alert_starts_at=again_at,
    )
    found = premature_revert(executor, pending)
    assert found is not None and found.id == revert.record.id
    result = reapply(executor, pending, found)
    assert result.record.status == "succeeded" and agent.knobs["policy"] == "fcfs"
    assert result.record.reason == (
        f"re-applies what revert #{revert.record.id} of #{fix.id} undid: VllmRequestStarvation "
        "fired again 40 s after it (premature)"
    )
    (step,) = result.record.steps
    assert (step.action, step.before, step.after) == (
        "reapply_knobs",
        {"policy": "priority"},
        {"policy": "fcfs"},
    )
    marked = store.get_execution(revert.record.id)
    assert marked.premature and marked.reason is not None
    assert marked.reason.endswith(
        f"premature: VllmRequestStarvation fired again 40 s after it; re-applied by #{pending.id}"
    )
    assert events_of(marked) == ["premature revert"]
    # Its alert resolves too: fix, revert, re-apply in the hour: a revert now
    # would turn the policy round a third time. A person releases it.
    hold_on_resolve(executor, "latency-spike", URL, "abc", again_at, hold_seconds=0)
    assert Holds(executor, hold_seconds=0).judge(store.get_execution(pending.id)) is None
    held = store.get_execution(pending.id)
    assert held.display_status == "holding" and held.hold_for_person
    assert held.hold_note == (
        "held for a person: latency-spike's knobs changed 3 times on this engine in the last "
        f"hour (a revert would turn them round a third time); release: runbook revert {pending.id}"
    )
    assert events_of(held)[-2:] == ["holding", "held for a person"]
    assert agent.knobs["policy"] == "fcfs"
    # A person's revert is not judged premature (it is theirs).
    by_person = executor.revert(pending.id, who="alice")
    assert by_person.record.status == "succeeded" and agent.knobs == STARTUP
    late, _ = store.create_execution(
        "latency-spike",
        URL,
        trigger="alert",
        who="rules:VllmRequestStarvation",
        alert_fingerprint="abc",
        alert_starts_at=(by_person.record.finished_at or utcnow()) + timedelta(seconds=5),
    )
    assert premature_revert(executor, late) is None


def test_outside_the_watch_a_returning_finding_is_a_new_fix(make: Any, store: Journal) -> None:
    executor, agent = make(FakeAgent([STARVING, STARVING, CALM]))
    t0 = utcnow() - timedelta(minutes=10)
    fix = switched(executor, t0)
    agent.stats = [CALM]
    hold_on_resolve(executor, "latency-spike", URL, "abc", t0, hold_seconds=0)
    revert = Holds(executor, hold_seconds=0).judge(store.get_execution(fix.id))
    assert revert is not None and revert.record.finished_at is not None
    pending, _ = store.create_execution(
        "latency-spike",
        URL,
        trigger="alert",
        who="rules:VllmRequestStarvation",
        alert_fingerprint="abc",
        alert_starts_at=revert.record.finished_at + timedelta(seconds=121),
    )
    assert premature_revert(executor, pending) is None


def test_a_halted_revert_holds_for_a_person(make: Any, store: Journal) -> None:
    calm = {**PRESSURE, "preemptions_per_minute": 0.0}
    executor, agent = make(FakeAgent([PRESSURE, PRESSURE, PRESSURE, calm]))
    run = oom_fixed(executor)
    hold_on_resolve(executor, "oom-pressure", URL, "oom", OOM_STARTS, hold_seconds=0)
    # Preemptions come back after the first stage: the stepwise revert halts.
    agent.stats = [calm, {**PRESSURE, "preemptions_per_minute": 400.0}]
    result = Holds(executor, hold_seconds=0, healthy_period_seconds=1).judge(
        store.get_execution(run.record.id)
    )
    assert result is not None and result.record.status == "failed"
    held = store.get_execution(run.record.id)
    assert held.display_status == "holding" and held.hold_for_person
    assert held.hold_note is not None and held.hold_note.startswith(
        f"held for a person: revert #{result.record.id} failed (stepwise revert halted after 50%"
    )
    # Not tried again by itself.
    assert Holds(executor, hold_seconds=0).judge(held) is None
