"""The tested vLLM range from the matrix's record, and the adapters for an
older vLLM's scheduler (collector/adapters/), on fakes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.collector import settings, vllm_support
from vllm_runbook.collector.adapters import adapters_for
from vllm_runbook.collector.adapters.admission import AdmissionLimitFromRunningReqs
from vllm_runbook.collector.adapters.holding_queue import HoldingQueueFromSkippedWaiting


def matrix(*rows: tuple[str, bool]) -> dict[str, Any]:
    return {"versions": [{"vllm": v, "green": g} for v, g in rows]}


def test_the_tested_range_is_that_of_the_green_versions() -> None:
    rows = matrix(("0.29.0", False), ("0.30.0", True), ("0.31.0", True), ("0.33.1", True))
    assert vllm_support.tested_range(rows) == ((0, 30), (0, 33))
    assert vllm_support.describe(vllm_support.tested_range(rows)) == "0.30-0.33"
    assert vllm_support.tested_range(matrix(("0.33.0", False))) == vllm_support.EMPTY
    assert vllm_support.describe(vllm_support.EMPTY) == "none"


def test_a_broken_record_gives_no_range_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "vllm_matrix.json"
    broken.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.collector"):
        data = vllm_support.load_matrix(broken)
    assert data == {"versions": []}
    assert vllm_support.tested_range(data) == vllm_support.EMPTY
    assert "cannot read the tested vLLM versions" in caplog.records[0].getMessage()


def test_the_committed_record_is_the_range_the_collector_uses() -> None:
    recorded = vllm_support.load_matrix()
    assert settings.TESTED_VLLM == vllm_support.tested_range(recorded) != vllm_support.EMPTY
    low, high = settings.TESTED_VLLM
    # The newest recorded version loads without a warning; one minor above does not.
    assert settings.check_vllm_version(f"{high[0]}.{high[1]}.0") is True
    assert settings.check_vllm_version(f"{high[0]}.{high[1] + 1}.0") is False
    assert settings.check_vllm_version(f"{low[0]}.{low[1] - 1}.0") is False


class OldScheduler:
    """The shape of vLLM 0.30's Scheduler for the adapters: one running limit,
    asserted after every schedule(), and `skipped_waiting`."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_running_reqs = max_num_seqs
        self.waiting: list[str] = []
        self.skipped_waiting: list[str] = []
        self.running: list[str] = []

    def schedule(self) -> list[str]:
        admitted = []
        while self.waiting and len(self.running) < self.max_num_running_reqs:
            admitted.append(self.waiting.pop(0))
            self.running.append(admitted[-1])
        assert len(self.running) <= self.max_num_running_reqs  # as vLLM 0.30 does
        return admitted


def test_an_old_scheduler_gets_both_adapters_and_a_new_one_none() -> None:
    class NewScheduler(OldScheduler):
        def __init__(self, max_num_seqs: int) -> None:
            super().__init__(max_num_seqs)
            self.max_num_active_reqs = max_num_seqs
            self.kv_holding_waiting: list[str] = []

    assert adapters_for(OldScheduler) == (
        AdmissionLimitFromRunningReqs,
        HoldingQueueFromSkippedWaiting,
    )
    assert adapters_for(NewScheduler) == ()


class Adapted(AdmissionLimitFromRunningReqs, HoldingQueueFromSkippedWaiting, OldScheduler):
    pass


def test_lowering_the_admission_limit_drains_without_tripping_vllms_assertion() -> None:
    s = Adapted(8)
    s.waiting = [f"r{i}" for i in range(10)]
    assert len(s.schedule()) == 8 and s.max_num_active_reqs == 8
    s.max_num_active_reqs = 3  # the knob, while 8 run
    assert (s.max_num_active_reqs, s.max_num_running_reqs) == (3, 8)
    assert s.schedule() == []  # nothing admitted, and vLLM's assertion holds
    del s.running[:6]  # six finish: two run
    assert s.schedule() == ["r8"]  # admitted up to the limit, not above
    assert (len(s.running), s.max_num_running_reqs) == (3, 3)
    s.max_num_active_reqs = 8  # back to the startup value
    assert s.schedule() == ["r9"]


def test_the_limit_at_its_startup_value_changes_nothing() -> None:
    plain, adapted = OldScheduler(4), Adapted(4)
    for s in (plain, adapted):
        s.waiting = [f"r{i}" for i in range(6)]
    assert adapted.schedule() == plain.schedule() == ["r0", "r1", "r2", "r3"]
    assert adapted.max_num_running_reqs == plain.max_num_running_reqs == 4


def test_the_holding_queue_is_skipped_waiting() -> None:
    s = Adapted(2)
    s.skipped_waiting.append("x")
    assert s.kv_holding_waiting == ["x"]
    s.kv_holding_waiting = ["y"]  # a policy switch replaces the queue
    assert s.skipped_waiting == ["y"]


class _CacheConfig033:
    """vLLM <= 0.33: the utilisation is always set."""

    gpu_memory_utilization = 0.9


class _CacheConfig034:
    """vLLM 0.34: None unless set, resolved by a property."""

    def __init__(self, set_to: float | None, extensible: bool | None) -> None:
        self.gpu_memory_utilization = set_to
        self.enable_extensible_kv_cache = extensible

    @property
    def resolved_gpu_memory_utilization(self) -> float:
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 1.0 if self.enable_extensible_kv_cache else 0.92


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        (_CacheConfig033(), (0.9, False)),
        (_CacheConfig034(None, True), (1.0, True)),  # CUDA's default
        (_CacheConfig034(None, None), (0.92, False)),  # CPU: never resolved to extensible
        (_CacheConfig034(0.8, True), (0.8, True)),
    ],
)
def test_the_memory_utilisation_the_kv_cache_is_sized_with(
    cache: Any, expected: tuple[float, bool]
) -> None:
    from vllm_runbook.collector.adapters.memory_utilization import memory_utilization

    assert memory_utilization(cache) == expected
