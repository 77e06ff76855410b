"""`runbook report ID` and the summary pieces the demo prints, on a known journal
and signal history (no engine)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from vllm_runbook.runbooks.demo.report import (
    History,
    execution_lines,
    percentile,
    phase_rows,
    signals_path_for,
)
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.store import Journal, upgrade
from vllm_runbook.runbooks.store.models import Execution, ExecutionStatus

ENGINE = "http://127.0.0.1:9360"


def test_signal_history_lives_beside_a_sqlite_database(tmp_path: Path) -> None:
    assert (
        signals_path_for(f"sqlite:///{tmp_path}/x/runbook.db")
        == tmp_path / "x/runbook.signals.jsonl"
    )
    assert signals_path_for("postgresql+psycopg://u@h/db") is None
    assert signals_path_for("sqlite://") is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )
    assert percentile([], 99) is None


def _write(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_phase_rows_from_a_known_history(tmp_path: Path) -> None:
    t = 1000.0
    records: list[dict[str, object]] = [
        {"kind": "phase", "t": t, "name": "steady"},
        {"kind": "phase", "t": t + 10, "name": "burst"},
    ]
    # One sample a second for 20 s: preemptions start with the burst, 2 a second.
    for i in range(21):
        records.append(
            {
                "kind": "sample",
                "t": t + i,
                "engine": ENGINE,
                "preemptions": max(0, i - 10) * 2,
                "kv_cache_usage": 0.5 if i < 10 else 0.97,
            }
        )
    # Steady: 10 requests of 0.1..1.0 s; burst: 4 of 3 s, one failed.
    for k in range(10):
        records.append(
            {
                "kind": "request",
                "t0": t + k * 0.5,
                "t1": t + k * 0.5 + 0.1 * (k + 1),
                "phase": "steady",
                "priority": 0,
                "ok": True,
                "output_tokens": 20,
            }
        )
    for k in range(4):
        records.append(
            {
                "kind": "request",
                "t0": t + 11 + k,
                "t1": t + 14 + k,
                "phase": "burst",
                "priority": 0,
                "ok": k != 3,
                "output_tokens": 100,
            }
        )
    records.append({"kind": "sample", "t": t + 5, "engine": "http://other:1"})
    path = tmp_path / "runbook.signals.jsonl"
    _write(path, records)
    with path.open("a") as f:
        f.write('{"kind": "sample", "t": 10')  # a line cut short by a crash

    history = History.load(path, engine=ENGINE)
    assert len(history.samples) == 21
    steady, burst = phase_rows(history)
    assert steady["phase"] == "steady" and steady["seconds"] == 10
    assert steady["requests"] == 10
    assert steady["rps"] == pytest.approx(1.0)  # 10 finished within the first 10 s
    assert steady["tokens_per_s"] == pytest.approx(20.0)
    assert steady["p50_s"] == pytest.approx(0.5)
    assert steady["p99_s"] == pytest.approx(1.0)
    assert steady["preemptions"] == 0
    assert steady["peak_kv"] == 0.97  # the sample at the boundary belongs to both
    assert burst["requests"] == 3 and burst["failed"] == 1
    assert burst["p99_s"] == pytest.approx(3.0)
    assert burst["preemptions"] == 20


def _journal(db: str) -> tuple[int, int]:
    """An oom-pressure execution (budget halved, verified) and its revert."""
    store = Journal(db)
    rec, _ = store.create_execution(
        "oom-pressure",
        ENGINE,
        trigger="alert",
        who="rules:VllmOOMPressure",
        alert_fingerprint="rule-abc",
        alert_starts_at=datetime.now(UTC),
    )
    store.record_checks(rec.id, {"kv_usage": {"signal": "kv_cache_usage", "value": 0.98}})
    store.transition(rec.id, ExecutionStatus.RUNNING)
    step = store.add_step(
        rec.id,
        "scale_max_num_batched_tokens",
        {"factor": 0.5},
        before={"max_num_batched_tokens": 512},
    )
    store.finish_step(step.id, "applied", after={"max_num_batched_tokens": 256}, applied_at_step=7)
    store.transition(rec.id, ExecutionStatus.VERIFYING)
    store.record_verification(
        rec.id,
        {"signal": "preemptions_per_minute", "before": 40.0, "after": 4.0, "outcome": "improved"},
    )
    store.transition(rec.id, ExecutionStatus.SUCCEEDED)
    rev, _ = store.create_execution(
        "oom-pressure", ENGINE, trigger="rule", who="alertmanager", reverts_id=rec.id
    )
    store.transition(rev.id, ExecutionStatus.RUNNING)
    back = store.add_step(
        rev.id, "revert_knobs", {"of_execution": rec.id}, before={"max_num_batched_tokens": 256}
    )
    store.finish_step(back.id, "applied", after={"max_num_batched_tokens": 512})
    store.finish_step(step.id, "reverted")
    store.transition(rec.id, "reverted", reason=f"reverted by execution #{rev.id}")
    store.transition(rev.id, ExecutionStatus.SUCCEEDED)
    # The revert came half a minute after the change (the effect is measured until then).
    with store.session(write=True) as s:
        row = s.get(Execution, rev.id)
        assert row is not None and row.started_at is not None and row.finished_at is not None
        row.started_at += timedelta(seconds=30)
        row.finished_at += timedelta(seconds=30)
    return rec.id, rev.id


def test_report_draws_and_summarises_an_execution(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    now = time.time()
    # Preemptions rise 3 a second until the change lands, then stop.
    samples = []
    for i in range(-40, 1):
        samples.append(
            {
                "kind": "sample",
                "t": now + i,
                "engine": ENGINE,
                "preemptions": 3 * (i + 40),
                "requests_waiting": 5,
                "rps": 2.0,
                "max_num_batched_tokens": 512,
                "max_num_seqs": 16,
                "policy": "priority",
                "kv_cache_usage": 0.98,
            }
        )
    _write(
        tmp_path / "runbook.signals.jsonl",
        [{"kind": "phase", "t": now - 40, "name": "burst"}, *samples],
    )
    execution_id, revert_id = _journal(db)
    with (tmp_path / "runbook.signals.jsonl").open("a") as f:
        for i in range(1, 41):
            f.write(
                json.dumps(
                    {
                        "kind": "sample",
                        "t": time.time() + i,
                        "engine": ENGINE,
                        "preemptions": 120,
                        "requests_waiting": 1,
                        "rps": 2.0,
                        "max_num_batched_tokens": 256,
                        "max_num_seqs": 16,
                        "policy": "priority",
                        "kv_cache_usage": 0.8,
                    }
                )
                + "\n"
            )

    out_png = tmp_path / "r.png"
    # A revert's id reports the execution it reverted.
    assert main(["report", str(revert_id), "--db", db, "-o", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert f"execution #{execution_id}: oom-pressure on {ENGINE}" in out
    assert "max_num_batched_tokens 512 → 256 [reverted]" in out
    assert "verification: preemptions_per_minute 40 → 4: improved" in out
    assert f"revert #{revert_id}" in out and "max_num_batched_tokens 256 → 512" in out
    assert "preemptions/min 180 → 0" in out
    assert "burst" in out  # the phase table
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_report_without_history_prints_the_journal_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    execution_id, _ = _journal(db)
    assert main(["report", str(execution_id), "--db", db, "-o", str(tmp_path / "r.png")]) == 1
    captured = capsys.readouterr()
    assert "verification: preemptions_per_minute 40 → 4: improved" in captured.out
    assert "no signal history" in captured.err
    assert not (tmp_path / "r.png").exists()
    assert main(["report", "999", "--db", db]) == 2


def test_execution_lines_name_the_trigger_and_the_changes() -> None:
    execution = {
        "id": 3,
        "runbook": "latency-spike",
        "engine": ENGINE,
        "who": "rules:VllmHotPathBacklog",
        "trigger": "alert",
        "status": "refused",
        "reason": "cooldown: 4m left",
        "error": None,
        "checks": None,
        "verification": None,
        "steps": [],
    }
    assert execution_lines(execution, None, None) == [
        f"#3 latency-spike on {ENGINE} (rules:VllmHotPathBacklog, alert): refused",
        "    reason: cooldown: 4m left",
    ]


def test_execution_lines_say_unavailable_and_why_for_checks_verification_and_guards() -> None:
    """What the demo's summary and `runbook report` print for readings that
    could not be read: `unavailable` and why, next to the ones that could."""
    execution = {
        "id": 7,
        "runbook": "batch-too-large",
        "engine": ENGINE,
        "who": "ann",
        "trigger": "cli",
        "status": "succeeded",
        "reason": None,
        "error": None,
        "checks": {
            "running": {"signal": "requests_running", "value": 21},
            "p99_latency": {
                "signal": "engine_e2e_latency_p99",
                "value": None,
                "unavailable": "no request finished in the last 60 s",
            },
        },
        "verification": {
            "signal": "engine_e2e_latency_p99",
            "before": None,
            "after": 6.4,
            "from_step": 519,
            "measured_seconds": 30.2,
            "outcome": "unverified: engine_e2e_latency_p99 before: no request finished in the "
            "last 60 s",
            "guards": {
                "error_rate": {
                    "before": None,
                    "after": 0.0,
                    "required": True,
                    "outcome": "unavailable: before: no request finished in the last 60 s",
                },
                "preemptions_per_minute": {"before": 124.0, "after": 0.0, "outcome": "ok"},
            },
        },
        "steps": [],
    }
    assert execution_lines(execution, None, None) == [
        f"#7 batch-too-large on {ENGINE} (ann, cli): succeeded",
        "    checks: running 21, p99_latency unavailable: no request finished in the last 60 s",
        "    verification: engine_e2e_latency_p99 unavailable → 6.4: unverified: "
        "engine_e2e_latency_p99 before: no request finished in the last 60 s "
        "[after: from step 519, over 30 s]",
        "    guards: error_rate (required) unavailable: before: no request finished in the "
        "last 60 s; preemptions_per_minute 124 → 0 (ok)",
    ]


def test_the_story_fails_when_a_verification_disagrees_with_what_the_demo_measured(
    tmp_path: Path,
) -> None:
    from vllm_runbook.runbooks.demo.live import EventFeed
    from vllm_runbook.runbooks.demo.summary import verdict_disagreements
    from vllm_runbook.runbooks.demo.traffic import Request
    from vllm_runbook.runbooks.service import api

    feed = EventFeed("http://127.0.0.1:1", lambda line: None)
    # As /api/executions answers it (the feed keeps the API's models).
    spike = api.Execution.model_validate(
        {
            "id": 7,
            "runbook": "latency-spike",
            "engine": ENGINE,
            "trigger": "alert",
            "who": "rules:VllmRequestStarvation",
            "alert_fingerprint": None,
            "alert_starts_at": None,
            "dry_run": False,
            "status": "reverted",
            "display_status": "reverted",
            "interrupted": False,
            "reason": None,
            "error": None,
            "checks": None,
            "verification": {
                "signal": "starving_waiting",
                "before": 8,
                "after": 8,
                "outcome": "no measurable change",
            },
            "reverts_id": None,
            "hostname": None,
            "pid": None,
            "created_at": "2026-12-02T10:00:00+00:00",
            "started_at": None,
            "finished_at": None,
            "steps": [],
            "decision": None,
            "decided_by": None,
            "decided_at": None,
            "decision_note": None,
        }
    )
    feed.executions[7] = spike
    history = History([], [])
    served = [Request(t0=0.0, phase="starvation", priority=10, output_tokens=16, t1=5.0, ok=True)]
    effect = ("starved: 8 low-priority requests ... all done 3.1 s after the switch", None)
    assert verdict_disagreements(feed, history, served, effect) == [
        "latency-spike #7: verification starving_waiting 8 → 8: no measurable change, "
        "not improved, but the demo measured the fix work (starved: 8 low-priority "
        "requests ... all done 3.1 s after the switch)"
    ]
    # Judged improved while a starved request was never served: it says which.
    improved = {**(spike.verification or {}), "after": 0, "outcome": "improved"}
    feed.executions[7] = spike.model_copy(update={"verification": improved})
    stuck = [*served, Request(t0=0.0, phase="starvation", priority=10, output_tokens=16)]
    assert verdict_disagreements(feed, history, stuck, effect) == [
        "latency-spike #7: verification improved, but the demo measured 1 of the 2 "
        "starved requests not served"
    ]
    # Agreement: nothing to say.
    assert verdict_disagreements(feed, history, served, effect) == []
    # Nothing was starving when the switch took effect (the starved requests were
    # admitted between the checks and the switch): nothing to judge, a note, no failure.
    moot = {
        **(spike.verification or {}),
        "before": 0,
        "after": 0,
        "outcome": "no measurable change",
        "drain": {"starving_at_change": 0, "admitted_since": 1189},
    }
    feed.executions[7] = spike.model_copy(update={"verification": moot})
    assert verdict_disagreements(feed, history, served, effect) == []
    # ... but 8 starving at the switch and none served is a disagreement still.
    stuck_at_switch = {**moot, "before": 8, "after": 8, "drain": {"starving_at_change": 8}}
    feed.executions[7] = spike.model_copy(update={"verification": stuck_at_switch})
    assert len(verdict_disagreements(feed, history, served, effect)) == 1


def _switch(at: float, reverted_at: float) -> tuple[dict[str, object], dict[str, object]]:
    iso = lambda t: datetime.fromtimestamp(t, UTC).isoformat()  # noqa: E731
    step = {
        "action": "set_policy",
        "status": "reverted",
        "started_at": iso(at),
        "before": {"policy": "priority"},
        "after": {"policy": "fcfs"},
    }
    execution = {
        "id": 3,
        "runbook": "latency-spike",
        "engine": ENGINE,
        "who": "rules:VllmRequestStarvation",
        "trigger": "alert",
        "status": "reverted",
        "reason": None,
        "error": None,
        "checks": None,
        "verification": None,
        "steps": [step],
    }
    revert = {
        "id": 4,
        "status": "succeeded",
        "started_at": iso(reverted_at),
        "finished_at": iso(reverted_at),
        "steps": [],
    }
    return execution, revert


def test_an_after_window_the_revert_cut_is_said_with_its_length_not_as_n_a() -> None:
    t = 1000.0
    samples = [
        {"t": t + i, "preemptions": 0, "requests_waiting": 170.0, "rps": 6.0, "kv_cache_usage": 0.5}
        for i in range(0, 21)
    ]
    history = History(samples=samples)
    # The revert 1 s after the switch: no sample after it (the after-window
    # starts 2 s after the change).
    execution, revert = _switch(t + 20, t + 21)
    [effect_line] = [
        line for line in execution_lines(execution, revert, history) if "effect" in line
    ]
    assert effect_line.startswith(
        "    measured effect: the after-window was cut by the revert after 0 s (too short to "
        "measure; 20 s wanted); before the change: preemptions/min 0; requests waiting 170"
    )
    assert "n/a" not in effect_line
    # A revert 8 s after: measured, and the cut said.
    history = History(samples=[*samples, *({**s, "t": s["t"] + 21} for s in samples[:10])])
    execution, revert = _switch(t + 20, t + 28)
    [effect_line] = [
        line for line in execution_lines(execution, revert, history) if "effect" in line
    ]
    assert effect_line.startswith(
        "    measured effect (20 s before the change → after it, cut by the revert after 6 s): "
    )


def test_the_starvation_narration_says_what_was_measured() -> None:
    from vllm_runbook.runbooks.demo.story import backlog_said

    assert backlog_said(3, 4, 0) == (
        "while low-priority requests waited, at least 3 high-priority ones waited ahead "
        "of them at every reading (queue kept 4 deep)"
    )
    said = backlog_said(0, 4, 7)
    assert "at least 0" not in said
    assert said == (
        "while low-priority requests waited, the high-priority queue (kept 4 deep) was "
        "empty at 7 reading(s): they waited behind the running ones"
    )
