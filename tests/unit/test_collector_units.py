"""Unit tests of the collector's pure logic (no engine)."""

from __future__ import annotations

import logging
import math
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.hook import RunbookSchedulerMixin, with_collector
from vllm_runbook.collector.nvml import NvmlPoller, visible_gpu_indices
from vllm_runbook.collector.settings import CollectorSettings, check_vllm_version
from vllm_runbook.collector.step_stats import predicted_padded_tokens
from vllm_runbook.collector.window import QueuedHistogram, SlidingWindowMax, SlidingWindowRatio


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_window_ratio_slides_out_old_seconds() -> None:
    clock = FakeClock()
    w = SlidingWindowRatio(60, clock=clock)
    assert math.isnan(w.ratio(math.nan))
    w.add(96, 100)
    clock.t += 0.5
    w.add(0, 100)  # same second bucket
    assert w.ratio() == pytest.approx(0.48)
    clock.t += 30
    w.add(100, 100)
    assert w.sums() == (196, 300)
    clock.t += 30  # the first second is now exactly 60 s old: out
    assert w.sums() == (100, 100)
    clock.t += 31
    assert w.sums() == (0, 0)
    assert w.ratio(empty=-1) == -1


def test_window_rejects_a_non_positive_length() -> None:
    with pytest.raises(ValueError):
        SlidingWindowRatio(0)
    with pytest.raises(ValueError):
        SlidingWindowMax(-1)


def test_window_ratio_takes_the_callers_clock_read() -> None:
    clock = FakeClock(1000.0)
    w = SlidingWindowRatio(10, clock=clock)
    w.add(1, 2, now=1000.2)
    w.add(1, 2, now=1003.9)  # a new second: the first one moves into the deque
    w.add(2, 4, now=1003.1)  # the same second as the last: summed there
    assert w.sums() == (4, 8)
    clock.t = 1010.5  # second 1000 is 10 s old: out; 1003 stays
    assert w.sums() == (3, 6)
    clock.t = 1013.0  # the newest second is out too
    assert w.sums() == (0, 0)


def test_window_max_keeps_each_seconds_largest_and_slides() -> None:
    clock = FakeClock(1000.0)
    w = SlidingWindowMax(5, clock=clock)
    assert w.max() == 0.0 and math.isnan(w.max(math.nan))
    w.add(0.3)
    w.add(0.9)
    w.add(0.5)  # smaller, same second: the 0.9 stays
    assert w.max() == 0.9
    clock.t = 1002.5
    w.add(0.4)
    assert w.max() == 0.9
    clock.t = 1005.0  # second 1000 out, 1002 in
    assert w.max() == 0.4
    w.add(0.2, now=1006.1)
    clock.t = 1007.9  # 1002 out
    assert w.max() == 0.2
    clock.t = 1011.0
    assert w.max(-1.0) == -1.0


@pytest.mark.parametrize("seconds_per_add", [0.0, 0.01])
def test_window_ratio_read_on_another_thread_is_never_torn(seconds_per_add: float) -> None:
    """The writer adds (1, 2) per step, inside a second without a lock, a new
    second every 100 adds (or never) under it. Nothing expires in this long a
    window, so a reader on another thread must see den == 2 num, never less
    than it saw before: a bucket half-moved into the finished seconds, or
    half-written, would show as a drop or a mismatch."""
    clock = FakeClock(1000.0)
    w = SlidingWindowRatio(1e9, clock=clock)
    stop = threading.Event()
    bad: list[tuple[float, float]] = []
    reads = 0

    def read() -> None:
        nonlocal reads
        last = 0.0
        while not stop.is_set():
            num, den = w.sums()
            reads += 1
            if den != 2 * num or num < last:
                bad.append((num, den))
            last = num

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as CPython lets them
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(200_000):
            w.add(1, 2)
            clock.t += seconds_per_add
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert reads > 100 and not bad[:5]
    assert w.sums() == (200_000, 400_000)


def test_queued_histogram_is_filed_by_its_reader_and_bounded() -> None:
    h = QueuedHistogram((0.25, 1.0), limit=4)
    for value in (0.125, 0.25, 0.5):
        h.add(value)
    assert list(h.queue) == [0.125, 0.25, 0.5]  # the writer only queued them
    # le semantics: 0.25 falls in the 0.25 bucket; cumulative, +Inf last.
    assert h.read() == ([2, 3, 3], 0.875)
    assert not h.queue
    for _ in range(3):
        h.add(2.0)
    assert len(h.queue) == 3
    h.add(2.0)  # the fourth unread value: the writer files them itself
    assert not h.queue
    assert h.read() == ([2, 3, 7], 8.875)


def test_queued_histogram_read_on_another_thread_loses_nothing() -> None:
    """One writer adds values while a reader files and reads without pause:
    every value is counted once, and the count a reader sees never drops."""
    h = QueuedHistogram((0.5,))
    stop = threading.Event()
    bad: list[int] = []
    reads = 0

    def read() -> None:
        nonlocal reads
        last = 0
        while not stop.is_set():
            total = h.read()[0][-1]
            reads += 1
            if total < last:
                bad.append(total)
            last = total

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    added = 0
    try:
        # At least 200,000 values, and on until the reader read 100 times (a busy
        # machine gives it fewer turns), bounded.
        while (added < 200_000 or reads < 100) and added < 20_000_000:
            h.add(added % 2)
            added += 1
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert reads >= 100 and not bad[:5]
    ones = added // 2
    assert h.read() == ([added - ones, added], float(ones))


def test_the_change_trackers_sample_is_skipped_until_a_second_of_steps_passed() -> None:
    """On the real wall clock the step's time says when to call `sample` next;
    on a test's clock (which may run faster than the steps) every step calls it."""
    import time

    from vllm_runbook.collector.request_tracking import ChangeTracker

    parts: dict[str, Any] = {
        "scheduler": None,
        "stats": SimpleNamespace(preemptions=0),
        "requests": SimpleNamespace(log=SimpleNamespace(by_reason={})),
    }
    tracker = ChangeTracker(**parts)
    assert tracker.next_sample_at == 0.0
    assert tracker.sample(50.0) is not None and tracker.next_sample_at == 51.0
    tracker.clock = lambda: 1e9  # a test's clock: no skipping
    assert tracker.next_sample_at == 0.0
    assert tracker.sample(52.0) == 1e9 and tracker.next_sample_at == 0.0
    tracker.clock = time.time
    assert tracker.sample(60.0) is not None and tracker.next_sample_at == 61.0


@pytest.mark.parametrize(
    ("n", "sizes", "padded"),
    [
        (5, [1, 2, 4, 8, 16], 8),
        (8, [1, 2, 4, 8, 16], 8),
        (17, [1, 2, 4, 8, 16], 17),  # above the largest size: eager, no padding
        (5, [], 5),  # CPU / eager: nothing captured
        (0, [1, 2], 0),
    ],
)
def test_predicted_padding(n: int, sizes: list[int], padded: int) -> None:
    assert predicted_padded_tokens(n, sizes) == padded


def test_settings_from_env() -> None:
    s = CollectorSettings.from_env({})
    assert (s.host, s.port, s.window_seconds) == ("127.0.0.1", 9360, 60.0)
    s = CollectorSettings.from_env({"VLLM_RUNBOOK_PORT": "off", "VLLM_RUNBOOK_HOST": "::1"})
    assert s.port is None and s.host == "::1"
    assert CollectorSettings.from_env({"VLLM_RUNBOOK_PORT": "0"}).port == 0


def test_version_outside_the_tested_range_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.collector"):
        assert check_vllm_version("0.32.0") is True
        assert not caplog.records
        assert check_vllm_version("0.40.1") is False
        assert check_vllm_version("dev") is False
    assert len(caplog.records) == 2
    assert "outside the tested range" in caplog.records[0].getMessage()


def test_with_collector_mixes_in_once() -> None:
    class Base:
        def schedule(self) -> str:
            return "base"

    hooked = with_collector(Base)
    assert issubclass(hooked, RunbookSchedulerMixin) and issubclass(hooked, Base)
    assert hooked.__name__ == "RunbookBase"
    assert with_collector(hooked) is hooked


def test_metric_catalog_is_consistent() -> None:
    names = [m.name for m in M.ALL_METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("vllm_runbook_") for n in names)
    for required in (
        "vllm_runbook_prefix_cache_queries_total",
        "vllm_runbook_prefix_cache_hits_total",
        "vllm_runbook_kv_hit_ratio",
        "vllm_runbook_block_fragmentation_ratio",
        "vllm_runbook_padding_ratio",
        "vllm_runbook_length_padding_ratio",
        "vllm_runbook_schedule_seconds",
        "vllm_runbook_max_num_batched_tokens",
        "vllm_runbook_max_num_seqs",
        "vllm_runbook_scheduler_policy",
    ):
        assert any(m.series_name == required for m in M.ALL_METRICS), required
    registry = CollectorRegistry()
    for spec in M.ALL_METRICS:
        M.build(spec, registry)  # every spec builds; no duplicate series


# -- NVML with a fake module --


class NotSupported(Exception):
    """What pynvml raises for a query the device does not answer (NVMLError_NotSupported)."""

    def __str__(self) -> str:
        return "Not Supported"


class FakeNvml:
    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.util = {0: 95, 1: 20}
        self.memory_util = {0: 78, 1: 45}  # memory-controller (DRAM) busy %
        self.used_gib = {0: 10, 1: 20}
        # Two A100s, PCIe 4.0 x16 (an idle link: gen 1 now).
        self.capability = {0: (8, 0), 1: (8, 0)}
        self.pcie_generation = {0: 1, 1: 1}  # now
        self.pcie_generation_max = {0: 4, 1: 4}  # with this GPU and system
        self.pcie_generation_gpu_max = {0: 4, 1: 4}  # the GPU's own
        self.pcie_width = {0: 16, 1: 16}
        self.not_supported: set[str] = set()  # NVML calls that raise NotSupported
        self.hardware_calls = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=self.used_gib[h] * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.util[h], memory=self.memory_util[h])

    def _hardware(self, call: str, values: dict[int, Any], h: int) -> Any:
        self.hardware_calls += 1
        if call in self.not_supported:
            raise NotSupported()
        return values[h]

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self._hardware("nvmlDeviceGetCudaComputeCapability", self.capability, h)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self._hardware("nvmlDeviceGetCurrPcieLinkGeneration", self.pcie_generation, h)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self._hardware("nvmlDeviceGetMaxPcieLinkGeneration", self.pcie_generation_max, h)

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h: int) -> int:
        return self._hardware(
            "nvmlDeviceGetGpuMaxPcieLinkGeneration", self.pcie_generation_gpu_max, h
        )

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self._hardware("nvmlDeviceGetCurrPcieLinkWidth", self.pcie_width, h)


def _poller(
    nvml: object, clock: FakeClock | None = None, window: float = 60.0
) -> tuple[NvmlPoller, CollectorRegistry]:
    reg = CollectorRegistry()
    gauges = {s.name: M.build_gauge(s, reg) for s in M.NVML_METRICS}
    poller = NvmlPoller(nvml, gauges, ("m", "0"), window_seconds=window, clock=clock or FakeClock())
    return poller, reg


def test_nvml_reports_each_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    poller, reg = _poller(FakeNvml())
    assert poller.init() is True
    lv = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm_runbook_nvml_up", lv) == 1
    assert reg.get_sample_value("vllm_runbook_gpu_utilization_ratio", {**lv, "gpu": "0"}) == 0.95
    assert reg.get_sample_value("vllm_runbook_gpu_utilization_ratio", {**lv, "gpu": "1"}) == 0.20
    assert reg.get_sample_value("vllm_runbook_gpu_memory_used_bytes", {**lv, "gpu": "1"}) == (
        20 * 2**30
    )
    # nvmlDeviceGetUtilizationRates().memory: the memory controller's busy share.
    dram = M.GPU_DRAM_UTILIZATION.series_name
    assert reg.get_sample_value(dram, {**lv, "gpu": "0"}) == 0.78
    assert reg.get_sample_value(dram, {**lv, "gpu": "1"}) == 0.45


def test_nvml_peak_memory_keeps_a_short_peak_for_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clock, nvml = FakeClock(0.0), FakeNvml()
    poller, reg = _poller(nvml, clock, window=60.0)
    peak, used = M.GPU_MEMORY_USED_PEAK.series_name, M.GPU_MEMORY_USED.series_name
    gpu0 = {"model_name": "m", "engine": "0", "gpu": "0"}
    assert poller.init() is True  # t=0: 10 GiB
    for t, gib in ((1, 10), (2, 70), (3, 12), (30, 11)):  # a one-poll peak at t=2
        clock.t, nvml.used_gib[0] = t, gib
        poller.poll()
    # A scrape at t=30 sees 11 GiB in use, and the 70 GiB the poll at t=2 saw.
    assert reg.get_sample_value(used, gpu0) == 11 * 2**30
    assert reg.get_sample_value(peak, gpu0) == 70 * 2**30
    clock.t = 62.5  # the peak (t=2) is now older than the window
    poller.poll()
    assert reg.get_sample_value(peak, gpu0) == 12 * 2**30  # t=3 is still inside
    clock.t = 200.0
    poller.poll()
    assert reg.get_sample_value(peak, gpu0) == 11 * 2**30  # only this poll is left


def test_nvml_absent_means_nvml_up_0_and_no_gpu_series() -> None:
    for nvml in (None, FakeNvml(fail_init=True)):
        poller, reg = _poller(nvml)
        assert poller.init() is False
        assert reg.get_sample_value("vllm_runbook_nvml_up", {"model_name": "m", "engine": "0"}) == 0
        names = {s.name for fam in reg.collect() for s in fam.samples}
        assert not any(n.startswith("vllm_runbook_gpu_") for n in names)


def test_nvml_reads_each_gpus_hardware_once_at_its_first_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    nvml.capability[1], nvml.pcie_generation_max[1], nvml.pcie_width[1] = (7, 5), 3, 8
    poller, reg = _poller(nvml)
    assert poller.init() is True
    info = {
        (s.labels["gpu"], *(s.labels[k] for k in M.GPU_HARDWARE_LABELS)): s.value
        for fam in reg.collect()
        for s in fam.samples
        if s.name == M.GPU_HARDWARE_INFO.series_name
    }
    # (gpu, compute capability, PCIe generation now, link max, the GPU's max, width)
    assert info == {("0", "8.0", "1", "4", "4", "16"): 1.0, ("1", "7.5", "1", "3", "4", "8"): 1.0}
    assert poller.snapshot()["hardware"]["1"] == {
        "compute_capability": "7.5",
        "pcie_link_generation": 1,
        "pcie_link_generation_max": 3,
        "pcie_link_generation_gpu_max": 4,
        "pcie_link_width": 8,
        "unread": {},
    }
    # Read once: later polls ask NVML for memory and utilisation only.
    assert nvml.hardware_calls == 2 * len(M.GPU_HARDWARE_LABELS)
    nvml.capability[1] = (9, 0)
    poller.poll()
    assert nvml.hardware_calls == 2 * len(M.GPU_HARDWARE_LABELS)
    assert poller.snapshot()["hardware"]["1"]["compute_capability"] == "7.5"


def test_a_hardware_call_nvml_refuses_leaves_its_field_empty_and_the_poll_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    nvml.not_supported = {"nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetCurrPcieLinkWidth"}
    poller, reg = _poller(nvml)
    with caplog.at_level(logging.INFO, logger="vllm_runbook.collector"):
        assert poller.init() is True
    lv = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm_runbook_nvml_up", lv) == 1
    assert reg.get_sample_value("vllm_runbook_gpu_utilization_ratio", {**lv, "gpu": "0"}) == 0.95
    gpu0 = {**lv, "gpu": "0", "compute_capability": "", "pcie_link_generation": "1",
            "pcie_link_generation_max": "4", "pcie_link_generation_gpu_max": "4",
            "pcie_link_width": ""}  # fmt: skip
    assert reg.get_sample_value(M.GPU_HARDWARE_INFO.series_name, gpu0) == 1
    hardware = poller.snapshot()["hardware"]["0"]
    assert (hardware["compute_capability"], hardware["pcie_link_width"]) == (None, None)
    assert hardware["unread"] == {
        "compute_capability": "Not Supported",
        "pcie_link_width": "Not Supported",
    }
    assert "NVML gave no compute_capability for GPU 0 (Not Supported)" in caplog.text


def test_the_hardware_reads_are_the_exported_labels() -> None:
    from vllm_runbook.collector.agent_api import GpuHardware
    from vllm_runbook.collector.nvml import read_gpu_hardware

    fields = read_gpu_hardware(FakeNvml(), 0)
    assert tuple(k for k in fields if k != "unread") == M.GPU_HARDWARE_LABELS
    assert set(GpuHardware.model_fields) == {*M.GPU_HARDWARE_LABELS, "unread"}


def test_visible_gpu_indices() -> None:
    assert visible_gpu_indices(4, None) == [0, 1, 2, 3]
    assert visible_gpu_indices(4, "2,3") == [2, 3]
    assert visible_gpu_indices(4, "") == []


def test_auto_scheduler_builds_the_class_of_the_engines_scheduling_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_runbook.collector import scheduler as S

    def config(async_scheduling: bool | None) -> SimpleNamespace:
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    assert S.scheduler_class_for(config(True)) is S.RunbookAsyncScheduler
    assert S.scheduler_class_for(config(False)) is S.RunbookScheduler
    assert S.scheduler_class_for(config(None)) is S.RunbookScheduler
    assert issubclass(S.RunbookAsyncScheduler, S.AsyncScheduler)
    assert not issubclass(S.RunbookScheduler, S.AsyncScheduler)

    # What vLLM does with the class it is given: one call with keyword arguments.
    built: list[tuple[str, dict[str, object]]] = []

    def fake_init(self: object, **kwargs: object) -> None:
        built.append((type(self).__name__, kwargs))

    monkeypatch.setattr(S.RunbookScheduler, "__init__", fake_init)
    monkeypatch.setattr(S.RunbookAsyncScheduler, "__init__", fake_init)
    for mode, name in ((True, "RunbookAsyncScheduler"), (False, "RunbookScheduler")):
        built.clear()
        obj = S.RunbookAutoScheduler(vllm_config=config(mode), log_stats=False)
        assert type(obj).__name__ == name
        assert built == [(name, {"vllm_config": config(mode), "log_stats": False})]


def test_request_log_histograms_are_observed_by_their_reader_and_bounded() -> None:
    from vllm_runbook.collector.request_tracking import Finished, RequestLog

    log = RequestLog(length=4, bounds=(1.0, 10.0))
    for i, seconds in enumerate((0.5, 5.0, 50.0)):
        log.add(Finished(i, 100.0 + i, "stop", seconds * 2, seconds))
    assert log.by_reason["stop"] == 3  # counted in the step
    assert log._queue_histogram.counts == [0, 0, 0]  # observed by the reader, not the step
    assert log.queue_histogram.counts == [1, 1, 1] and log.queue_histogram.sum == 55.5
    assert log.e2e_histogram.counts == [1, 1, 1] and log.e2e_histogram.sum == 111.0
    # Nobody reads for `length` finishes: the step observes them itself.
    for i in range(4):
        log.add(Finished(3 + i, 200.0, "length", 2.0, 2.0))
    assert log._queue_histogram.counts == [1, 5, 1]
    assert len(log._unobserved) == 0 and len(log.entries) == 4


def _quiet_parts(**conditions: Any) -> SimpleNamespace:
    """What EngineCollector.settle_quiet reads, nothing pending unless told."""
    state = {
        "pending": (),
        "tiered": False,
        "abort_outputs": {},
        "autopilot_pending": None,
        "observing": False,
        "settling": None,
        "_stepped": True,
    } | conditions
    return SimpleNamespace(
        quiet=False,
        _stepped=state["_stepped"],
        control=SimpleNamespace(
            pending=state["pending"], tiered=state["tiered"], abort_outputs=state["abort_outputs"]
        ),
        autopilot=SimpleNamespace(pending=state["autopilot_pending"], observing=state["observing"]),
        changes=SimpleNamespace(settling=state["settling"]),
    )


@pytest.mark.parametrize(
    "condition",
    [
        {},
        {"pending": ("a command",)},
        {"tiered": True},
        {"abort_outputs": {0: ["an abort"]}},
        {"autopilot_pending": "a decision"},
        {"observing": True},
        {"settling": 12},
        {"_stepped": False},
    ],
    ids=lambda c: next(iter(c), "nothing"),
)
def test_a_step_is_quiet_only_while_no_part_has_more_to_do(condition: dict[str, Any]) -> None:
    from vllm_runbook.collector.engine_collector import EngineCollector

    parts = _quiet_parts(**condition)
    EngineCollector.settle_quiet(parts)  # type: ignore[arg-type]
    assert parts.quiet is (not condition)


def test_a_part_waking_while_the_step_settles_is_never_missed() -> None:
    """Another thread queues a command just after the engine thread read the
    queue as empty, then wakes the collector: the step must not then call
    itself quiet (it sets `quiet` before it reads the parts, never after)."""
    from vllm_runbook.collector.engine_collector import EngineCollector

    parts = _quiet_parts()

    class QueuedJustAfterTheRead:
        def __bool__(self) -> bool:
            EngineCollector.wake(parts)  # type: ignore[arg-type]
            return False

    parts.control.pending = QueuedJustAfterTheRead()
    EngineCollector.settle_quiet(parts)  # type: ignore[arg-type]
    assert parts.quiet is False


def test_the_parts_wake_the_collector_after_their_own_state() -> None:
    """The autopilot wakes it when it starts observing and when it decides."""
    from vllm_runbook.collector.autopilot import Autopilot

    pilot = Autopilot(0.9)
    seen: list[tuple[bool, bool]] = []
    pilot.wake = lambda: seen.append((pilot.observing, pilot.enabled))
    pilot.advise(8, 0)
    assert seen[-1] == (True, False)
    pilot.enable(8, 0)
    assert seen[-1] == (True, True)
