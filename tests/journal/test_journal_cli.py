"""The journal CLI handlers: exit codes, tables, stable JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.store import Journal


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_db_upgrade_then_empty_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    # Read-only on a store that does not exist yet: nothing to show, nothing created.
    assert run(capsys, "history", "--db", url) == (0, "no executions yet\n", "")
    assert not (tmp_path / "c.db").exists()
    assert run(capsys, "db", "upgrade", "--db", url) == (
        0,
        f"{url}: at revision 0005 (head 0005)\n",
        "",
    )
    assert run(capsys, "history", "--db", url) == (0, "no executions recorded\n", "")
    assert run(capsys, "history", "--db", url, "--json") == (0, '{\n  "executions": []\n}\n', "")


def test_history_table_and_json(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = Journal(sqlite_url)
    first, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="alice")
    store.transition(first.id, "running")
    step = store.add_step(first.id, "set_policy", {"policy": "fcfs"}, before={"policy": "priority"})
    store.finish_step(step.id, "applied", after={"policy": "fcfs"})
    store.transition(first.id, "succeeded")
    second, _ = store.create_execution("warmup", "llama-1", trigger="rule", who="rules")
    store.transition(second.id, "refused", reason="cooldown: 120 s left")
    store.close()

    code, out, err = run(capsys, "history", "--db", sqlite_url)
    assert (code, err) == (0, "")
    header, row2, row1 = out.splitlines()
    assert header.split() == [
        "ID",
        "RUNBOOK",
        "ENGINE",
        "STATUS",
        "TRIGGER",
        "WHO",
        "STARTED",
        "APPLIED",
        "NOTE",
    ]
    assert row2.split()[:6] == ["2", "warmup", "llama-1", "refused", "rule", "rules"]
    assert row2.endswith("0/0      cooldown: 120 s left")
    assert row1.split()[:6] == ["1", "oom-pressure", "llama-0", "succeeded", "cli", "alice"]
    assert row1.endswith("1/1")

    code, out, _ = run(capsys, "history", "--db", sqlite_url, "--engine", "llama-0", "--json")
    (shown,) = json.loads(out)["executions"]
    assert sorted(shown) == sorted(
        [
            "id",
            "runbook",
            "engine",
            "trigger",
            "who",
            "alert_fingerprint",
            "alert_starts_at",
            "dry_run",
            "status",
            "display_status",
            "interrupted",
            "reason",
            "error",
            "checks",
            "verification",
            "reverts_id",
            "hostname",
            "pid",
            "created_at",
            "started_at",
            "finished_at",
            "steps",
            "decision",
            "decided_by",
            "decided_at",
            "decision_note",
            "hold_since",
            "hold_note",
            "hold_for_person",
            "premature",
        ]
    )
    assert (shown["id"], shown["status"]) == (1, "succeeded")
    assert [(s["action"], s["before"], s["after"]) for s in shown["steps"]] == [
        ("set_policy", {"policy": "priority"}, {"policy": "fcfs"})
    ]

    code, out, _ = run(capsys, "history", "1", "--db", sqlite_url)
    assert code == 0
    assert "  1  set_policy  applied  policy: priority → fcfs  -" in out.splitlines()
    assert run(capsys, "history", "7", "--db", sqlite_url) == (
        2,
        "",
        "runbook: error: no execution with id 7\n",
    )


def test_history_store_down_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "history", "--db", "postgresql://u:pw@127.0.0.1:1/x")
    assert (code, out) == (4, "")
    assert err.startswith(
        "runbook: error: store postgresql+psycopg://u:***@127.0.0.1:1/x unavailable: "
    )
    assert err.count("\n") == 1 and "Traceback" not in err and "pw@" not in err


def test_list_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "TRIGGERS", "STEPS", "APPROVAL"]
    assert [line.split()[0] for line in lines[1:]] == [
        "batch-too-large",
        "batch-utilization-low",
        "engine-stalled",
        "engine-stuck",
        "error-rate-high",
        "gpu-compute-skew",
        "gpu-memory-imbalance",
        "hot-path-backlog",
        "kv-hit-low",
        "latency-spike",
        "memory-leak",
        "oom-pressure",
        "padding-high",
        "restore",
        "spec-decode-acceptance-low",
        "throughput-drop",
        "warmup",
    ]
    code, out, _ = run(capsys, "list", "--json")
    names = [r["name"] for r in json.loads(out)["runbooks"]]
    assert names[11] == "oom-pressure" and len(names) == 17

    code, out, _ = run(capsys, "show", "oom-pressure")
    assert code == 0
    lines = out.splitlines()
    assert lines[2] == "Triggers: VllmOOMPressure, VllmOOMRateHigh"
    steps = lines[lines.index("Steps") + 1 :]
    assert steps[1].split()[:3] == ["1", "scale_max_num_batched_tokens", "factor=0.5"]
    assert steps[2].split()[:7] == [
        "2",
        "set_max_num_seqs",
        "value=kv_capacity",
        "preemptions_per_minute",
        ">",
        "0",
        "after",
    ]
    assert (
        "  preemptions_per_minute ≤ 50% of before, measured after the change took effect, "
        "within 120 s"
    ) in lines
    assert "  roll back if worse: oom_rate, error_rate" in lines
    code, out, _ = run(capsys, "show", "latency-spike", "--json")
    runbook = json.loads(out)["runbook"]
    assert runbook["steps"] == [
        {
            "action": "set_policy",
            "params": {"policy": "fcfs"},
            "when": None,
            "description": "Serve waiting requests in arrival order",
        }
    ]


def test_show_unknown_and_broken_catalog(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "show", "nope")
    assert code == 2 and err.startswith(
        "runbook: error: unknown runbook 'nope' (known: batch-too-large,"
    )
    (tmp_path / "x.yaml").write_text("name: x\ndescription: d\nsteps:\n  - action: halve\n")
    code, out, err = run(capsys, "list", "--catalog", str(tmp_path))
    assert (code, out) == (2, "")  # a broken catalog is a usage error
    assert err.startswith("runbook: error: invalid runbook catalog:\n")
    assert err.rstrip().endswith("x.yaml:4: runbook x: unknown action 'halve'")


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--limit", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err
