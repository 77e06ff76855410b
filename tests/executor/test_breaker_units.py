"""The service-wide circuit breaker (runbooks/service/breaker.py): its limits with
exact numbers, and its watch, rollback, journal, counter and hold against the
in-memory agent (tests/fake_agent.py). The real engine's storm is in
test_breaker_engine.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.model.config import BreakerConfig
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.service.breaker import (
    BREAKER_WHO,
    ERROR_RATE,
    P99_OVER_SLA,
    PREEMPTION_RATE,
    Breaker,
    Measurement,
    judge,
)
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import utcnow

from tests.fake_agent import STARTUP, URL, Clock, FakeAgent

DEFAULTS = BreakerConfig()


def m(
    preemptions: int = 0,
    finished: int = 0,
    errors: int = 0,
    p99: float | None = None,
    before: Measurement | None = None,
) -> Any:
    return Measurement(30.0, preemptions, finished, errors, p99, before)


def test_defaults_are_the_reports_limits() -> None:
    assert (DEFAULTS.watch_seconds, DEFAULTS.preemption_rate, DEFAULTS.error_rate) == (
        600.0,
        0.01,
        0.005,
    )
    assert (DEFAULTS.p99_sla_seconds, DEFAULTS.min_finished, DEFAULTS.cooldown_seconds) == (
        None,
        100,
        600.0,
    )


def test_preemption_rate_is_per_finished_request_with_a_minimum_denominator() -> None:
    assert judge(m(1, 100), DEFAULTS) is None  # exactly 1 %: not above
    assert judge(m(1, 10), DEFAULTS) is None  # 1 / max(10, 100)
    trip = judge(m(2, 150), DEFAULTS)
    assert trip is not None
    assert (trip.reason, trip.value, trip.limit) == (PREEMPTION_RATE, 2 / 150, 0.01)
    assert trip.text == "2 preemptions per 150 finished requests = 1.33% > 1.00%"
    storm = judge(m(7, 0), DEFAULTS)  # nothing finishes: still a storm
    assert storm is not None and storm.value == 0.07
    assert storm.text == (
        "7 preemptions per 0 finished requests (counted as the minimum 100) = 7.00% > 1.00%"
    )


def test_error_rate_and_p99_limits() -> None:
    assert judge(m(errors=1, finished=200), DEFAULTS) is None  # 0.5 %: not above
    trip = judge(m(errors=2, finished=200), DEFAULTS)
    assert trip is not None and (trip.reason, trip.value) == (ERROR_RATE, 0.01)
    assert judge(m(finished=500, p99=9.0), DEFAULTS) is None  # no SLA set: not judged
    sla = BreakerConfig(p99_sla="1s")
    assert judge(m(finished=99, p99=1.5), sla) is None  # too few requests for a P99
    assert judge(m(finished=100, p99=1.0), sla) is None  # at the SLA: not over
    trip = judge(m(finished=100, p99=1.5), sla)
    assert trip is not None and (trip.reason, trip.value, trip.limit) == (P99_OVER_SLA, 1.5, 1.0)
    # Preemptions are judged first.
    both = judge(m(preemptions=3, errors=3, finished=100), DEFAULTS)
    assert both is not None and both.reason == PREEMPTION_RATE


def test_config_section_reads_durations_and_rejects_nonsense() -> None:
    c = BreakerConfig.model_validate(
        {"watch": "2m", "cooldown": "30s", "interval": "1s", "p99_sla": "500ms"}
    )
    assert (c.watch_seconds, c.cooldown_seconds, c.interval_seconds, c.p99_sla_seconds) == (
        120.0,
        30.0,
        1.0,
        0.5,
    )
    with pytest.raises(ValueError):
        BreakerConfig.model_validate({"preemption_rate": 1.5})
    with pytest.raises(ValueError):
        BreakerConfig.model_validate({"min_finished": 0})


@pytest.fixture
def setup(store: Journal) -> Any:
    agent = FakeAgent([{}])
    clock = Clock()
    executor = Executor(
        store,
        load_catalog(registry=engine_registry()),
        engine_registry(),
        client_factory=lambda url: agent,  # type: ignore[arg-type,return-value]
        sleep=clock.sleep,
        clock=clock,
        breaker_hold_seconds=600.0,
    )
    trips: list[tuple[str, str]] = []
    config = BreakerConfig(min_finished=20)
    breaker = Breaker(store, executor, config, on_trip=lambda e, r: trips.append((e, r)))
    return agent, executor, breaker, trips


def restore_from_8(agent: FakeAgent, executor: Executor) -> int:
    """An operator capped max_num_seqs at 8; the restore runbook raises it back to 32."""
    agent.knobs["max_num_seqs"] = 8
    result = executor.execute("restore", URL, approved=True)
    assert result.record.status == "succeeded"
    assert agent.knobs == STARTUP
    return result.record.id


def test_a_change_over_the_limit_is_rolled_back_journaled_counted_and_held(
    setup: Any, store: Journal
) -> None:
    agent, executor, breaker, trips = setup
    original = restore_from_8(agent, executor)
    # After it: 5 preemptions while 40 requests finished, in 30 s.
    agent.stats = [{"since_preemptions": 5, "since_requests_finished": 40, "since_seconds": 30.0}]
    [(change, trip)] = breaker.tick()
    assert (change.execution_id, change.before, change.after) == (
        original,
        {"max_num_seqs": 8},
        {"max_num_seqs": 32},
    )
    assert (trip.reason, trip.value) == (PREEMPTION_RATE, 5 / 40)
    assert trips == [(URL, PREEMPTION_RATE)]
    assert agent.knobs["max_num_seqs"] == 8  # the value before the change
    assert store.get_execution(original).status == "reverted"
    [revert] = store.list_executions(who=BREAKER_WHO)
    assert (revert.reverts_id, revert.status, revert.trigger) == (original, "succeeded", "rule")
    assert revert.reason is not None
    assert revert.reason.startswith(f"execution #{original} reverted: circuit breaker: ")
    assert revert.verification is not None
    assert revert.verification["breaker"]["why"] == (
        "circuit breaker: 5 preemptions per 40 finished "
        f"requests = 12.50% > 1.00% in 30 s after max_num_seqs 8 → 32 by execution #{original}"
    )
    assert revert.verification["breaker"]["measurement"] == {
        "seconds": 30.0,
        "preemptions": 5,
        "requests_finished": 40,
        "errors": 0,
        "p99_latency_seconds": None,
    }
    # Undone: nothing is watched any more, nothing trips twice.
    assert breaker.tick() == []
    assert trips == [(URL, PREEMPTION_RATE)]
    # The hold: an automatic execution on this engine is refused; a person's is not.
    record, _ = store.create_execution(
        "oom-pressure",
        URL,
        trigger="alert",
        who="alertmanager",
        alert_fingerprint="f1",
        alert_starts_at=utcnow(),
    )
    held = executor.run_pending(record.id, approved=True)
    assert held.record.status == "refused"
    assert held.record.reason is not None
    assert held.record.reason.startswith("circuit breaker hold: it rolled max_num_seqs back")
    assert agent.knobs["max_num_seqs"] == 8
    cli, _ = store.create_execution("restore", URL, trigger="cli", who="oncall")
    assert executor.run_pending(cli.id, approved=True).record.status == "succeeded"


def test_a_change_within_the_limits_leaves_it_silent_and_the_watch_ends(
    setup: Any, store: Journal
) -> None:
    agent, executor, breaker, trips = setup
    restore_from_8(agent, executor)
    agent.stats = [{"since_preemptions": 0, "since_requests_finished": 400, "since_seconds": 60.0}]
    assert breaker.tick() == []
    assert list(breaker.newest_changes()) == [URL]  # still watched
    later = utcnow() + timedelta(seconds=601)
    breaker.now = lambda: later
    assert breaker.newest_changes() == {}  # the watch period is over
    agent.stats = [{"since_preemptions": 50, "since_requests_finished": 400}]
    assert breaker.tick() == []
    assert (trips, agent.knobs["max_num_seqs"]) == ([], 32)


def test_only_the_newest_change_of_an_engine_is_judged(setup: Any, store: Journal) -> None:
    agent, executor, breaker, _trips = setup
    first = restore_from_8(agent, executor)
    second = restore_from_8(agent, executor)
    assert [c.execution_id for c in breaker.newest_changes().values()] == [second]
    agent.stats = [{"since_preemptions": 9, "since_requests_finished": 30}]
    [(change, _)] = breaker.tick()
    assert change.execution_id == second
    assert store.get_execution(first).status == "succeeded"
    assert store.get_execution(second).status == "reverted"


class PilotAgent(FakeAgent):
    """The fake agent with an autopilot that moved max_num_seqs at `last_step`."""

    last_step = 10

    def state(self, since_step: int | None = None, episode_seconds: float | None = None) -> Any:
        from vllm_runbook.collector.agent_api import AutopilotChange

        state = super().state(since_step, episode_seconds)
        change = AutopilotChange(
            step=self.last_step, max_num_seqs=self.knobs["max_num_seqs"], reason="room"
        )
        pilot = state.autopilot.model_copy(update={"last_change": change})
        return state.model_copy(update={"autopilot": pilot})


def test_an_autopilot_change_over_the_limit_turns_it_off_and_puts_max_num_seqs_back(
    store: Journal,
) -> None:
    def counts(preemptions: int, stopped: int) -> dict[str, Any]:
        return {
            "preemptions_total": preemptions,
            "requests_finished_by_reason_total": {"stop": stopped},
        }

    agent = PilotAgent([counts(4, 100), counts(4, 100), counts(7, 150)])
    agent.knobs.update(autopilot=True, max_num_seqs=16)
    executor = Executor(
        store,
        load_catalog(registry=engine_registry()),
        engine_registry(),
        client_factory=lambda url: agent,  # type: ignore[arg-type,return-value]
    )
    trips: list[tuple[str, str]] = []
    breaker = Breaker(
        store,
        executor,
        BreakerConfig(min_finished=20),
        engines=[URL],
        on_trip=lambda e, r: trips.append((e, r)),
    )
    assert breaker.tick() == []  # first sight: where the autopilot is, not a change
    agent.knobs["max_num_seqs"], agent.last_step = 24, 20  # its climb
    [(change, trip)] = breaker.tick()  # seen at 4 preemptions / 100 finished; then 7 / 150
    assert (change.source, change.before, change.after) == (
        "autopilot",
        {"autopilot": True, "max_num_seqs": 16},
        {"autopilot": True, "max_num_seqs": 24},
    )
    assert (trip.reason, trip.value, trips) == (PREEMPTION_RATE, 3 / 50, [(URL, PREEMPTION_RATE)])
    assert (agent.knobs["autopilot"], agent.knobs["max_num_seqs"]) == (False, 16)
    [undo] = store.list_executions(who=BREAKER_WHO)
    assert (undo.runbook, undo.status, undo.trigger) == ("circuit-breaker", "succeeded", "rule")
    [step] = undo.steps
    assert (step.action, step.status, step.before, step.after) == (
        "set_knobs",
        "applied",
        {"autopilot": True, "max_num_seqs": 24},
        {"autopilot": False, "max_num_seqs": 16},
    )
    assert undo.verification is not None
    assert undo.verification["breaker"]["measurement"]["preemptions"] == 3
    assert undo.verification["breaker"]["measurement"]["requests_finished"] == 50
    assert breaker.tick() == []  # the undoing is the newest change: nothing watched


def test_a_cut_is_not_blamed_for_preemptions_but_for_errors_it_is() -> None:
    from vllm_runbook.runbooks.service.breaker import only_lowers_admission

    assert only_lowers_admission({"max_num_seqs": 32}, {"max_num_seqs": 8})
    assert only_lowers_admission(
        {"max_num_seqs": 32, "max_num_batched_tokens": 512},
        {"max_num_seqs": 8, "max_num_batched_tokens": 256},
    )
    assert not only_lowers_admission({"max_num_seqs": 8}, {"max_num_seqs": 32})
    assert not only_lowers_admission({"autopilot": False}, {"autopilot": True})
    assert not only_lowers_admission(
        {"max_num_seqs": 32, "policy": "priority"}, {"max_num_seqs": 8, "policy": "fcfs"}
    )
    storm = m(preemptions=50, finished=100, errors=0)
    assert judge(storm, DEFAULTS, preemptions=False) is None
    errors = judge(m(preemptions=50, finished=100, errors=5), DEFAULTS, preemptions=False)
    assert errors is not None and errors.reason == ERROR_RATE


OOM = frozenset({PREEMPTION_RATE})


def test_a_fix_of_the_very_signal_trips_only_when_it_got_worse_than_before() -> None:
    # The demo's case: 1.96 % after oom-pressure's cut, 11.8 % in as long before it.
    storm = Measurement(35.0, 18, 153, 0)
    after = m(3, 153, before=storm)
    assert judge(after, DEFAULTS, remediates=OOM) is None
    # Any other change over the limit is implicated, whatever came before.
    other = judge(after, DEFAULTS)
    assert other is not None and other.text == (
        "3 preemptions per 153 finished requests = 1.96% > 1.00%; 11.76% in the 35 s before"
    )
    # Worse than before it: implicated.
    calm = Measurement(35.0, 1, 153, 0)
    worse = judge(m(3, 153, before=calm), DEFAULTS, remediates=OOM)
    assert worse is not None and worse.reason == PREEMPTION_RATE
    assert worse.text.endswith("; 0.65% in the 35 s before")
    # Nothing known from before: implicated, and said so.
    unknown = judge(m(3, 153), DEFAULTS, remediates=OOM)
    assert unknown is not None and unknown.text.endswith("(nothing known from before it)")
    # A preemption fix is still judged on the errors it may cause.
    errors = judge(m(0, 200, errors=4, before=storm), DEFAULTS, remediates=OOM)
    assert errors is not None and errors.reason == ERROR_RATE


def journal_change(
    store: Journal, runbook: str, before: dict[str, Any], after: dict[str, Any]
) -> int:
    """An execution of `runbook` that changed the knobs from `before` to `after`."""
    record, _ = store.create_execution(runbook, URL, trigger="rule", who="rules")
    store.transition(record.id, "running")
    row = store.add_step(record.id, "set_knobs", {}, before=before)
    store.finish_step(row.id, "applied", after=after, applied_at_step=100)
    store.transition(record.id, "succeeded")
    return int(record.id)


OOM_FIX = (
    {"max_num_batched_tokens": 512, "max_num_seqs": 16, "autopilot": False},
    {"max_num_batched_tokens": 256, "max_num_seqs": 5, "autopilot": True},
)


def before(preemptions: int, finished: int) -> Any:
    from vllm_runbook.collector.agent_api import Before

    return Before(
        seconds=35.0,
        preemptions=preemptions,
        requests_finished=finished,
        errors=0,
        engine_e2e_latency_p99=None,
    )


def test_oom_pressures_fix_with_residual_preemptions_below_the_storms_is_kept(
    setup: Any, store: Journal
) -> None:
    agent, _executor, breaker, trips = setup
    agent.knobs.update(max_num_batched_tokens=256, max_num_seqs=5, autopilot=True)
    fix = journal_change(store, "oom-pressure", *OOM_FIX)
    agent.stats = [
        {
            "since_preemptions": 3,
            "since_requests_finished": 153,
            "since_seconds": 35.0,
            "since_before": before(18, 153),
        }
    ]
    assert breaker.tick() == []
    assert trips == [] and store.get_execution(fix).status == "succeeded"
    assert (agent.knobs["max_num_batched_tokens"], agent.knobs["autopilot"]) == (256, True)


def test_a_fix_that_made_it_worse_falls_back_to_the_safe_setting_not_the_storm(
    setup: Any, store: Journal
) -> None:
    agent, executor, breaker, trips = setup
    agent.knobs.update(max_num_batched_tokens=256, max_num_seqs=4, autopilot=True)
    fix = journal_change(store, "oom-pressure", *OOM_FIX)
    agent.stats = [
        {
            "since_preemptions": 9,
            "since_requests_finished": 100,
            "since_seconds": 35.0,
            "since_before": before(2, 100),
        }
    ]
    [(change, trip)] = breaker.tick()
    assert (change.execution_id, trip.reason, trips) == (
        fix,
        PREEMPTION_RATE,
        [(URL, "preemption_rate")],
    )
    # Admission stays at the lowest of before, after and now; the autopilot off.
    assert (
        agent.knobs["max_num_batched_tokens"],
        agent.knobs["max_num_seqs"],
        agent.knobs["autopilot"],
    ) == (256, 4, False)
    assert store.get_execution(fix).status == "succeeded"  # not reverted into the storm
    [fallback] = store.list_executions(who=BREAKER_WHO)
    assert fallback.runbook == "circuit-breaker" and fallback.reverts_id is None
    assert fallback.reason is not None and fallback.reason.endswith(
        "falling back to the safe setting, not into the storm it answered"
    )
    assert fallback.verification is not None
    assert fallback.verification["breaker"]["fallback_for"] == fix
    # The hold covers the knobs it judged: oom-pressure waits, the FCFS switch does not.
    for runbook, status in (("oom-pressure", "refused"), ("latency-spike", "refused")):
        record, _ = store.create_execution(
            runbook,
            URL,
            trigger="alert",
            who="alertmanager",
            alert_fingerprint=runbook,
            alert_starts_at=utcnow(),
        )
        result = executor.run_pending(record.id, approved=True)
        held = (result.record.reason or "").startswith("circuit breaker hold")
        assert held == (runbook == "oom-pressure"), (runbook, result.record.reason)
        if runbook == "oom-pressure":
            assert result.record.status == status


def test_safe_setting_never_raises_admission() -> None:
    from vllm_runbook.runbooks.service.breaker import Change, safe_setting

    change = Change(URL, "runbook", *OOM_FIX, at=utcnow())
    assert safe_setting(change, {"max_num_batched_tokens": 256, "max_num_seqs": 9}) == {
        "max_num_batched_tokens": 256,
        "max_num_seqs": 5,
        "autopilot": False,
    }
    policy = Change(
        URL,
        "runbook",
        {"max_num_seqs": 32, "policy": "priority"},
        {"max_num_seqs": 8, "policy": "fcfs"},
        at=utcnow(),
    )
    assert safe_setting(policy, {"max_num_seqs": 8}) == {"max_num_seqs": 8, "policy": "priority"}
