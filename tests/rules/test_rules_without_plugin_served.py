"""Live: a stock vLLM server (plugins disabled, `VLLM_PLUGINS=`) under a preemption
storm (a growing number of closed-loop clients on a 31-block cache). The embedded
evaluator, scraping only vLLM's own /metrics, evaluates the rules that work without
the plugin on vLLM's series (they fire on the storm: preemptions, a queue with slow
requests, no prefix-cache hits) and says that each of the others needs the plugin.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path

import pytest
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.needs import needs
from vllm_runbook.rules.scrape import Scraper, Target

from tests.engines import ServedEngine, http_get

pytestmark = [pytest.mark.engine, pytest.mark.served]

INTERVAL = 0.25  # scrape and evaluate
WINDOW_SECONDS = 10.0
WINDOW = f"{WINDOW_SECONDS:.0f}s"
# Short windows and `for` periods: the storm lasts seconds on this machine. A window
# holds several scrapes even when a loaded machine makes a cycle take seconds (a
# rate needs two in its window; one missing evaluation sends a pending alert back).
OVERRIDES = {
    "VllmOOMRateHigh": {"window": WINDOW, "for": "1s"},
    "VllmLatencySpike": {"window": WINDOW, "for": "1s", "p99_sla_seconds": 0.5},
    "VllmKVCacheHitRatioLow": {"for": "1s"},
    "VllmOOMPressure": {"window": WINDOW, "for": "1s"},
}
# What a storm of distinct long prompts on a 31-block cache must fire without the plugin.
MUST_FIRE = {"VllmOOMRateHigh", "VllmLatencySpike", "VllmKVCacheHitRatioLow"}
# The storm: closed-loop clients, 16 at first and 2 more a second up to 64, so the
# queue keeps growing over the latency rule's windows however fast the engine is today.
FIRST_CLIENTS, CLIENTS_PER_SECOND, MAX_CLIENTS = 16, 2, 64
STORM_SECONDS = 90


def test_rules_without_the_plugin_fire_on_vllms_own_series(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rules = load_catalog().bind(OVERRIDES)
    store = store_for_rules(rules)
    sink = MemoryIncidentSink()
    evaluator = Evaluator(rules, store, sink)
    with ServedEngine.run(
        tiny_model,
        tmp_path / "serve.log",
        env={"VLLM_PLUGINS": ""},
        # 32 blocks (31 usable) of 32 tokens for requests growing to 300 tokens
        extra_args=[
            *("--num-gpu-blocks-override", "32", "--max-num-seqs", "16", "--max-model-len", "512")
        ],
    ) as served:
        assert "vllm_runbook_" not in http_get(served.api_url + "/metrics")[1]
        scraper = Scraper(store, [Target(served.api_url + "/metrics", "cpu-0")])

        scrape_errors: list[str] = []

        def cycle() -> None:
            # A scrape that times out on a loaded machine is what the service meets
            # too: the series go stale and the next cycle goes on.
            [result] = scraper.scrape_once()
            if not result.ok:
                scrape_errors.append(str(result.error))
            evaluator.evaluate()

        errors: list[BaseException] = []
        stopping = threading.Event()
        offsets = itertools.count()
        cycle_ends: list[float] = []

        def client() -> None:
            while not stopping.is_set():
                try:
                    served.complete(200, max_tokens=100, offset=20 * next(offsets))
                except BaseException as exc:  # reported below, unless the test ended it
                    if not stopping.is_set():
                        errors.append(exc)
                    return

        def fired_now() -> set[str]:
            return {e.alert for e in sink.events if e.state == "firing"}

        with caplog.at_level(logging.WARNING, logger="vllm_runbook.rules.evaluator"), scraper:
            # Two windows of an idle engine first: the queue's earlier value, the rates' start.
            quiet_until = time.monotonic() + 2.5 * WINDOW_SECONDS
            while time.monotonic() < quiet_until:
                cycle()
                time.sleep(INTERVAL)
            assert fired_now() == set()
            started = time.monotonic()
            clients: list[threading.Thread] = []
            while time.monotonic() - started < STORM_SECONDS and not fired_now() >= MUST_FIRE:
                ramp = FIRST_CLIENTS + CLIENTS_PER_SECOND * (time.monotonic() - started)
                while len(clients) < min(MAX_CLIENTS, ramp):
                    clients.append(threading.Thread(target=client, daemon=True))
                    clients[-1].start()
                cycle()
                cycle_ends.append(time.monotonic())
                time.sleep(INTERVAL)
            storm_seconds = time.monotonic() - started
            stopping.set()
        assert errors == []
    # The server is gone: the requests still queued there end with a connection error.
    joined_by = time.monotonic() + 30
    for t in clients:
        t.join(timeout=max(0.0, joined_by - time.monotonic()))

    fired = {e.alert for e in sink.events if e.state == "firing"}
    [engine] = store.engines
    assert engine[0] == "cpu-0" and evaluator.without_plugin == {engine}
    pending = sorted({e.alert for e in sink.events if e.state == "pending"})
    gaps = [b - a for a, b in zip([started, *cycle_ends], cycle_ends, strict=False)]
    assert fired >= MUST_FIRE, (
        f"fired {sorted(fired)}, pending at some point {pending}, after {storm_seconds:.0f} s "
        f"of storm with {len(clients)} clients; {len(gaps)} cycles, the longest "
        f"{max(gaps, default=0):.1f} s; failed scrapes: {scrape_errors}"
    )
    # Only rules that work without the plugin were evaluated...
    vllm_only = {r.alert for r in rules if needs(r).needs == "vllm"}
    assert fired <= vllm_only
    # ...and every other rule says what it needs.
    assert [(r.alert, r.severity, n.text) for r, n in evaluator.skipped(engine)] == [
        ("VllmKVFragmentationSuspected", "warning", "the plugin"),
        ("VllmBlockFragmentationHigh", "warning", "the plugin"),
        ("VllmHotPathBacklog", "warning", "the plugin"),
        ("VllmRequestStarvation", "warning", "the plugin"),
        ("VllmEngineStalled", "critical", "the plugin"),
        ("VllmGPUMemoryLeak", "warning", "the plugin + NVML"),
        ("VllmGPUMemoryImbalance", "warning", "the plugin + NVML"),
        ("VllmBatchUtilizationLow", "info", "the plugin"),
        ("VllmPaddingHigh", "warning", "the plugin"),
        ("VllmPaddingHigh", "critical", "the plugin"),
        ("VllmCudagraphPaddingHigh", "warning", "the plugin"),
        ("VllmInsufficientWarmup", "warning", "the plugin"),
        ("VllmGPUComputeSkew", "warning", "the plugin + NVML"),
    ]
    [said] = [
        r.getMessage() for r in caplog.records if "has no vllm-runbook plugin" in r.getMessage()
    ]
    assert said.startswith("engine cpu-0 (model ")
    evaluated = len(rules) - len(evaluator.skipped(engine))
    assert (
        f"{evaluated} of {len(rules)} rules evaluated on vLLM's own series; not evaluated: "
        "VllmKVFragmentationSuspected (warning: needs the plugin), " in said
    )
    assert said.endswith("VllmGPUComputeSkew (warning: needs the plugin + NVML)")
    print(f"\nfired without the plugin: {sorted(fired)}")
