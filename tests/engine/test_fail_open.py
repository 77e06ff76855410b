"""The engine comes first: a failing hook disables itself, the engine serves on."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_runbook.collector import metrics as M

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def faulty_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(tiny_model)
    yield eng
    eng.close()


def test_error_in_the_hook_disables_the_collector_not_the_engine(
    faulty_engine: InProcessEngine, caplog: pytest.LogCaptureFixture
) -> None:
    collector = faulty_engine.collector
    calls = 0

    def broken_on_schedule(*args: object) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("injected fault")

    # Every step's (the hook's fast and slow paths both call it).
    collector.stats.on_schedule = broken_on_schedule
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.collector"):
        for i in range(8):
            faulty_engine.add(f"req-{i}", 40 + i, max_tokens=6, offset=50 * i)
        finished = faulty_engine.run_until_done()

    assert sorted(finished) == [f"req-{i}" for i in range(8)]
    assert all(len(out.outputs[0].token_ids) == 6 for out in finished.values())
    assert calls == 1, "after the first error the hook is bypassed"
    assert collector.enabled is False
    assert faulty_engine.value(M.COLLECTOR_UP.name) == 0
    disabled_lines = [r for r in caplog.records if "collector disabled" in r.getMessage()]
    assert len(disabled_lines) == 1
    assert "injected fault" in collector.error
