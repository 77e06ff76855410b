"""The executor's guardrails, circuit breaker and revert, against a fake agent.

The fake (tests/fake_agent.py, on the agent's models) keeps knobs and bounds
like collector/control.py (ceilings at the startup values, the budget floored
by max_num_seqs) and serves scripted stats, so each rule is checked exactly
and fast; the real engine tests (test_exec_oom.py, test_exec_latency.py)
check the same paths end to end.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from vllm_runbook.rules.durations import format_duration, parse_duration
from vllm_runbook.runbooks.engine.operations import engine_registry, kv_capacity_seqs
from vllm_runbook.runbooks.model.spec import Catalog, Runbook, load_catalog
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.guardrails import engine_lock_name
from vllm_runbook.runbooks.run.hold import Holds, hold_on_resolve
from vllm_runbook.runbooks.run.render import format_verification
from vllm_runbook.runbooks.run.revert import RevertRefused, stage_values
from vllm_runbook.runbooks.store import Journal

from tests.fake_agent import PRESSURE, STARTUP, URL, Clock, FakeAgent, stats


def runbook(**overrides: Any) -> Runbook:
    data: dict[str, Any] = {
        "name": "test-rb",
        "description": "test",
        "checks": [{"name": "preemptions", "description": "p", "signal": "preemptions_per_minute"}],
        "steps": [{"action": "scale_max_num_batched_tokens", "params": {"factor": 0.5}}],
        "verification": {
            "signal": "preemptions_per_minute",
            "direction": "decrease",
            "deadline_seconds": 5,
            "rollback_if_worse": ["requests_waiting"],
        },
        "guardrails": {"cooldown_seconds": 0, "max_runs_per_hour": 10},
    }
    data.update(overrides)
    return Runbook.model_validate(data)


@pytest.fixture
def make(store: Journal) -> Iterator[Callable[..., tuple[Executor, FakeAgent]]]:
    def build(
        agent: FakeAgent | None = None, catalog: Catalog | None = None
    ) -> tuple[Executor, FakeAgent]:
        agent = agent or FakeAgent()
        clock = Clock()
        executor = Executor(
            store,
            catalog or load_catalog(registry=engine_registry()),
            engine_registry(),
            client_factory=lambda url: agent,
            poll_seconds=1.0,  # type: ignore[arg-type,return-value]
            sleep=clock.sleep,
            clock=clock,
        )
        return executor, agent

    yield build


def statuses(result: ExecutionResult) -> list[tuple[str, str]]:
    return [(s.action, s.status) for s in result.record.steps]


def test_kv_capacity_is_integer_exact() -> None:
    # A full cache holds exactly what runs now; float division gives 23 here.
    assert kv_capacity_seqs(stats(kv_blocks_used=255, kv_blocks_free=0, requests_running=24)) == 24
    assert (
        kv_capacity_seqs(stats(kv_blocks_used=100, kv_blocks_free=155, requests_running=10)) == 25
    )
    assert kv_capacity_seqs(stats(kv_blocks_used=0, kv_blocks_free=255, requests_running=0)) is None


def test_success_and_journal(make: Any) -> None:
    executor, _ = make(
        FakeAgent([PRESSURE, PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 30.0}])
    )
    result = executor.execute(runbook(), URL, approved=True)
    assert (result.exit_code, result.record.status) == (0, "succeeded")
    (step,) = result.record.steps
    assert (step.status, step.before, step.after, step.applied_at_step) == (
        "applied",
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 256},
        101,
    )
    v = result.record.verification
    assert v is not None and (v["before"], v["after"], v["outcome"]) == (60.0, 30.0, "improved")
    assert result.record.checks == {
        "preemptions": {"signal": "preemptions_per_minute", "description": "p", "value": 60.0}
    }


def test_circuit_breaker_rolls_back_when_a_guard_gets_worse(make: Any) -> None:
    worse = {**PRESSURE, "requests_waiting": 45}
    executor, agent = make(FakeAgent([PRESSURE, PRESSURE, worse]))
    result = executor.execute(runbook(), URL)
    assert (result.exit_code, result.record.status) == (1, "rolled_back")
    assert statuses(result) == [("scale_max_num_batched_tokens", "reverted")]
    assert "guard requests_waiting got worse (40 → 45)" in (result.record.error or "")
    assert agent.knobs == STARTUP
    guard = result.record.verification["guards"]["requests_waiting"]  # type: ignore[index]
    assert (guard["before"], guard["after"], guard["outcome"]) == (40, 45, "worse")


def test_a_move_within_the_tolerance_is_no_evidence(make: Any) -> None:
    # 40 → 41 waiting (2.5 %) trips nothing; 60 → 58.8 preemptions/min (2 %) is
    # "no measurable change", not "improved".
    after = {**PRESSURE, "requests_waiting": 41, "preemptions_per_minute": 58.8}
    executor, agent = make(FakeAgent([PRESSURE, PRESSURE, after]))
    result = executor.execute(runbook(), URL)
    assert (result.exit_code, result.record.status) == (1, "failed")
    assert result.record.verification["outcome"] == "no measurable change"  # type: ignore[index]
    assert agent.knobs["max_num_batched_tokens"] == 256  # kept


def test_verification_reads_only_from_the_step_the_change_applied(make: Any) -> None:
    executor, agent = make(
        FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 6.0}])
    )
    result = executor.execute(runbook(), URL)
    (step,) = result.record.steps
    v = result.record.verification
    assert v is not None and v["from_step"] == step.applied_at_step == 101
    # The checks read no since; every verification read asked from step 101.
    assert agent.since_steps[0] is None
    # A rate is judged over the whole measurement period (here the 5 s deadline).
    assert agent.since_steps.count(101) == v["polls"] == 6
    assert (v["before"], v["after"], v["outcome"]) == (60.0, 6.0, "improved")


def test_required_guard_unreadable_refuses_before_any_change(make: Any) -> None:
    rb = runbook(
        verification={
            "signal": "preemptions_per_minute",
            "direction": "decrease",
            "deadline_seconds": 5,
            "rollback_if_worse": ["engine_e2e_latency_p99"],
            "required_guards": ["engine_e2e_latency_p99"],
        }
    )
    executor, agent = make()
    result = executor.execute(rb, URL)
    assert (result.exit_code, result.record.status) == (2, "refused")
    assert agent.writes == []
    assert (result.message or "").startswith(
        "required guard cannot be read on this engine: engine_e2e_latency_p99 ("
    )


def test_unreadable_guard_is_named_with_its_reason(make: Any) -> None:
    rb = runbook(
        verification={
            "signal": "preemptions_per_minute",
            "direction": "decrease",
            "deadline_seconds": 5,
            "rollback_if_worse": ["gpu_utilization_max"],
        }
    )
    executor, _ = make(FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 0.0}]))
    result = executor.execute(rb, URL)
    assert result.record.status == "succeeded"
    v = result.record.verification
    assert v is not None and v["guards_unavailable"] == ["gpu_utilization_max"]
    assert v["guards"]["gpu_utilization_max"]["outcome"] == (
        "unavailable: before: no NVIDIA GPU on this engine (NVML not available)"
    )
    assert any("gpu_utilization_max" in w for w in result.warnings)


def test_verification_signal_worse_at_the_deadline_rolls_back(make: Any) -> None:
    executor, agent = make(
        FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 90.0}])
    )
    result = executor.execute(runbook(), URL)
    assert result.record.status == "rolled_back" and agent.knobs == STARTUP
    assert result.record.verification["polls"] == 6  # type: ignore[index]  # 0..5 s


def test_unchanged_signal_fails_and_keeps_the_change(make: Any) -> None:
    executor, agent = make()
    result = executor.execute(runbook(), URL)
    assert (result.exit_code, result.record.status) == (1, "failed")
    assert "no measurable change in preemptions_per_minute (60 → 60; needed" in (
        result.message or ""
    )
    assert agent.knobs["max_num_batched_tokens"] == 256


def test_conditional_step_is_evaluated_after_its_wait(make: Any) -> None:
    rb = runbook(
        steps=[
            {"action": "scale_max_num_batched_tokens", "params": {"factor": 0.5}},
            {
                "action": "set_max_num_seqs",
                "params": {"value": "kv_capacity", "headroom": 0.5},
                "when": {"signal": "preemptions_per_minute", "above": 0, "after_seconds": 30},
            },
        ],
        verification=None,
    )
    calm = {**PRESSURE, "preemptions_per_minute": 0.0}
    executor, _ = make(FakeAgent([PRESSURE, PRESSURE, calm]))
    result = executor.execute(rb, URL)
    assert statuses(result) == [
        ("scale_max_num_batched_tokens", "applied"),
        ("set_max_num_seqs", "skipped"),
    ]
    assert result.record.steps[1].params["observed"] == 0.0
    assert executor.clock() == 1030.0  # waited the 30 s (on the fake clock)

    executor, _ = make(FakeAgent([PRESSURE]))
    result = executor.execute(rb, URL, condition_seconds=2)
    assert statuses(result)[1] == ("set_max_num_seqs", "applied")
    assert result.record.steps[1].after == {"max_num_seqs": 12}  # 24 x 0.5
    assert executor.clock() == 1002.0


def test_kv_capacity_is_read_again_while_nothing_runs(make: Any) -> None:
    """A storm step can preempt every running request: one read between two
    such steps sees nothing running; the cap reads again before it gives up."""
    rb = runbook(
        steps=[{"action": "set_max_num_seqs", "params": {"value": "kv_capacity"}}],
        verification=None,
    )
    emptied = {**PRESSURE, "requests_running": 0, "kv_blocks_used": 0, "kv_blocks_free": 255}
    # checks, the step's own read, two re-reads that still see nothing, then pressure.
    executor, agent = make(FakeAgent([PRESSURE, emptied, emptied, emptied, PRESSURE]))
    result = executor.execute(rb, URL)
    assert statuses(result) == [("set_max_num_seqs", "applied")]
    assert result.record.steps[0].after == {"max_num_seqs": 12}  # 24 running x 0.5
    assert result.record.steps[0].params["kv_capacity_seqs"] == 24
    assert executor.clock() == pytest.approx(1000.6)  # three waits of 0.2 s

    executor, agent = make(FakeAgent([PRESSURE, emptied]))
    result = executor.execute(rb, URL)
    assert statuses(result) == [("set_max_num_seqs", "skipped")]
    assert result.record.steps[0].params["note"] == (
        "kv_capacity unknown: no running request held KV blocks in 11 reads over 2 s"
    )
    assert agent.writes == []


def test_step_two_refused_rolls_step_one_back(make: Any) -> None:
    rb = runbook(
        steps=[
            {"action": "set_max_num_seqs", "params": {"value": 16}},
            {"action": "scale_max_num_batched_tokens", "params": {"factor": 0.01, "clamp": False}},
        ]
    )
    executor, agent = make()
    result = executor.execute(rb, URL)
    assert (result.exit_code, result.record.status) == (1, "rolled_back")
    assert statuses(result) == [
        ("set_max_num_seqs", "reverted"),
        ("scale_max_num_batched_tokens", "failed"),
    ]
    assert agent.knobs == STARTUP


def test_engine_down_fails_with_exit_3_and_no_steps(make: Any) -> None:
    agent = FakeAgent()
    agent.down = True
    executor, _ = make(agent)
    result = executor.execute(runbook(), URL)
    assert (result.exit_code, result.record.status, result.record.steps) == (3, "failed", ())


def test_approval_cooldown_and_rate_limit(make: Any) -> None:
    executor, agent = make()
    needs_yes = runbook(guardrails={"requires_approval": True, "cooldown_seconds": 0})
    refused = executor.execute(needs_yes, URL)
    assert (refused.exit_code, refused.record.status) == (2, "refused")
    assert "requires approval" in (refused.message or "") and agent.writes == []

    cooled = runbook(guardrails={"cooldown_seconds": 600, "max_runs_per_hour": 10})
    assert executor.execute(cooled, URL).record.status == "failed"  # ran (no improvement)
    again = executor.execute(cooled, URL)
    assert again.record.status == "refused"
    # The time left, rounded up to whole seconds, spelled as a duration (`9m58s`).
    left = re.search(r"; (\w+) left of 600 s$", again.message or "")
    assert left and left[1] == format_duration(parse_duration(left[1]))
    assert 0 < parse_duration(left[1]) <= 600 and parse_duration(left[1]) % 1 == 0

    limited = runbook(name="limited", guardrails={"cooldown_seconds": 0, "max_runs_per_hour": 2})
    for _ in range(2):
        agent.knobs = dict(STARTUP)
        assert executor.execute(limited, URL).record.status != "refused"
    third = executor.execute(limited, URL)
    assert third.record.status == "refused"
    assert "max runs per hour: 2 of 2" in (third.message or "")
    wait = re.search(r"next allowed in (\w+)$", third.message or "")
    assert wait and 0 < parse_duration(wait[1]) <= 3600 and parse_duration(wait[1]) % 1 == 0


def test_blast_radius_counts_other_engines_under_remediation(make: Any, store: Journal) -> None:
    executor, agent = make()
    for other in ("http://10.0.0.1:9360", "http://10.0.0.2:9360"):
        record, _ = store.create_execution("oom-pressure", other, trigger="cli", who="t")
        store.transition(record.id, "running")
    rb = runbook(guardrails={"cooldown_seconds": 0, "max_concurrent_engines": 2})
    result = executor.execute(rb, URL)
    assert result.record.status == "refused"
    assert "blast radius: 2 other engine(s)" in (result.message or "")
    assert agent.writes == []


def test_engine_lock_refuses_while_a_live_execution_holds_it(make: Any, store: Journal) -> None:
    executor, agent = make()
    holder, _ = store.create_execution("oom-pressure", URL, trigger="cli", who="other")
    store.transition(holder.id, "running")  # this (live) process
    assert store.acquire_lease(engine_lock_name(URL), f"execution:{holder.id}", 60)
    result = executor.execute(runbook(), URL)
    assert (result.exit_code, result.record.status) == (2, "refused")
    assert f"execution #{holder.id}" in (result.message or "") and agent.writes == []
    # Once the holder finished, its lock is stale and is taken over.
    store.transition(holder.id, "succeeded")
    assert executor.execute(runbook(), URL).record.status != "refused"


def test_dry_run_changes_nothing_and_plans_every_step(make: Any) -> None:
    executor, agent = make()
    result = executor.execute("oom-pressure", URL, dry_run=True)
    assert result.exit_code == 0 and agent.writes == [] and agent.knobs == STARTUP
    assert [(s.action, s.status, s.after) for s in result.record.steps] == [
        ("scale_max_num_batched_tokens", "planned", {"max_num_batched_tokens": 256}),
        ("set_max_num_seqs", "planned", {"max_num_seqs": 12}),
        # max_num_seqs journaled with the hand-over: a revert puts it back there.
        ("set_autopilot", "planned", {"autopilot": True, "max_num_seqs": 32}),
    ]


def test_alert_episode_runs_once_and_reverts_stepwise_on_resolve(make: Any) -> None:
    executor, agent = make(
        FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 0.0}])
    )
    starts = datetime(2026, 1, 1, tzinfo=UTC)
    first = executor.execute(
        "latency-spike",
        URL,
        trigger="alert",
        who="am",
        alert_fingerprint="abc",
        alert_starts_at=starts,
    )
    dup = executor.execute(
        "latency-spike",
        URL,
        trigger="alert",
        who="am",
        alert_fingerprint="abc",
        alert_starts_at=starts,
    )
    assert dup.created is False and dup.record.id == first.record.id
    assert agent.writes == [{"policy": "fcfs"}]
    agent.stats = [{**PRESSURE, "oldest_waiting": 0.0}]  # the cause is gone
    held = hold_on_resolve(executor, "latency-spike", URL, "abc", starts, hold_seconds=0)
    assert held is not None and held.display_status == "holding"
    reverted = Holds(executor, hold_seconds=0).judge(held)
    assert reverted is not None and reverted.record.status == "succeeded"
    assert agent.knobs == STARTUP
    assert executor.store.get_execution(first.record.id).status == "reverted"
    with pytest.raises(RevertRefused, match="already reverted"):
        executor.revert(first.record.id)


def test_stepwise_revert_goes_back_in_stages(make: Any) -> None:
    calm = {**PRESSURE, "preemptions_per_minute": 0.0}
    executor, agent = make(FakeAgent([PRESSURE, PRESSURE, PRESSURE, calm]))
    run = executor.execute("oom-pressure", URL, approved=True, condition_seconds=0)
    # Cut, then handed over to the autopilot.
    assert agent.knobs == {
        **STARTUP,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 12,
        "autopilot": True,
    }
    assert [s.action for s in run.record.steps][-1] == "set_autopilot"
    assert run.record.steps[-1].params["max_num_seqs_at_hand_over"] == 12
    result = executor.revert(run.record.id, stepwise=True, healthy_period_seconds=60)
    # The autopilot goes off at the first stage: left on, it would fight the stages.
    assert [(s.before, s.after) for s in result.record.steps] == [
        (
            {"max_num_batched_tokens": 256, "max_num_seqs": 12, "autopilot": True},
            {"max_num_batched_tokens": 384, "max_num_seqs": 22, "autopilot": False},
        ),
        (
            {"max_num_batched_tokens": 384, "max_num_seqs": 22, "autopilot": False},
            {"max_num_batched_tokens": 512, "max_num_seqs": 32, "autopilot": False},
        ),
    ]
    assert agent.knobs == STARTUP and result.record.status == "succeeded"


def test_stepwise_revert_halts_when_the_signal_gets_worse(make: Any) -> None:
    calm = {**PRESSURE, "preemptions_per_minute": 0.0}
    executor, agent = make(FakeAgent([PRESSURE, PRESSURE, PRESSURE, calm]))
    run = executor.execute("oom-pressure", URL, approved=True, condition_seconds=0)
    # Read: the revert's checks, the knobs before stage 1, then after the healthy
    # period, from stage 1's step on: 6 preemptions/min where there were none.
    agent.stats = [calm, calm, {**calm, "preemptions_per_minute": 6.0}]
    result = executor.revert(run.record.id, stepwise=True, healthy_period_seconds=60)
    assert result.record.status == "failed" and result.exit_code == 1
    assert "halted after 50%: preemptions_per_minute got worse (0 → 6)" in (result.message or "")
    assert agent.knobs["max_num_batched_tokens"] == 384
    assert executor.store.get_execution(run.record.id).status == "succeeded"  # not reverted


def test_stage_values() -> None:
    start = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "policy": "fcfs"}
    targets = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "policy": "priority"}
    assert stage_values(start, targets, 0.5) == {
        "max_num_batched_tokens": 320,
        "max_num_seqs": 20,
        "policy": "fcfs",
    }
    assert stage_values(start, targets, 1.0) == targets


def test_judge_needs_the_named_effect() -> None:
    from vllm_runbook.runbooks.run.verification import IMPROVED, NO_CHANGE, WORSE, judge

    def decrease(before: float, after: float, by: float = 0.8) -> str:
        return judge(before, after, "decrease", improve_by=by, tolerance=0.1)

    # oom-pressure: after <= 20 % of before.
    assert [decrease(60, 12), decrease(60, 13), decrease(306, 300)] == [
        IMPROVED,
        NO_CHANGE,
        NO_CHANGE,
    ]
    assert [decrease(7, 60), decrease(60, 66), decrease(60, 66.1)] == [WORSE, NO_CHANGE, WORSE]
    assert [decrease(0, 0), decrease(0, 1)] == [NO_CHANGE, WORSE]
    # latency-spike: every request starving at the switch scheduled (before: how
    # many starved then, after: how many of them still wait); never worse.
    kw: dict[str, Any] = {"improve_by": 0.2, "tolerance": 0.1, "effect": "starving_served"}
    assert [judge(8, 0, "decrease", **kw), judge(8, 1, "decrease", **kw)] == [IMPROVED, NO_CHANGE]
    assert [judge(8, 8, "decrease", **kw), judge(0, 0, "decrease", **kw)] == [NO_CHANGE, NO_CHANGE]


def test_the_starvation_deadline_follows_the_drain_rate() -> None:
    from vllm_runbook.runbooks.run.verification import drain_deadline

    # 8 starving at 0.5 admitted/s: 3 x 16 s; capped by the runbook's deadline.
    assert drain_deadline(120, 8, 0.5) == 48.0
    assert drain_deadline(30, 8, 0.5) == 30
    # A fast engine: at least 10 s; nothing admitted before: the runbook's deadline.
    assert drain_deadline(120, 8, 100.0) == 10.0
    assert drain_deadline(120, 8, 0.0) == 120
    assert drain_deadline(120, 8, None) == 120


def test_http_error_rate_from_the_api_servers_metrics_text() -> None:
    from vllm_runbook.runbooks.engine.sources import api_signals

    text = (
        "# HELP http_requests_total Total number of requests by method, status and handler.\n"
        "# TYPE http_requests_total counter\n"
        'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 7.0\n'
        'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 2.0\n'
        'http_requests_total{handler="/v1/chat/completions",method="POST",status="5xx"} 1.0\n'
        'http_requests_total{handler="/v1/models",method="GET",status="5xx"} 5.0\n'
    )
    assert api_signals(text) == ({"http_error_rate": 0.1}, {})
    only_get = 'http_requests_total{handler="/v1/models",method="GET",status="2xx"} 1.0\n'
    assert api_signals(only_get) == (
        {"http_error_rate": None},
        {"http_error_rate": "no request answered by the API server yet"},
    )
    assert api_signals("vllm:num_requests_running 0.0\n") == (
        {"http_error_rate": None},
        {"http_error_rate": "the API server's /metrics has no http_requests_total"},
    )


def test_an_engine_that_leaves_the_inventory_ends_its_execution_engine_gone(make: Any) -> None:
    """Mid-verification the engine leaves (a pod scaled away, the agent down): the
    execution ends failed "engine gone" at its next wait, nothing is restored, and
    an execution not started yet on it is refused with the same reason."""
    executor, agent = make(FakeAgent([PRESSURE]))  # no improvement: verification waits
    gone: dict[str, str] = {}
    executor.gone = gone.get
    reads = 0
    real_state = agent.state

    def state(since_step: int | None = None, episode_seconds: float | None = None) -> Any:
        nonlocal reads
        reads += 1
        if since_step is not None and reads >= 4:  # verifying: the pod goes away
            gone[URL] = "engine gone: cpu-0 left the inventory (prometheus) at T"
            agent.down = True
        return real_state(since_step, episode_seconds)

    agent.state = state
    result = executor.execute(runbook(), URL, approved=True)
    assert (result.exit_code, result.record.status) == (3, "failed")
    assert result.record.error == (
        "engine gone: cpu-0 left the inventory (prometheus) at T "
        f"(engine {URL} unreachable: connection refused); not reverted (1 step(s) applied on it)"
    )
    assert statuses(result) == [("scale_max_num_batched_tokens", "applied")]
    assert agent.writes == [{"max_num_batched_tokens": 256}]  # no rollback was tried
    assert agent.knobs["max_num_batched_tokens"] == 256  # nothing restored on it
    later = executor.execute(runbook(), URL, approved=True)
    assert (later.exit_code, later.record.status, later.record.reason) == (
        3,
        "refused",
        "engine gone: cpu-0 left the inventory (prometheus) at T",
    )


def test_nothing_to_improve_is_refused_before_any_change_and_is_no_failure(
    make: Any, store: Journal
) -> None:
    from vllm_runbook.runbooks.service.notify import message

    # oom-pressure on an engine that preempts nothing: the trigger fired, the
    # condition is gone by the checks.
    calm = {**PRESSURE, "preemptions_per_minute": 0.0}
    executor, agent = make(FakeAgent([calm]))
    result = executor.execute("oom-pressure", URL, approved=True, condition_seconds=0)
    record = result.record
    assert (result.exit_code, record.status, record.display_status) == (
        0,
        "refused",
        "nothing to improve",
    )
    assert (
        record.reason
        == result.message
        == (
            "nothing to improve: preemptions_per_minute = 0, "
            "the runbook acts only if preemptions_per_minute > 0"
        )
    )
    assert (record.steps, record.error, record.verification, agent.writes) == ((), None, None, [])
    assert record.checks["preemption_rate"]["value"] == 0.0
    # Notified as such: its one event, and the text's first line.
    assert [e.event for e in store.events_of_execution(record.id)] == ["nothing to improve"]
    text = message(record, "nothing to improve")
    assert (
        text.splitlines()[0]
        == f"[NOTHING TO IMPROVE] oom-pressure on {URL} (execution #{record.id})"
    )
    assert "Reason: nothing to improve: preemptions_per_minute = 0" in text
    # It counts for no guardrail: a run right after it is not in a cooldown.
    executor_2, agent_2 = make(FakeAgent([PRESSURE, PRESSURE, PRESSURE, calm]))
    again = executor_2.execute("oom-pressure", URL, approved=True, condition_seconds=0)
    assert again.record.status != "refused" and agent_2.writes


def test_a_run_whose_steps_would_change_nothing_has_nothing_to_improve(make: Any) -> None:
    executor, agent = make(FakeAgent([PRESSURE]))
    result = executor.execute("restore", URL, approved=True)
    assert (result.exit_code, result.record.display_status, agent.writes) == (
        0,
        "nothing to improve",
        [],
    )
    assert result.record.reason == (
        "nothing to improve: every step would change nothing "
        "(restore_knobs: every knob is at its startup value)"
    )
    # A dry run says so too, and a knob away from its startup value is restored.
    dry = executor.execute("restore", URL, dry_run=True)
    assert "a real run would be refused now: nothing to improve" in dry.warnings[0]
    agent.knobs["policy"] = "fcfs"
    done = executor.execute("restore", URL, approved=True)
    assert (done.record.status, agent.writes) == ("succeeded", [dict(STARTUP)]), done.record.reason


def test_a_windowed_rate_with_no_measurable_change_is_measured_on_to_the_deadline() -> None:
    from vllm_runbook.runbooks.run.verification import measure

    v = runbook().verification
    assert v is not None
    v = v.model_copy(update={"rollback_if_worse": ()})
    now = [0.0]

    def run(afters: list[float], deadline_s: float) -> dict[str, Any]:
        now[0] = 0.0
        readings = iter(afters)
        last = [afters[0]]

        def read(step: int | None) -> dict[str, Any]:
            last[0] = next(readings, last[0])
            return {"preemptions_per_minute": last[0]}

        return measure(
            read,
            dict,
            v,
            {"preemptions_per_minute": 4.0},
            {},
            7,
            deadline_s=deadline_s,
            window_s=3.0,
            clock=lambda: now[0],
            wait=lambda s: now.__setitem__(0, now[0] + s),
            poll_s=1.0,
            change=lambda: None,
        )

    # One window reads 4 → 3.9 (one event each side: noise); the rate over the
    # longer period falls to 3 (≤ 80 % of before): improved before the deadline.
    longer = run([3.9, 3.9, 3.9, 3.9, 3.0, 2.0], deadline_s=40)
    assert (longer["outcome"], longer["after"], longer["measured_past_the_window"]) == (
        "improved",
        3.0,
        True,
    )
    assert longer["polls"] == 5
    # A rate that stays is no measurable change, at the deadline.
    flat = run([3.9] * 100, deadline_s=10)
    assert (flat["outcome"], flat["polls"]) == ("no measurable change", 11)
    # Worse at the window's end is not measured on.
    worse = run([9.0] * 100, deadline_s=40)
    assert (worse["outcome"], worse["polls"]) == ("worse", 4)


# --- the SLO burn rate as the verification signal of an SLO's runbook --------------------


def ttft_metrics(good: int, total: int, other_model: int = 0) -> str:
    """vLLM's /metrics with a TTFT histogram: `good` of `total` first tokens within 1 s
    (model m); `other_model` slow requests of another model (not the SLO's)."""
    lines = [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for model, ok, n in (("m", good, total), ("other", 0, other_model)):
        labels = f'model_name="{model}"'
        lines += [
            f'vllm:time_to_first_token_seconds_bucket{{le="0.5",{labels}}} {ok // 2}.0',
            f'vllm:time_to_first_token_seconds_bucket{{le="1.0",{labels}}} {ok}.0',
            f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{labels}}} {n}.0',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} {n}.0",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} {n * 0.7}",
        ]
    return "\n".join(lines) + "\n"


def ttft_slo() -> Any:
    from vllm_runbook.rules.slo import SloSpec

    return SloSpec.model_validate(
        {"name": "ttft", "objective": "ttft", "threshold": "1s", "target": 0.99, "model": "m"}
    )


class MetricsServer:
    """vLLM's API server /metrics on loopback: answers the scripted texts in order
    (the last one repeats); `gets` counts the reads."""

    def __init__(self, texts: list[str]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.texts, self.gets = list(texts), 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = server.texts[min(server.gets, len(server.texts) - 1)].encode()
                server.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_slo_counts_read_the_slos_bucket_of_its_model() -> None:
    from vllm_runbook.rules.slo import slo_counts

    # 900 of 1000 within 1 s for model m; another model's 50 slow requests are not its.
    assert slo_counts(ttft_slo(), ttft_metrics(900, 1000, other_model=50)) == (100.0, 1000.0)
    assert slo_counts(ttft_slo(), "# nothing\n") is None
    every_model = ttft_slo().model_copy(update={"model": None})
    assert slo_counts(every_model, ttft_metrics(900, 1000, other_model=50)) == (150.0, 1050.0)


def test_alert_slo_names_the_slo_and_pair_of_its_alerts() -> None:
    from vllm_runbook.runbooks.run.executor import alert_slo

    slo = ttft_slo()
    found = alert_slo([slo], "alertmanager:VllmSloBurn_ttft_6h")
    assert found is not None and (found[0].name, found[1].factor) == ("ttft", 6.0)
    found = alert_slo([slo], "rules:VllmSloBurn_ttft_1h")
    assert found is not None and found[1].factor == 14.4
    assert alert_slo([slo], "rules:VllmSloBurn_e2e_1h") is None  # no such SLO
    assert alert_slo([slo], "alice") is None


@pytest.mark.parametrize(
    ("bad_after", "outcome", "status"),
    [
        # Before: the 1 h pair's 14.4x. After: Δbad / Δall over the 1000 requests
        # finished after the change took effect, / (1 - 0.99).
        (10, "improved", "succeeded"),  # 1 % bad: burn rate 1 ≤ 80 % of 14.4
        (144, "no measurable change", "failed"),  # 14.4 % bad: 14.4, as before
        (200, "worse", "rolled_back"),  # 20 % bad: 20 > 14.4 + 10 %
    ],
)
def test_an_slo_alerts_execution_verifies_on_the_slos_burn_rate(
    make: Any, bad_after: int, outcome: str, status: str
) -> None:
    # Read before (the checks), at the change's first settled step (the mark:
    # 100 bad of 1000), then 1000 more requests of which `bad_after` bad.
    metrics = MetricsServer(
        [
            ttft_metrics(800, 1000),
            ttft_metrics(900, 1000),
            ttft_metrics(900 + 1000 - bad_after, 2000, other_model=500),
        ]
    )
    try:
        executor, agent = make()
        executor.slos = [ttft_slo()]
        executor.api_urls = {URL: metrics.url}
        result = executor.execute(
            runbook(),
            URL,
            trigger="alert",
            who="alertmanager:VllmSloBurn_ttft_1h",
            alert_fingerprint=f"slo-{bad_after}",
            alert_starts_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
    finally:
        metrics.close()
    v = result.record.verification
    assert v is not None and result.record.status == status
    assert (v["signal"], v["direction"], v["outcome"]) == ("slo_burn_rate", "decrease", outcome)
    assert v["before"] == 14.4
    assert v["after"] == pytest.approx(bad_after / 1000 / 0.01, rel=1e-12)
    assert v["slo"] == {
        "name": "ttft",
        "objective": "99% of first tokens within 1s over 30d (m)",
        "alert_burn_rate": 14.4,
        "long_window_seconds": 3600.0,
    }
    assert v["needed"] == "slo_burn_rate ≤ 80% of before"
    # The runbook's guards stay: requests_waiting did not move.
    assert v["guards"]["requests_waiting"]["outcome"] == "ok"
    # Worse is rolled back; the other verdicts keep the change.
    kept = agent.knobs["max_num_batched_tokens"]
    assert kept == (STARTUP["max_num_batched_tokens"] if outcome == "worse" else 256)
    # One read before the change and one per verification poll.
    assert metrics.gets == 1 + v["polls"]


def test_a_cli_run_of_the_slos_runbook_verifies_on_its_own_signal(make: Any) -> None:
    executor, agent = make(
        FakeAgent([PRESSURE, PRESSURE, {**PRESSURE, "preemptions_per_minute": 6.0}])
    )
    executor.slos = [ttft_slo()]
    result = executor.execute(runbook(), URL, who="alertmanager:VllmSloBurn_ttft_1h")
    v = result.record.verification
    assert v is not None and (v["signal"], v["outcome"]) == ("preemptions_per_minute", "improved")
    assert agent.writes == [{"max_num_batched_tokens": 256}]


def test_the_burn_rate_without_requests_after_the_change_is_unverified(make: Any) -> None:
    metrics = MetricsServer([ttft_metrics(900, 1000)])  # no request after the change
    try:
        executor, _agent = make()
        executor.slos = [ttft_slo()]
        executor.api_urls = {URL: metrics.url}
        result = executor.execute(
            runbook(),
            URL,
            trigger="alert",
            who="rules:VllmSloBurn_ttft_6h",
            alert_fingerprint="slo-idle",
            alert_starts_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
    finally:
        metrics.close()
    v = result.record.verification
    assert v is not None and v["before"] == 6.0
    assert v["outcome"] == (
        "unverified: slo_burn_rate after: no request finished since the change took effect"
    )


def test_a_pending_slo_execution_run_by_the_worker_verifies_on_the_burn_rate(
    make: Any, store: Journal
) -> None:
    # As the webhook records it (who: alertmanager:<alertname>) and the worker runs it.
    metrics = MetricsServer(
        [ttft_metrics(800, 1000), ttft_metrics(900, 1000), ttft_metrics(1890, 2000)]
    )
    try:
        executor, _agent = make(catalog=Catalog({"test-rb": runbook()}, {}))
        executor.slos = [ttft_slo()]
        executor.api_urls = {URL: metrics.url}
        record, _ = store.create_execution(
            "test-rb",
            URL,
            trigger="alert",
            who="alertmanager:VllmSloBurn_ttft_1h",
            alert_fingerprint="slo-worker",
            alert_starts_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
        result = executor.run_pending(record.id, approved=True)
    finally:
        metrics.close()
    v = result.record.verification
    assert v is not None and result.record.status == "succeeded"
    # 10 bad of the 1000 after the change: 1 % / 1 % budget.
    assert (v["signal"], v["before"], v["outcome"]) == ("slo_burn_rate", 14.4, "improved")
    assert v["after"] == pytest.approx(1.0, rel=1e-12)
    assert format_verification({**v, "after": 1.0, "measured_seconds": 5.0}) == (
        "slo_burn_rate 14.4 → 1: improved [after: from step 101, over 5 s]; "
        "SLO ttft: before = the 14.4x alert's rate"
    )
