"""`runbook serve` names at start, per configured engine, each check,
verification signal and guard of the loaded runbooks that cannot be read
there and why; engines that do not answer yet get one block for the catalog."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.runbooks.engine.client import EngineUnreachable
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.engine.sources import NO_API_URL, NO_GPU
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.service.serve_cli import unreadable_at_start

from tests.engines import InProcessEngine, free_port
from tests.fake_agent import FakeAgent
from tests.service.processes import RunbookServe

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
    assert f"  gpu-compute-skew: check gpu_utilization (gpu_utilization_max): {NO_GPU}" in lines
    assert (
        f"  gpu-memory-imbalance: check memory_spread (gpu_memory_used_spread_ratio): {NO_GPU}"
        in lines
    )
    # No API server URL configured: the API server's signal, for this engine.
    assert f"  error-rate-high: check http_error_rate: {NO_API_URL}" in lines
    # A finished-request signal with no request finished: a guard, by name and why.
    assert (
        "  batch-too-large: required guard error_rate: no request finished in the last 60 s"
        in lines
    )
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


@pytest.mark.engine
@pytest.mark.service
def test_runbook_serve_logs_the_unreadable_readings_of_a_real_engine_at_start(
    engine: InProcessEngine, tmp_path: Path
) -> None:
    """A real agent (an in-process CPU engine, no GPU, no API server URL) and an
    engine that does not answer: `runbook serve`'s log names what cannot be read."""
    agent = str(engine.collector.server.url)
    down = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "runbook.yaml"
    config.write_text(
        f"database: sqlite:///{tmp_path / 'runbook.db'}\n"
        f"engines:\n  - name: cpu-0\n    agent: {agent}\n  - name: late\n    agent: {down}\n"
    )
    log = tmp_path / "serve.log"
    with RunbookServe.run(
        config, log, "--no-rules", "--no-worker", env={"RUNBOOK_WEBHOOK_TOKEN": "t" * 32}
    ):
        text = log.read_text()
    assert "signals the runbooks name that cannot be read:" in text
    assert re.search(rf"engine cpu-0 \({re.escape(agent)}\): \d+ cannot be read", text), text
    for line in (
        f"  gpu-compute-skew: check gpu_utilization (gpu_utilization_max): {NO_GPU}",
        f"  error-rate-high: check http_error_rate: {NO_API_URL}",
        # Nothing finished on this engine yet: the required guard says why.
        "  batch-too-large: required guard error_rate: no request finished in the last 60 s",
    ):
        assert line in text.splitlines(), text
    assert "catalog (engines not reachable yet: late (" in text
