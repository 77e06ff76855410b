"""Live: a stock vLLM server (plugins disabled, `VLLM_PLUGINS=`) under a preemption
storm. The embedded evaluator, scraping only vLLM's own /metrics, evaluates the
rules that work without the plugin on vLLM's series (they fire on the storm:
preemptions, a queue with slow requests, no prefix-cache hits) and says that
each of the others needs the plugin.
"""

from __future__ import annotations

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
WINDOW = "5s"
# Short windows and `for` periods: the storm lasts seconds on this machine.
OVERRIDES = {
    "VllmOOMRateHigh": {"window": WINDOW, "for": "1s"},
    "VllmLatencySpike": {"window": WINDOW, "for": "1s", "p99_sla_seconds": 0.5},
    "VllmKVCacheHitRatioLow": {"for": "1s"},
    "VllmOOMPressure": {"window": WINDOW, "for": "1s"},
}
# What a storm of distinct long prompts on a 31-block cache must fire without the plugin.
MUST_FIRE = {"VllmOOMRateHigh", "VllmLatencySpike", "VllmKVCacheHitRatioLow"}


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

        def cycle() -> None:
            [result] = scraper.scrape_once()
            assert result.ok, result.error
            evaluator.evaluate()

        errors: list[BaseException] = []

        def request(i: int) -> None:
            try:
                served.complete(200, max_tokens=100, offset=20 * i)
            except BaseException as exc:  # reported below
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="vllm_runbook.rules.evaluator"), scraper:
            # Two windows of an idle engine first: the queue's earlier value, the rates' start.
            quiet_until = time.monotonic() + 3 * 5.0
            while time.monotonic() < quiet_until:
                cycle()
                time.sleep(INTERVAL)
            assert [e for e in sink.events if e.state == "firing"] == []
            storm = [threading.Thread(target=request, args=(i,)) for i in range(48)]
            for t in storm:
                t.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and any(t.is_alive() for t in storm):
                cycle()
                time.sleep(INTERVAL)
            for t in storm:
                t.join(timeout=60)
            cycle()
        assert errors == []

    fired = {e.alert for e in sink.events if e.state == "firing"}
    [engine] = store.engines
    assert engine[0] == "cpu-0" and evaluator.without_plugin == {engine}
    assert fired >= MUST_FIRE, sorted(fired)
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
        ("VllmInsufficientWarmup", "warning", "the plugin"),
        ("VllmGPUComputeSkew", "warning", "the plugin + NVML"),
    ]
    [said] = [
        r.getMessage() for r in caplog.records if "has no vllm-runbook plugin" in r.getMessage()
    ]
    assert said.startswith("engine cpu-0 (model ")
    assert (
        "7 of 19 rules evaluated on vLLM's own series; not evaluated: "
        "VllmKVFragmentationSuspected (warning: needs the plugin), " in said
    )
    assert said.endswith("VllmGPUComputeSkew (warning: needs the plugin + NVML)")
    print(f"\nfired without the plugin: {sorted(fired)}")
