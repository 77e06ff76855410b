"""`runbook serve` names at start, per configured engine, each check,
verification signal and guard of the loaded runbooks that cannot be read
there and why; engines that do not answer yet get one block for the catalog."""

from __future__ import annotations

from typing import Any

from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.runbooks.client import EngineUnreachable
from vllm_runbook.runbooks.engine_actions import engine_registry
from vllm_runbook.runbooks.service.serve_cli import unreadable_at_start
from vllm_runbook.runbooks.sources import NO_API_URL, NO_GPU
from vllm_runbook.runbooks.spec import load_catalog

from tests.service.fake_agent import FakeAgent

DOWN = "http://127.0.0.1:10"


def _factory(url: str) -> Any:
    if url == DOWN:
        raise EngineUnreachable(f"cannot reach {url}: connection refused")
    return FakeAgent()


def test_serve_names_each_unreadable_reading_per_engine_and_for_the_catalog() -> None:
    runbooks = load_catalog(registry=engine_registry())
    engines = [
        EngineConfig(name="cpu-0", agent=FakeAgent().url),
        EngineConfig(name="late", agent=DOWN),
    ]
    lines = unreadable_at_start(engines, runbooks, client_factory=_factory)
    text = "\n".join(lines)
    head = [line for line in lines if not line.startswith("  ")]
    assert head[0].startswith(f"engine cpu-0 ({FakeAgent().url}): ")
    # No GPU on the fake engine: every GPU check of the diagnostic runbooks is named.
    assert f"  gpu-compute-skew: check gpu_utilization (gpu_utilization_ratio): {NO_GPU}" in lines
    assert (
        f"  gpu-memory-imbalance: check memory_spread (gpu_memory_spread_ratio): {NO_GPU}" in lines
    )
    # No API server URL configured: the API server's signal, for this engine.
    assert f"  error-rate-high: check http_error_rate: {NO_API_URL}" in lines
    # A finished-request signal with no request finished: a guard, by name and why.
    assert "  batch-too-large: required guard error_rate: agent too old" in lines
    # Readable signals are not named.
    assert "oom-pressure: verification preemptions_per_minute" not in text
    # The engine that does not answer: one block for the catalog.
    assert head[1].startswith("catalog (engines not reachable yet: late (cannot reach ")
    assert lines[-1] == f"  error-rate-high: check http_error_rate: {NO_API_URL}"


def test_serve_with_no_engine_names_what_the_catalog_cannot_read() -> None:
    runbooks = load_catalog(registry=engine_registry())
    lines = unreadable_at_start([], runbooks)
    assert lines == [
        "catalog (engines not reachable yet: none configured): the rest is read at each run",
        f"  error-rate-high: check http_error_rate: {NO_API_URL}",
    ]
