"""EngineControl's bounds, clamping and ordering on a fake scheduler."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest
from vllm_runbook.collector.agent_api import ChangeResult, Clamped, KnobChange, Knobs
from vllm_runbook.collector.auth import check_bearer, find_local_token, generate_token, is_loopback
from vllm_runbook.collector.control import (
    BoundsError,
    Command,
    ControlError,
    EngineControl,
    parse_command,
)


def fake_scheduler(chunked: bool = True, budget: int = 512, seqs: int = 32, spec: object = None):
    config = SimpleNamespace(
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        policy="fcfs",
        disable_chunked_mm_input=False,
    )
    return SimpleNamespace(
        scheduler_config=config,
        max_num_scheduled_tokens=budget,
        max_num_active_reqs=seqs,
        policy=SimpleNamespace(value="fcfs"),
        max_model_len=1024,
        vllm_config=SimpleNamespace(speculative_config=spec),
        max_num_encoder_input_tokens=0,
    )


def control(**kw: object) -> EngineControl:
    return EngineControl(fake_scheduler(**kw), current_step=lambda: 41)


def apply(c: EngineControl, body: dict, restore: bool = False) -> ChangeResult:
    return c.submit(parse_command(body, restore=restore), wait_s=1)


def test_halving_sets_both_scheduler_fields_and_reports_the_step() -> None:
    scheduler = fake_scheduler()
    original_config = scheduler.scheduler_config  # the process-wide VllmConfig's
    c = EngineControl(scheduler, current_step=lambda: 41)
    result = apply(c, {"scale_max_num_batched_tokens": 0.5})
    assert result.changes == [KnobChange(knob="max_num_batched_tokens", before=512, after=256)]
    assert result.effective_from_step == 42
    assert c.scheduler.max_num_scheduled_tokens == 256
    assert c.scheduler.scheduler_config.max_num_batched_tokens == 256
    assert c.scheduler.scheduler_config is not original_config  # copied: no leak
    assert original_config.max_num_batched_tokens == 512


def test_above_startup_is_refused_with_the_reason() -> None:
    c = control()
    apply(c, {"max_num_batched_tokens": 256})
    with pytest.raises(BoundsError, match=r"max_num_batched_tokens=1024 is above the maximum 512"):
        apply(c, {"max_num_batched_tokens": 1024})
    with pytest.raises(BoundsError, match=r"max_num_seqs=33 is above the maximum 32: raising"):
        apply(c, {"max_num_seqs": 33})
    assert c.knobs()["max_num_batched_tokens"] == 256  # nothing changed
    clamped = apply(c, {"max_num_batched_tokens": 1024, "clamp": True})
    assert clamped.after.max_num_batched_tokens == 512
    assert clamped.clamped == [Clamped(knob="max_num_batched_tokens", requested=1024, applied=512)]


def test_budget_floor_follows_the_admission_limit() -> None:
    c = control()
    with pytest.raises(BoundsError, match=r"below the minimum 32: every admitted sequence"):
        apply(c, {"max_num_batched_tokens": 16})
    result = apply(c, {"max_num_batched_tokens": 16, "max_num_seqs": 8})
    assert result.after == Knobs(
        max_num_batched_tokens=16,
        max_num_seqs=8,
        policy="fcfs",
        autopilot=False,
        autopilot_target=0.9,
    )


def test_autopilot_switch_and_target_are_knobs() -> None:
    c = control()
    result = apply(c, {"autopilot": "on", "autopilot_target": 0.8})
    assert result.changes == [
        KnobChange(knob="autopilot", before=False, after=True),
        KnobChange(knob="autopilot_target", before=0.9, after=0.8),
    ]
    assert c.autopilot.enabled and c.autopilot.limit == 32 and c.autopilot.target == 0.8
    # Its own changes: clamped to 1..min(startup max_num_seqs, budget).
    assert c.apply_autopilot(99) == 32 and c.apply_autopilot(0) == 1
    apply(c, {"max_num_batched_tokens": 16, "max_num_seqs": 1, "autopilot": True})
    assert c.autopilot_ceiling() == 16 and c.apply_autopilot(20) == 16
    # max_num_seqs set by hand: the operator takes over.
    result = apply(c, {"max_num_seqs": 4})
    assert KnobChange(knob="autopilot", before=True, after=False) in result.changes
    assert not c.autopilot.enabled and c.scheduler.max_num_active_reqs == 4
    apply(c, {"autopilot": "on"})
    result = apply(c, {}, restore=True)
    assert result.after.autopilot is False and result.after.autopilot_target == 0.9
    assert result.after.max_num_seqs == 32 and not c.autopilot.enabled


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"autopilot": "maybe"}, "autopilot must be on or off, got 'maybe'"),
        ({"autopilot_target": 0}, r"autopilot_target must be in \(0, 1\], got 0"),
        ({"autopilot_target": 1.5}, r"autopilot_target must be in \(0, 1\], got 1.5"),
        ({"autopilot_target": "0.9"}, "autopilot_target must be a number"),
    ],
)
def test_bad_autopilot_values_are_refused(body: dict, message: str) -> None:
    with pytest.raises(ControlError, match=message) as refused:
        parse_command(body)
    assert refused.value.status == 400


def test_without_chunked_prefill_the_budget_stays_at_max_model_len() -> None:
    c = control(chunked=False, budget=2048, seqs=8)
    assert c.bounds()["max_num_batched_tokens"].minimum == 1024
    with pytest.raises(BoundsError, match=r"below the minimum 1024: chunked prefill is off"):
        apply(c, {"scale_max_num_batched_tokens": 0.25})
    assert (
        apply(c, {"scale_max_num_batched_tokens": 0.25, "clamp": True}).after.max_num_batched_tokens
        == 1024
    )


def test_speculative_draft_slots_are_a_floor() -> None:
    c = control(seqs=1, spec=SimpleNamespace(max_num_new_slots_for_drafting=4))
    assert c.bounds()["max_num_batched_tokens"].minimum == 5


def test_dry_run_changes_nothing() -> None:
    c = control()
    result = apply(c, {"max_num_seqs": 4, "dry_run": True})
    assert result.would_be is not None and result.would_be.max_num_seqs == 4
    assert result.after.max_num_seqs == 32
    assert c.scheduler.max_num_active_reqs == 32


def test_restore_returns_to_startup() -> None:
    c = control()
    apply(c, {"max_num_batched_tokens": 128, "max_num_seqs": 4})
    result = apply(c, {}, restore=True)
    assert result.after.max_num_batched_tokens == 512 and result.after.max_num_seqs == 32


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "JSON object"),
        ({"max_num_batched_tokens": "256"}, "must be an integer"),
        ({"max_num_batched_tokens": True}, "must be an integer"),
        ({"scale_max_num_batched_tokens": 2}, r"in \(0, 1\]"),
        ({"policy": "lifo"}, "policy must be one of"),
        ({"foo": 1}, "unknown field"),
        ({}, "nothing to change"),
        ({"max_num_batched_tokens": 8, "scale_max_num_batched_tokens": 0.5}, "not both"),
    ],
)
def test_malformed_commands(body: object, message: str) -> None:
    with pytest.raises(ControlError, match=message):
        parse_command(body)


def test_commands_from_many_threads_apply_in_order() -> None:
    c = control()
    results: list[ChangeResult] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        for j in range(20):
            r = c.submit(Command({"max_num_seqs": 1 + (i * 20 + j) % 32}), wait_s=5)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: r.seq)
    assert [r.seq for r in results] == list(range(1, 161))
    for prev, cur in itertools.pairwise(results):
        assert cur.before == prev.after  # a chain: each saw the last one's result


def test_tokens() -> None:
    assert check_bearer("Bearer s3cret", "s3cret")
    assert check_bearer("bearer s3cret", "s3cret")
    assert not check_bearer("Bearer wrong", "s3cret")
    assert not check_bearer("Basic czNjcmV0", "s3cret")
    assert not check_bearer(None, "s3cret")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_generated_token_is_private(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path / "rt"
    token, path = generate_token(9360, directory)
    assert path.stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    assert find_local_token(9360, directory) == token
    assert find_local_token(9361, directory) is None
    directory.chmod(0o755)
    with pytest.raises(Exception, match="accessible by other users"):
        generate_token(9360, directory)


def test_agent_token_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm_runbook.collector.auth import TokenError
    from vllm_runbook.collector.settings import agent_token

    assert agent_token("127.0.0.1", {}) is None  # loopback: generate one
    with pytest.raises(TokenError, match="not loopback"):
        agent_token("0.0.0.0", {})
    assert agent_token("0.0.0.0", {"VLLM_RUNBOOK_TOKEN": "t0k"}) == "t0k"
    (tmp_path / "tok").write_text("from-file\n")
    assert (
        agent_token("10.0.0.5", {"VLLM_RUNBOOK_TOKEN_FILE": str(tmp_path / "tok")}) == "from-file"
    )
    with pytest.raises(TokenError, match="cannot read"):
        agent_token("127.0.0.1", {"VLLM_RUNBOOK_TOKEN_FILE": str(tmp_path / "missing")})
