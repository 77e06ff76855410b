"""`runbook check --soak`: the reports' long stability check, on a real CPU engine.

The soak scrapes the engine over the whole period and evaluates the alert
catalog on it at every scrape, as `runbook serve` does, with the
deployment's rule overrides (`--config`). Short here: a 6 s soak, scraped
every 1 s, with VllmOOMPressure's `for` and window shortened as in
test_rules_live_oom.py. A steady light load fires nothing; a preemption storm
fires VllmOOMPressure, which fails the soak and names the alert.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engines import REPO_ROOT, InProcessEngine, runbook_cli_command, runbook_cli_env

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    # 32 blocks (31 usable) of 32 tokens: 16 requests growing to 300 tokens preempt.
    eng = InProcessEngine.start(
        tiny_model, num_gpu_blocks_override=32, max_num_seqs=16, max_model_len=512
    )
    yield eng
    eng.close()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "runbook.yaml"
    overrides = {"VllmOOMPressure": {"for": "2s", "window": "10s", "kv_usage": 0.95}}
    path.write_text(yaml.safe_dump({"rules": {"overrides": overrides}}), encoding="utf-8")
    return path


def soak(engine: InProcessEngine, config: Path, drive: Callable[[], None]) -> tuple[int, Any]:
    url = str(engine.collector.server.url)
    args = ["check", "--engine", url, "--soak", "6s", "--interval", "1"]
    proc = subprocess.Popen(
        runbook_cli_command(*args, "--config", str(config), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=runbook_cli_env(),
    )
    while proc.poll() is None:
        drive()
    out, err = proc.communicate()
    assert "Traceback" not in err, err
    report = json.loads(out)
    engine.engine.abort_request(list(engine.scheduler.requests))
    engine.run_until_done()
    return proc.returncode, report


def checks(report: Any) -> dict[str, Any]:
    return {c["name"]: c for c in report["checks"]}


def test_a_steady_load_soaks_without_a_finding(engine: InProcessEngine, config: Path) -> None:
    sent = [0]

    def light() -> None:  # two short requests at a time: the cache stays far from full
        while len(engine.scheduler.requests) < 2:
            engine.add(f"light-{sent[0]}", 32, max_tokens=16, offset=7 * sent[0])
            sent[0] += 1
        engine.step()

    code, report = soak(engine, config, light)
    found = checks(report)["findings"]
    assert (found["status"], found["shown"], found["note"]) == (
        "pass",
        "0",
        "no alert of the catalog fired",
    )
    assert report["scrapes"] == 7  # 6 s every 1 s, both ends
    assert 5 < report["sampled_seconds"] < 8
    assert checks(report)["throughput variation"]["status"] in ("pass", "fail")
    assert code == (1 if report["summary"]["fail"] else 0)


def test_a_preemption_storm_fails_the_soak_and_names_the_alert(
    engine: InProcessEngine, config: Path
) -> None:
    sent = [0]

    def storm() -> None:  # 16 requests of 200 + 100 tokens in 31 blocks, refilled
        while len(engine.scheduler.requests) < 16:
            engine.add(f"storm-{sent[0]}", 200, max_tokens=100, offset=20 * sent[0])
            sent[0] += 1
        engine.step()

    code, report = soak(engine, config, storm)
    found = checks(report)["findings"]
    assert found["status"] == "fail"
    assert found["note"].startswith("fired: VllmOOMPressure at +")
    assert checks(report)["OOM (preemption) rate"]["status"] != "pass"
    assert code == 1
