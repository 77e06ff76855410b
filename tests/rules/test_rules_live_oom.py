"""Live: a real CPU vLLM engine driven into preemptions fires VllmOOMPressure in the
embedded evaluator within the rule's `for` plus two evaluation intervals.

The service runs as deployed (config file, APScheduler in a background thread,
scraping the engine's agent over HTTP, incidents to a SQLite store, automation
handing the incident to a hook) while this thread keeps stepping the engine.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from apscheduler.schedulers.background import BackgroundScheduler
from vllm_runbook.rules.remediation import Handoff
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.service.rules_service import RulesService
from vllm_runbook.runbooks.store import Journal, upgrade

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

FOR_SECONDS, WINDOW, INTERVAL = 2.0, "10s", 0.5
# The seed threshold. The rule reads the collector's KV usage peak, sampled at
# the start of each step: in this 31-block cache a preemption frees up to 10
# blocks, so the usage after the step (0.71-0.90, measured) would miss it.
KV_USAGE = 0.95


class FiringHook:
    def __init__(self) -> None:
        self.fired = threading.Event()
        self.calls: list[tuple[float, Handoff]] = []

    def on_firing(self, handoff: Handoff) -> None:
        self.calls.append((time.time(), handoff))
        self.fired.set()

    def on_resolved(self, handoff: Handoff) -> None:
        pass


def test_preemptions_fire_oom_pressure_in_time(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 32 blocks (31 usable) of 32 tokens for 16 requests growing to 300 tokens.
    engine = InProcessEngine.start(
        tiny_model, num_gpu_blocks_override=32, max_num_seqs=16, max_model_len=512
    )
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    config_path = tmp_path / "runbook.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "database": db,
                "engines": [{"name": "cpu-0", "agent": engine.collector.server.url}],
                "rules": {
                    "evaluation_interval": f"{int(INTERVAL * 1000)}ms",
                    "overrides": {
                        "VllmOOMPressure": {
                            "for": f"{FOR_SECONDS:g}s",
                            "window": WINDOW,
                            "kv_usage": KV_USAGE,
                        }
                    },
                },
                "automation": {"oom-pressure": "auto"},
            }
        ),
        encoding="utf-8",
    )
    config = load_config(config_path)
    store = Journal(config.database)
    hook = FiringHook()
    service = RulesService.from_config(config, store=store, hook=hook)
    scheduler = BackgroundScheduler()
    service.start(scheduler)

    scheduler_obj = engine.scheduler
    preempted_at: list[float] = []
    original = scheduler_obj._preempt_request

    def spying_preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted_at.append(time.time())
        return original(request, *args, **kwargs)

    scheduler_obj._preempt_request = spying_preempt
    scheduler.start()
    try:
        time.sleep(2 * INTERVAL)  # a few quiet scrapes first: the counter's baseline
        for i in range(16):
            engine.add(f"long-{i}", 200, max_tokens=100, offset=20 * i)
        deadline = time.monotonic() + 60
        while not hook.fired.is_set() and time.monotonic() < deadline:
            if engine.engine.has_unfinished_requests():
                engine.step()
                time.sleep(0.001)  # let the scraper and the agent's threads in
            else:
                hook.fired.wait(0.05)
    finally:
        scheduler.shutdown(wait=True)  # before draining: one incident to look at
        del scheduler_obj._preempt_request
    engine.run_until_done()

    try:
        assert preempted_at, "the workload must really preempt"
        assert hook.calls, "VllmOOMPressure did not fire within 60 s"
        fired_wall, handoff = hook.calls[0]
        # The firing time is the evaluation that found `for` elapsed; the hook is
        # called right after the store has recorded it.
        delay = handoff.incident.at - preempted_at[0]
        limit = FOR_SECONDS + 2 * INTERVAL
        with capsys.disabled():
            print(
                f"\nVllmOOMPressure: first preemption -> firing in {delay:.2f} s "
                f"(limit: for {FOR_SECONDS:g} s + 2 x {INTERVAL:g} s = {limit:g} s; "
                f"pending at {handoff.incident.first_seen - preempted_at[0]:+.2f} s; hook "
                f"called {fired_wall - handoff.incident.at:.3f} s after; "
                f"{len(preempted_at)} preemptions)"
            )
        assert 0 < delay <= limit
        assert handoff.incident.at - handoff.incident.first_seen >= FOR_SECONDS  # never early
        assert (handoff.incident.alert, handoff.mode, handoff.runbook, handoff.engine_name) == (
            "VllmOOMPressure",
            "auto",
            "oom-pressure",
            "cpu-0",
        )
        [row] = store.list_incidents(alert="VllmOOMPressure")
        assert (row.engine, row.state, row.severity) == ("cpu-0", "firing", "critical")
        assert row.value is not None and row.value >= KV_USAGE

        # The checklist against the same live engine: on this CPU machine the GPU
        # lines are n/a and say why; idle now, nothing else can fail either.
        capsys.readouterr()
        code = main(["check", "--engine", engine.collector.server.url, "--interval", "0.2"])
        out = capsys.readouterr().out
        assert code == 0, out
        gpu = [line for line in out.splitlines() if "GPU utilisation" in line]
        assert gpu and gpu[0].split()[0] == "N/A" and "nvml_up 0" in gpu[0]
    finally:
        store.close()
        engine.close()
