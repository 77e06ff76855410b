"""The Prometheus and Alertmanager configuration bundle passes the tools' own checks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from vllm_runbook.dashboards.generate import DASHBOARDS_DIR, RULE_FILE

from tests.engines import require_tool


def _copy_bundle(tmp_path: Path) -> Path:
    for name in ("prometheus.yml", "alertmanager.yml", RULE_FILE):
        shutil.copy(DASHBOARDS_DIR / name, tmp_path / name)
    return tmp_path


def test_promtool_accepts_the_prometheus_config_and_its_rule_file(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    bundle = _copy_bundle(tmp_path)
    done = subprocess.run(
        [promtool, "check", "config", str(bundle / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout + done.stderr


def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    bundle = _copy_bundle(tmp_path)
    path = bundle / "prometheus.yml"
    path.write_text(path.read_text().replace("target_label: instance", "target_label: 1nstance"))
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, timeout=60)
    assert done.returncode != 0


def test_amtool_accepts_the_alertmanager_config(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    bundle = _copy_bundle(tmp_path)
    done = subprocess.run(
        [amtool, "check-config", str(bundle / "alertmanager.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 receivers" in done.stdout


def test_amtool_rejects_a_broken_config(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    bundle = _copy_bundle(tmp_path)
    path = bundle / "alertmanager.yml"
    path.write_text(path.read_text().replace("receiver: runbook-serve", "receiver: nobody"))
    done = subprocess.run([amtool, "check-config", str(path)], capture_output=True, timeout=60)
    assert done.returncode != 0
