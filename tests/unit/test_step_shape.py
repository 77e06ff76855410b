"""StepStats' batch shape, computed when read from the running sums the step
keeps: equal to a recount, and never a half-done step on another thread."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_runbook.collector.step_stats import StepStats

BLOCK = 32


def _scheduler(capture_sizes: list[int] | None = None) -> SimpleNamespace:
    """The parts of vLLM's scheduler StepStats reads, full attention."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    group0 = FullAttentionManager.__new__(FullAttentionManager)
    group0.req_to_blocks = {}  # type: ignore[misc]
    pool = SimpleNamespace(num_gpu_blocks=1025, get_num_free_blocks=lambda: 1024)
    mode = SimpleNamespace(name="FULL" if capture_sizes else "NONE")
    return SimpleNamespace(
        block_size=BLOCK,
        kv_cache_manager=SimpleNamespace(
            block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[group0])
        ),
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(
                cudagraph_mode=mode, cudagraph_capture_sizes=capture_sizes
            )
        ),
        max_num_scheduled_tokens=8192,
        waiting=[],
        kv_holding_waiting=[],
        running=[],
        requests={},
    )


def _step(
    stats: StepStats,
    scheduler: SimpleNamespace,
    took: dict[str, int],
    free_before: int = 1024,
    now: float | None = None,
) -> None:
    """One schedule(): every running request takes `took[id]` tokens; the
    ones not yet running are admitted."""
    new, cached = [], []
    for request_id, n in took.items():
        request = scheduler.requests.get(request_id)
        if request is None:
            request = scheduler.requests[request_id] = SimpleNamespace(
                request_id=request_id, num_computed_tokens=0
            )
            scheduler.running.append(request)
            new.append(SimpleNamespace(req_id=request_id))
        else:
            cached.append(request_id)
        request.num_computed_tokens += n
    output = SimpleNamespace(
        total_num_scheduled_tokens=sum(took.values()),
        num_scheduled_tokens=dict(took),
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=cached, resumed_req_ids=set()),
        preempted_req_ids=set(),
    )
    when = time.monotonic() if now is None else now
    stats.on_schedule(scheduler, output, 0.001, free_before, when)  # type: ignore[arg-type]


def test_the_issues_oracle_after_the_prefill_and_a_decode() -> None:
    scheduler = _scheduler()
    stats = StepStats(scheduler, 60.0)  # type: ignore[arg-type]
    _step(stats, scheduler, {"a": 40, "b": 70, "c": 100})
    assert stats.fragmentation == pytest.approx(1 - 210 / 288)
    assert stats.length_padding == pytest.approx(1 - 210 / 300)
    assert stats.max_sequence_tokens == 100
    assert dict(stats.fragmentation_at_block_sizes()) == pytest.approx(
        {8: 1 - 210 / 216, 16: 1 - 210 / 240, 32: 1 - 210 / 288, 64: 1 - 210 / 320}
        | {128: 1 - 210 / 384}
    )
    shift, keys = stats.running_sums.shift, dict(stats.running_sums.keys)
    _step(stats, scheduler, {"a": 1, "b": 1, "c": 1})  # a decode: only the shift moves
    assert (stats.running_sums.shift, stats.running_sums.keys) == (shift + 1, keys)
    assert dict(stats.fragmentation_at_block_sizes())[8] == pytest.approx(1 - 213 / 224)
    assert stats.progress == (2, 0, 213)
    assert (stats.step_tokens, stats.budget_fill) == (3, 3 / 8192)


def test_every_number_the_step_keeps_is_a_slot() -> None:
    """An attribute added without its slot would go to the instance dict: no
    error, only a slower step (StepStats.__slots__)."""
    scheduler = _scheduler()
    stats = StepStats(scheduler, 60.0)  # type: ignore[arg-type]
    _step(stats, scheduler, {"a": 40, "b": 70, "c": 100})
    _step(stats, scheduler, {"a": 1, "b": 1, "c": 1})
    assert vars(stats) == {}


def test_a_reader_on_another_thread_never_sees_half_a_step() -> None:
    """Every request has the same length after each step; a step in which all
    take a prefill chunk of 3 sets them one at a time. A reader that copied
    the sums in the middle of one would see lengths that differ: Σ tokens
    below count × longest."""
    scheduler = _scheduler()
    stats = StepStats(scheduler, 60.0)  # type: ignore[arg-type]
    ids = [f"r{i}" for i in range(64)]
    _step(stats, scheduler, dict.fromkeys(ids, 16))
    stop = threading.Event()
    bad: list[tuple[Any, ...]] = []
    reads = 0

    def read() -> None:
        nonlocal reads
        while not stop.is_set():
            shape = stats.shape()
            computed, _, _, longest, *_ = shape
            reads += 1
            if computed != len(ids) * longest:
                bad.append(shape)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as CPython lets them
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for step in range(3000):
            _step(stats, scheduler, dict.fromkeys(ids, 3 if step % 2 else 1))
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert reads > 100 and not bad[:3]
    assert stats.max_sequence_tokens == 16 + 1500 + 1500 * 3


def test_a_step_that_failed_half_way_leaves_the_shape_readable() -> None:
    scheduler = _scheduler()
    stats = StepStats(scheduler, 60.0)  # type: ignore[arg-type]
    _step(stats, scheduler, {"a": 40})

    class Lost(dict[str, Any]):  # the step below cannot read its request's length
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

    scheduler.requests = Lost(scheduler.requests)
    with pytest.raises(KeyError):
        _step(stats, scheduler, {"a": 5})
    assert not stats._sums_busy
    assert stats.shape()[0] >= 40  # at once, not after waiting for a step that never ends


def test_no_padding_window_without_cudagraphs() -> None:
    eager = _scheduler()
    stats = StepStats(eager, 60.0)  # type: ignore[arg-type]
    no_stats = SimpleNamespace(cudagraph_stats=None)
    output = SimpleNamespace(total_num_scheduled_tokens=7, scheduled_spec_decode_tokens={})
    stats.on_update(eager, output, no_stats)  # type: ignore[arg-type]
    assert (stats.padded_tokens, stats.unpadded_tokens) == (7, 7)
    assert stats.padding_window.sums() == (0.0, 0.0) and stats.padding_window.ratio() == 0.0
    graphs = _scheduler(capture_sizes=[8, 16])
    stats = StepStats(graphs, 60.0)  # type: ignore[arg-type]
    stats.on_update(graphs, output, no_stats)  # type: ignore[arg-type]
    assert (stats.padded_tokens, stats.unpadded_tokens) == (8, 7)
    assert stats.padding_window.ratio() == pytest.approx(1 / 8)


def test_the_kv_usage_peak_is_the_fullest_step_of_each_second() -> None:
    """Free blocks when each step starts, 1,024 usable: the peak is the
    fewest free in the window's seconds, wherever in its second it came."""
    scheduler = _scheduler()
    stats = StepStats(scheduler, 60.0)  # type: ignore[arg-type]
    clock = SimpleNamespace(now=0.0)
    stats.kv_usage_peak._clock = lambda: clock.now
    steps = [(100.2, 768), (100.5, 256), (100.7, 512), (101.1, 896), (101.9, 640)]
    peaks = []
    for now, free in steps:
        _step(stats, scheduler, {}, free_before=free, now=now)
        clock.now = now
        peaks.append(stats.kv_usage_peak.max())
    assert peaks == [0.25, 0.75, 0.75, 0.75, 0.75]
    clock.now = 160.5  # second 100 has left the 60 s window; 101 has not
    assert stats.kv_usage_peak.max() == 1 - 640 / 1024
    clock.now = 161.5
    assert stats.kv_usage_peak.max() == 0.0
