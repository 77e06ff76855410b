"""`rules export` / `rules check` as the runbook CLI will call them; promtool checks the export."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from rule_harness import promtool_required
from vllm_runbook.runbooks.operate.cli import main

PREFIX = "runbook: error: "  # the first line of an error; a catalog's other problems follow


def run(argv: list[str]) -> int:
    return main(argv)


def test_check_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["rules", "check"]) == 0
    assert capsys.readouterr().out == "ok: 25 rules (23 alerts) in 5 files\n"


def test_check_broken_directory_exits_2_with_one_line_per_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.yaml").write_text("rules:\n  - alert: X\n", encoding="utf-8")
    assert run(["rules", "check", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert all(
        line.removeprefix(PREFIX).startswith(str(tmp_path / "a.yaml") + ":2: rule X: ")
        for line in err.splitlines()
    )


def test_export_applies_config_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "runbook.yaml"
    config.write_text(
        yaml.safe_dump({"rules": {"overrides": {"VllmLatencySpike": {"p99_sla_seconds": 0.5}}}})
    )
    assert run(["rules", "export", "--format", "prometheus", "--config", str(config)]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    [spike] = [r for g in doc["groups"] for r in g["rules"] if r["alert"] == "VllmLatencySpike"]
    assert "[5m]))) > 0.5) or" in spike["expr"]
    assert spike["labels"] == {"severity": "critical", "runbook": "latency-spike"}
    assert spike["annotations"]["runbook_url"] == "runbooks/catalog/latency-spike"


def test_export_bad_override_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "runbook.yaml"
    config.write_text("rules:\n  overrides:\n    VllmLatencySpike: {p99_sla: 0.5}\n")
    assert run(["rules", "export", "--config", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    # Located in the configuration file, at the alert's key under rules.overrides.
    assert err == [
        f"{PREFIX}{config}:3: rule VllmLatencySpike: override of unknown parameter 'p99_sla' (has: "
        "earlier, earlier_rise, for, p99_sla_seconds, queue_rise, window)"
    ]


def test_export_passes_promtool_check_rules(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        pytest.skip("promtool not installed; CI fails instead")
    out = tmp_path / "vllm-runbook.rules.yml"
    assert run(["rules", "export", "-o", str(out)]) == 0
    result = subprocess.run(
        ["promtool", "check", "rules", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 25 rules found" in result.stdout


def test_rule_labels_are_checked_against_the_runbook_catalog_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_runbook.rules.model import CATALOG_DIR as RULES_DIR
    from vllm_runbook.runbooks.model.spec import CATALOG_DIR as RUNBOOKS_DIR

    rules, runbooks = tmp_path / "rules", tmp_path / "runbooks"
    for src, dst in ((RULES_DIR, rules), (RUNBOOKS_DIR, runbooks)):
        dst.mkdir()
        for f in src.glob("*.yaml"):
            text = f.read_text(encoding="utf-8").replace("oom-pressure", "kv-relief")
            (dst / f.name).write_text(text, encoding="utf-8")
    assert run(["rules", "check", str(rules), "--catalog", str(runbooks)]) == 0
    assert capsys.readouterr().out == "ok: 25 rules (23 alerts) in 5 files\n"
    # Against the shipped runbook catalog the renamed label names nothing.
    assert run(["rules", "check", str(rules)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(
        "unknown runbook 'kv-relief' (known: batch-too-large, batch-utilization-low, "
        "engine-stalled, engine-stuck, error-rate-high," in line
        for line in err
    )
    assert run(["rules", "export", "--rules", str(rules), "--catalog", str(runbooks)]) == 0
    assert "runbook: kv-relief" in capsys.readouterr().out
    # A broken runbook catalog: one message, exit 2, no traceback.
    (runbooks / "oom-pressure.yaml").write_text("name: [\n", encoding="utf-8")
    assert run(["rules", "check", str(rules), "--catalog", str(runbooks)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX + "invalid runbook catalog:\n") and "Traceback" not in err
