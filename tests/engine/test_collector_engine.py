"""Exact metric oracles on a real vLLM CPU engine, stepped by hand."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.control import parse_command

from tests.engines import InProcessEngine, http_get, while_stepping

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
PYDANTIC_MAIN = str(Path("pydantic") / "main.py")


def test_hook_is_mixed_into_vllms_scheduler(engine: InProcessEngine) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm_runbook.collector.hook import RunbookSchedulerMixin

    assert isinstance(engine.scheduler, RunbookSchedulerMixin)
    assert isinstance(engine.scheduler, Scheduler)
    assert engine.value(M.COLLECTOR_UP.name) == 1


def test_fragmentation_and_length_padding_after_the_prefill_step(engine: InProcessEngine) -> None:
    # Distinct offsets: no prefix-cache hits, every token is computed.
    for i, n in enumerate((40, 70, 100)):
        engine.add(f"frag-{i}", n, max_tokens=3, offset=1000 + 150 * i)
    engine.step()
    # Blocks held: ceil(40/32)+ceil(70/32)+ceil(100/32) = 2+3+4 = 9 → 288 slots.
    assert engine.value(M.BLOCK_FRAGMENTATION.name) == pytest.approx(1 - 210 / 288, abs=1e-12)
    assert engine.value(M.LENGTH_PADDING_RATIO.name) == pytest.approx(1 - 210 / 300, abs=1e-12)
    assert engine.value(M.STEP_TOKENS.name) == 210
    assert engine.value(M.BUDGET_FILL.name) == pytest.approx(210 / 512)
    assert engine.value(M.REQUESTS_RUNNING.name) == 3
    assert engine.value(M.KV_BLOCKS_USED.name) == 9
    assert engine.value(M.KV_BLOCKS_FREE.name) == 255 - 9
    # What-if: ceil(n / b) blocks per request. At 8: 5+9+13 = 27 blocks, 216 slots;
    # at 16: 3+5+7, 240; at 32 (the engine's own): the real 288; 64: 320; 128: 384.
    assert what_if(engine) == {
        "8": 1 - 210 / 216,
        "16": 1 - 210 / 240,
        "32": 1 - 210 / 288,
        "64": 1 - 210 / 320,
        "128": 1 - 210 / 384,
    }
    assert what_if(engine)["32"] == engine.value(M.BLOCK_FRAGMENTATION.name)
    engine.step()  # one decoded token each: 41, 71, 101; 41 opens a 6th block of 8
    assert what_if(engine) == {
        "8": 1 - 213 / 224,
        "16": 1 - 213 / 240,
        "32": 1 - 213 / 288,
        "64": 1 - 213 / 320,
        "128": 1 - 213 / 384,
    }
    assert engine.value(M.BLOCK_FRAGMENTATION.name) == 1 - 213 / 288
    engine.run_until_done()
    assert set(what_if(engine).values()) == {0.0}
    # Nothing runs any more: fragmentation is defined as 0, and the queue
    # gauges follow the finished requests even though no step comes after.
    assert engine.value(M.BLOCK_FRAGMENTATION.name) == 0
    # Likewise the length padding: an idle engine pads nothing (it used to keep
    # the last batch's spread for as long as the engine stayed idle).
    assert engine.value(M.LENGTH_PADDING_RATIO.name) == 0
    assert engine.value(M.REQUESTS_RUNNING.name) == 0
    assert engine.value(M.KV_BLOCKS_USED.name) == 0


def what_if(engine: InProcessEngine) -> dict[str, float | None]:
    return {
        str(b): engine.value(M.BLOCK_FRAGMENTATION_AT.name, block_size=str(b))
        for b in M.WHAT_IF_BLOCK_SIZES
    }


def test_decode_steps_track_the_growing_context(engine: InProcessEngine) -> None:
    engine.add("dec-0", 32, max_tokens=3, offset=3000)
    engine.step()  # prefill: 32 computed tokens in exactly 1 block
    assert engine.value(M.BLOCK_FRAGMENTATION.name) == 0
    engine.step()  # first decode: 33 tokens need a second block
    assert engine.value(M.BLOCK_FRAGMENTATION.name) == pytest.approx(1 - 33 / 64)
    assert engine.value(M.STEP_TOKENS.name) == 1
    engine.run_until_done()


def test_padding_ratio_is_zero_on_cpu(engine: InProcessEngine) -> None:
    engine.add("pad-0", 50, max_tokens=5, offset=4000)
    engine.run_until_done()
    assert engine.collector.stats.capture_sizes == []  # eager CPU: nothing captured
    padded = engine.value(M.PADDED_TOKENS.series_name)
    assert padded is not None and padded > 0
    assert padded == engine.value(M.UNPADDED_TOKENS.series_name)
    assert engine.value(M.PADDING_RATIO.name) == 0


def test_knob_gauges_equal_the_startup_values(engine: InProcessEngine) -> None:
    assert engine.value(M.MAX_NUM_BATCHED_TOKENS.name) == 512
    assert engine.value(M.STARTUP_MAX_NUM_BATCHED_TOKENS.name) == 512
    assert engine.scheduler.max_num_scheduled_tokens == 512
    assert engine.value(M.MAX_NUM_SEQS.name) == 64
    assert engine.value(M.STARTUP_MAX_NUM_SEQS.name) == 64
    assert engine.value(M.SCHEDULER_POLICY.name, policy="fcfs") == 1
    assert engine.value(M.SCHEDULER_POLICY.name, policy="priority") == 0


def test_step_counters_are_consistent(engine: InProcessEngine) -> None:
    steps = engine.value(M.STEPS.series_name)
    assert steps is not None and steps > 0
    assert engine.value(M.SCHEDULE_SECONDS.name + "_count") == steps
    assert engine.value(M.TOKEN_BUDGET.series_name) == 512 * steps


def test_endpoint_serves_every_metric(engine: InProcessEngine) -> None:
    server = engine.collector.server
    assert server is not None and server.host == "127.0.0.1"
    status, text = http_get(server.url + "/metrics")
    assert status == 200
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for spec in M.ALL_METRICS:
        wanted = spec.name + "_count" if spec.type == "histogram" else spec.series_name
        if spec.gpu_only:
            assert wanted not in names, "no GPU here: GPU series must be absent"
        elif spec.advisory_only:
            assert wanted not in names, "the autopilot is not advisory here"
        else:
            assert wanted in names, wanted
    # No NVIDIA driver on this machine: nvml_up 0 and no error.
    assert engine.value(M.NVML_UP.name) == 0
    assert http_get(server.url + "/nope")[0] == 404


def test_the_state_fits_the_published_schema(engine: InProcessEngine) -> None:
    """What the real agent sends is what docs/agent-api.schema.json describes."""
    schema = json.loads((ROOT / "docs" / "agent-api.schema.json").read_text())
    url = engine.collector.server.url
    for i in range(3):
        engine.add(f"schema-{i}", 40 + 30 * i, max_tokens=4, offset=900 + 50 * i)
    engine.step()  # running and waiting requests: the queues' answer has entries
    step = engine.collector.control.submit(
        parse_command({"max_num_seqs": 63}), idle=lambda: True
    ).effective_from_step
    engine.step()
    for path in ("/v1/state", f"/v1/state?since_step={step}"):
        status, body = http_get(url + path)
        assert status == 200
        jsonschema.validate(json.loads(body), {"$ref": "#/$defs/AgentState", **schema})
    assert json.loads(body)["since"]["from_step"] == step
    engine.collector.control.submit(parse_command({}, restore=True), idle=lambda: True)
    engine.run_until_done()


def test_no_model_is_built_in_the_step(engine: InProcessEngine) -> None:
    """The agent's models (pydantic) are built in the HTTP thread only: a step,
    with a knob change applied inside it and the autopilot on, builds none."""
    control = engine.collector.control
    control.submit(parse_command({"autopilot": True}), idle=lambda: True)
    built: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.endswith(PYDANTIC_MAIN):
            owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
            cls = owner if isinstance(owner, type) else type(owner)
            if cls.__module__.startswith("vllm_runbook."):
                built.append(f"{cls.__name__}.{code.co_name}")

    for i in range(6):
        engine.add(f"lean-{i}", 60 + 20 * i, max_tokens=6, offset=1300 + 50 * i)
    command = threading.Thread(
        target=lambda: control.submit(
            parse_command({"max_num_batched_tokens": 256}), idle=engine.collector.engine_idle
        )
    )
    sys.setprofile(profile)  # this thread's calls only: the engine's step
    try:
        command.start()
        while_stepping(engine, command)
        engine.run_until_done()
    finally:
        sys.setprofile(None)
    assert control.knobs()["max_num_batched_tokens"] == 256  # applied inside a step
    assert built == []
    control.submit(parse_command({}, restore=True), idle=lambda: True)


# -- prefix cache: a fresh engine, so the window holds only this workload --


@pytest.fixture(scope="module")
def fresh_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(tiny_model)
    yield eng
    eng.close()


def test_prefix_cache_hit_ratio_without_stats_logging(fresh_engine: InProcessEngine) -> None:
    assert fresh_engine.scheduler.log_stats is False  # offline LLM: stats logging off
    assert math.isnan(fresh_engine.value(M.KV_HIT_RATIO.name))  # no lookups yet
    for i in range(2):  # the same 100-token prompt, one after the other
        fresh_engine.add(f"hit-{i}", 100, max_tokens=2, offset=7)
        fresh_engine.run_until_done()
    # vLLM caches full blocks only and must compute the last token:
    # the second lookup finds 3 blocks of 32 = 96 tokens.
    assert fresh_engine.value(M.PREFIX_CACHE_QUERIES.series_name) == 200
    assert fresh_engine.value(M.PREFIX_CACHE_HITS.series_name) == 96
    assert fresh_engine.value(M.KV_HIT_RATIO.name) == pytest.approx(0.48)


# -- preemption under a small KV cache --


def recount(scheduler: Any, sizes: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(Σ tokens, Σ ceil(tokens / b) per size) over the running requests, from scratch."""
    if not scheduler.running:
        return 0, (0,) * len(sizes)
    tokens = [r.num_computed_tokens for r in scheduler.running]
    return sum(tokens), tuple(sum(-(-t // b) for t in tokens) for b in sizes)


@pytest.fixture(scope="module")
def small_kv_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    # 32 blocks (31 usable) of 32 tokens: 992 tokens of KV for 16 requests
    # that each grow to 300 tokens.
    eng = InProcessEngine.start(
        tiny_model, num_gpu_blocks_override=32, max_num_seqs=16, max_model_len=512
    )
    yield eng
    eng.close()


def test_preemptions_equal_the_schedulers_own_count(small_kv_engine: InProcessEngine) -> None:
    scheduler = small_kv_engine.scheduler
    preempted: list[str] = []
    original = scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = counting_preempt
    try:
        for i in range(16):
            small_kv_engine.add(f"long-{i}", 200, max_tokens=100, offset=20 * i)
        collector = small_kv_engine.collector
        stats = collector.stats
        on_schedule = stats.on_schedule  # every step's, fast path or slow
        checked = []

        def checking_on_schedule(*args: Any) -> None:
            # Right after each schedule(): the incremental sums equal a recount of
            # the running requests, through prefills, decodes, preemptions,
            # resumptions and finishes, and the real fragmentation the block tables'.
            on_schedule(*args)
            assert stats.fragmentation_sums == recount(scheduler, stats.running_sums.sizes)
            held = sum(len(stats._req_to_blocks[r.request_id]) for r in scheduler.running)
            tokens = sum(r.num_computed_tokens for r in scheduler.running)
            assert stats.fragmentation == (1 - tokens / (held * 32) if held else 0.0)
            checked.append(len(scheduler.running))

        stats.on_schedule = checking_on_schedule  # type: ignore[method-assign]
        try:
            finished = small_kv_engine.run_until_done()
        finally:
            del stats.on_schedule
        assert len(checked) > 100 and max(checked) > 1
    finally:
        del scheduler._preempt_request
    assert len(finished) == 16
    assert len(preempted) > 0, "the workload must really preempt"
    assert small_kv_engine.value(M.PREEMPTIONS.series_name) == len(preempted)
    assert small_kv_engine.value(M.KV_BLOCKS_USED.name) == 0
    assert small_kv_engine.value(M.KV_BLOCKS_FREE.name) == 31


# -- vLLM's AsyncScheduler (its default on GPU), through the explicit class --


@pytest.fixture(scope="module")
def async_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(
        tiny_model, scheduler_cls="vllm_runbook.collector.scheduler.RunbookAsyncScheduler"
    )
    yield eng
    eng.close()


def test_async_scheduler_is_hooked_with_the_same_oracles(async_engine: InProcessEngine) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    assert isinstance(async_engine.scheduler, AsyncScheduler)
    for i, n in enumerate((40, 70, 100)):
        async_engine.add(f"async-{i}", n, max_tokens=3, offset=500 + 150 * i)
    async_engine.step()
    assert async_engine.value(M.BLOCK_FRAGMENTATION.name) == pytest.approx(1 - 210 / 288)
    assert async_engine.value(M.LENGTH_PADDING_RATIO.name) == pytest.approx(1 - 210 / 300)
    finished = async_engine.run_until_done()
    assert sorted(finished) == ["async-0", "async-1", "async-2"]
    assert async_engine.value(M.SCHEDULED_TOKENS.series_name) == 210 + 2 * 3


# -- starvation: the oldest request waiting for its first schedule --


@pytest.fixture(scope="module")
def one_slot_priority_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(tiny_model, scheduling_policy="priority", max_num_seqs=1)
    yield eng
    eng.close()


def test_oldest_waiting_request_shows_starvation_exactly(
    one_slot_priority_engine: InProcessEngine,
) -> None:
    """One slot, priority policy: `b` (low priority) arrives between two high
    ones and waits while both are served. The engine's clock is set by the
    test, so ages are exact: `b` reached the engine at 1001 and it is 1010."""
    eng = one_slot_priority_engine
    collector = eng.collector
    now = [1000.0]
    collector.wall_clock = lambda: now[0]

    def observed() -> tuple[float | None, float]:
        return eng.value(M.OLDEST_WAITING.name), collector.state().stats.admitted_before_time

    try:
        assert observed() == (0.0, 1000.0)  # nothing waits: every request was admitted
        for name, at, priority, offset in (("a", 1000.0, 0, 0), ("b", 1001.0, 10, 50),
                                           ("c", 1002.0, 0, 100)):  # fmt: skip
            now[0] = at
            eng.add(name, 20, max_tokens=3, offset=offset, priority=priority)
        now[0] = 1010.0
        assert observed() == (10.0, 1000.0)  # `a` has waited since 1000
        admitted: list[str] = []
        seen = []
        while not admitted or admitted[-1] != "b":
            eng.step()
            for r in eng.scheduler.running:
                name = r.request_id.split("-")[0]
                if name not in admitted:
                    admitted.append(name)
            seen.append(observed())
        assert admitted == ["a", "c", "b"]
        # From the first step until `b` got its slot: `b` is the oldest waiting,
        # 9 s, and nothing after 1001 counts as admitted-before, while `c` (which
        # arrived later) is served first.
        assert seen[:-1] == [(9.0, 1001.0)] * (len(seen) - 1)
        assert len(seen) >= 7  # `a` and `c` each took a prefill and two decode steps
        assert seen[-1] == (0.0, 1010.0)  # nothing waits: up to now
        # Never backwards, even when the clock is.
        now[0] = 1005.0
        assert observed() == (0.0, 1010.0)
        eng.run_until_done()

        # A request aborted while queued leaves nothing behind, with no step to follow.
        now[0] = 2000.0
        eng.add("busy", 20, max_tokens=50, offset=200)
        eng.step()
        eng.add("gone", 20, max_tokens=3, offset=300)
        now[0] = 2005.0
        assert observed() == (5.0, 2000.0)
        eng.engine.abort_request(["gone", "busy"])
        assert not eng.engine.has_unfinished_requests()
        assert observed() == (0.0, 2005.0)
    finally:
        collector.wall_clock = time.time
        eng.run_until_done()


# -- the engine's configuration and workload --


def test_the_configuration_vllm_resolved_is_in_the_state_and_on_metrics(
    engine: InProcessEngine,
) -> None:
    status, body = http_get(engine.collector.server.url + "/v1/state")
    assert status == 200
    config = json.loads(body)["config"]
    # tests/engines.py ENGINE_DEFAULTS, as vLLM resolved them.
    assert {k: config[k] for k in ENGINE_CONFIG_ORACLE} == ENGINE_CONFIG_ORACLE
    # On CPU the device fields are null, with the reason.
    assert config["device_name"] is None and config["sm_count"] is None
    assert config["device_reason"] == "CPU engine: no GPU"
    from vllm_runbook.collector.settings import vllm_version

    assert config["vllm_version"] == vllm_version()
    # The same as one info series: every label is the state's value as text.
    labels = {
        label: ""
        if config[label] is None
        else str(config[label]).lower()
        if isinstance(config[label], bool)
        else str(config[label])
        for label in M.CONFIG_INFO_LABELS
    }
    assert engine.value(M.ENGINE_CONFIG_INFO.name, **labels) == 1
    assert engine.value(M.CONFIG_BLOCK_SIZE.name) == 32
    assert engine.value(M.CONFIG_NUM_GPU_BLOCKS.name) == 255
    assert engine.value(M.CONFIG_GPU_MEMORY_UTILIZATION.name) == 0.2
    assert engine.value(M.CONFIG_MAX_MODEL_LEN.name) == 1024
    assert engine.value(M.CONFIG_CHUNKED_PREFILL.name) == 1
    assert engine.value(M.CONFIG_GPU_SM_COUNT.name) is None  # GPU only


ENGINE_CONFIG_ORACLE = {
    "block_size": 32,
    "num_gpu_blocks": 255,  # num_gpu_blocks_override 256, less vLLM's null block
    "gpu_memory_utilization": 0.2,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "cudagraph_mode": "NONE",
    "cudagraph_capture_sizes": [],
    "kv_cache_dtype": "auto",
    "dtype": "bfloat16",
    "quantization": None,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "speculative_method": None,
    "num_speculative_tokens": None,
    "scheduling_policy": "fcfs",
    "platform": "cpu",
}


def test_workload_lengths_over_the_window(engine: InProcessEngine) -> None:
    """Prompt spread P90/P10 and the share above 8k over the window's arrivals;
    output lengths of the requests that finished in it. Exact (nearest rank)."""
    collector = engine.collector
    later = time.time() + 100_000  # earlier tests' requests fall out of the window
    collector.wall_clock = lambda: later
    try:
        prompts = [20 * (i + 1) for i in range(10)]  # 20, 40, ..., 200
        for i, n in enumerate(prompts):
            engine.add(f"len-{i}", n, max_tokens=3 + i % 2, offset=5000 + 250 * i)
        engine.run_until_done()
        # P10 = 20 (rank 1), P90 = 180 (rank 9): a spread of 9.
        assert engine.value(M.PROMPT_LENGTH_SPREAD.name) == 9.0
        assert engine.value(M.LONG_PROMPT_RATIO.name) == 0.0
        workload = json.loads(http_get(collector.server.url + "/v1/state")[1])["workload"]
        assert workload["requests_arrived"] == 10
        assert workload["prompt_tokens"] == {
            "count": 10,
            "p10": 20,
            "p50": 100,
            "p90": 180,
            "p99": 200,
            "max": 200,
        }
        assert workload["output_tokens"] == {
            "count": 10,
            "p10": 3,
            "p50": 3,
            "p90": 4,
            "p99": 4,
            "max": 4,
        }
        assert workload["prompt_length_spread_ratio"] == 9.0
        assert workload["long_prompt_ratio"] == 0.0
        later += 1_000  # nothing arrived in the window: undefined, not 0
        assert math.isnan(engine.value(M.PROMPT_LENGTH_SPREAD.name))  # type: ignore[arg-type]
    finally:
        collector.wall_clock = time.time
