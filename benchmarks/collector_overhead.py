"""Collector overhead: the same workload with and without the hook.

Two in-process engines with identical settings live in one process: one
with vLLM's plain Scheduler, one with `vllm_runbook.collector.scheduler.RunbookScheduler`
(the plugin is kept out with VLLM_PLUGINS=, so the only difference is the
hook). Rounds alternate between them, so drift on a shared machine hits both.

Prints output tokens/s of both and their ratio, then what the whole hook costs
at 16, 64 and 256 running requests (each request 192 tokens out, so every
workload has the same decode steps): every wrapper (the scheduler lock,
schedule/update_from_output/add_request/finish_requests/_free_request with
their callbacks, the prefix-cache wrapper), measured as time in the mixin's
methods minus time in vLLM's methods they call. Three figures, medians of
the rounds: all of it per step; the steady state, a decode step that admits
and finishes nothing (the median of such steps: what grows with the batch,
if anything does); and the part per request (its arrival, first schedule
and finish: the steps that admit or finish requests, less a decode step
each, plus add_request; a workload of more requests has more of it per step).
Then the share of the engine step's wall time. The measure has a floor: the
timer around vLLM's method is inside the one around the hook's, so its own
cost reads as the hook's. The engine without the hook is measured the same
way, its methods under two timers (`timers µs/step`, the control: nothing
but the timers lies between them), and `less timers` is the share of step
above that floor.

`--nvml` measures the NVML poller alone instead (no engine, seconds): what one
poll costs (`NvmlPoller.poll`, every visible GPU's memory and utilisation)
and what a poller thread at each interval takes from a Python-bound main
thread (the stand-in for the engine's step: it needs the GIL the poller's
wake-ups take). With pynvml and an NVIDIA GPU the polls are real; elsewhere
a fake NVML with `--gpus` GPUs answers at once, which times the Python side
only (a real NVML call releases the GIL while the driver answers).

Then the end-to-end cost, as a new user meets it (`--e2e-rounds`, 0 skips
it): three resident engines, each EngineCore in its own process (spawned, so
each reads its own VLLM_PLUGINS): one with the plugin as installed, two with
VLLM_PLUGINS="" (the A/A control). Rounds of 128 prompts of 16-300 tokens,
128 tokens out, max_num_seqs 64, the engines' order rotated each round;
output tokens/s with ÷ without the plugin (the mean of the two), and the two
without against each other, medians of the per-round ratios.

Then the same on one engine (`--same-engine-rounds`, 0 skips it): its
EngineCore in its own process with the plugin as installed, the hook switched
on and off between batches (benchmarks/hook_toggle.py), so no two processes'
own speeds enter the ratio. Rounds of three batches (on, off A, off B), in
each of their six orders in turn (a multiple of 6 rounds: each kind in each
place and after each other kind equally often), each batch with prompts of
its own; output tokens/s on ÷ the mean of
the two off, off A ÷ off B, medians of the per-round ratios, and the
interquartile range of on ÷ off (how much one round says).

`--step-toggle ROUNDS` (alone, a multiple of 3) runs that engine with the
hook switched inside each round instead (benchmarks/hook_toggle.py,
`StepToggledScheduler`): on for a block of BLOCK_STEPS steps, off for the
next two ("off A", "off B"), round r's block j of kind (r + j) mod 3. Every
round is the same batch (new tokens), so three rounds in a row give each
block's place in the round to each kind once. Output tokens over seconds
per kind, pooled over the blocks (each block's steps after its first),
on ÷ off and A/A, and a 95 % interval of on ÷ off from a bootstrap over
the triples of rounds. With `--busy-us W`, the third kind is a busy wait
of W µs at the start of each schedule() instead of "off B" (the hook off):
a known cost on the engine thread, read by the same measure, beside the
hook's (busy ÷ off A, on ÷ off A, and what each reads as in µs a step).

    .venv/bin/python benchmarks/collector_overhead.py [--rounds 5] [--e2e-rounds 9] \
        [--same-engine-rounds 60]
    .venv/bin/python benchmarks/collector_overhead.py --step-toggle 60 [--busy-us 200]
    .venv/bin/python benchmarks/collector_overhead.py --nvml [--gpus 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if {"--e2e-child", "--same-engine-child", "--step-toggle-child"} & set(sys.argv):
    # its engines' cores in their own (spawned) processes
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
else:  # in-process cores: the hook's methods are timed in this process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")

# The table's header row, as docs/benchmarks.md shows it (a test compares them).
HEADER = (
    " running | tok/s without | tok/s with |  ratio | hook µs/step "
    "| decode step µs | µs/request | share of step | timers µs/step | less timers | steps"
)

ENGINE_ARGS = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    num_gpu_blocks_override=2048,
    enforce_eager=True,
    seed=0,
)
# running: (requests, prompt, output); the same output length, so the same decode steps.
WORKLOADS = {16: (16, 48, 192), 64: (64, 48, 192), 256: (256, 48, 192)}

E2E_HEADER = " rounds | tok/s plugin | tok/s without (A, B) | plugin ÷ without | A/A (A ÷ B)"
E2E_ENGINE_ARGS = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    num_gpu_blocks_override=2048,
    enforce_eager=True,
    seed=0,
)
E2E_PROMPTS, E2E_OUTPUT = 128, 128
SAME_ENGINE_HEADER = (
    " rounds | tok/s hook on | tok/s hook off (A, B) | on ÷ off | A/A (A ÷ B) | IQR of on ÷ off"
)

# The one-engine check's rounds: the six orders of its three batches in turn,
# so that in every six rounds each kind runs twice in each place and follows
# each other kind three times (the last batch of a round included). With the
# three rotations alone, "off A" followed "on" twice as often as "off B" did,
# and the A/A read above 1 in 12 of 17 runs (mean 1.005, up to 1.027).
SAME_ENGINE_ORDERS = (
    ("on", "off A", "off B"),
    ("off A", "off B", "on"),
    ("off B", "on", "off A"),
    ("on", "off B", "off A"),
    ("off B", "off A", "on"),
    ("off A", "on", "off B"),
)

STEP_TOGGLE_HEADER = (
    " rounds | blocks (on, A, B) | tok/s hook on | tok/s hook off (A, B) "
    "| on ÷ off | 95 % interval   | A/A (A ÷ B)"
)

# --step-toggle ROUNDS --busy-us W: the third kind a busy wait of W µs a step
# instead of "off B" (the positive control: a known cost, read as the hook is).
BUSY_HEADER = (
    " rounds | busy µs | step ms (off A) | busy ÷ off A | 95 % interval   | read as µs "
    "| hook on ÷ off A | 95 % interval   | read as µs"
)

NVML_HEADER = " poll interval | NVML   | GPUs | µs/poll | poller µs/s | main-thread loops/s | ratio"
NVML_INTERVALS: tuple[float | None, ...] = (None, 5.0, 1.0, 0.1, 0.01)


class FakeNvml:
    """Answers like pynvml at once: the poller's Python side alone."""

    class _Reading:
        def __init__(self, **values: float) -> None:
            self.__dict__.update(values)

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Reading:
        return self._Reading(used=(h + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> _Reading:
        return self._Reading(gpu=50, memory=40)

    # The hardware, read once per GPU at its first poll.
    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return 9, 0

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return 5

    nvmlDeviceGetMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration
    nvmlDeviceGetGpuMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return 16


def _nvml_source(gpus: int) -> tuple[object, str]:
    """pynvml where it finds a GPU, else the fake with `gpus` GPUs."""
    from vllm_runbook.collector.nvml import load_pynvml

    nvml = load_pynvml()
    if nvml is not None:
        try:
            nvml.nvmlInit()
            if nvml.nvmlDeviceGetCount() > 0:
                return nvml, "pynvml"
        except Exception:  # no driver: the fake below
            pass
    return FakeNvml(gpus), "fake"


def _poller(nvml: object, interval: float):  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry
    from vllm_runbook.collector.nvml import NvmlPoller

    return NvmlPoller.create(nvml, CollectorRegistry(), ("m", "0"), interval)


def _main_thread_loops(seconds: float) -> float:
    """Python-bound work (it holds the GIL, like the engine's step): loops per second."""
    loops, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(200))
        loops += 1
    return loops / seconds


def nvml_table(rounds: int, gpus: int, seconds: float = 1.0) -> list[str]:
    nvml, source = _nvml_source(gpus)
    poller = _poller(nvml, 1.0)
    poller.init()
    n = len(poller.handles)
    polls = 2000 if source == "fake" else 200
    start = time.perf_counter()
    for _ in range(polls):
        poller.poll()
    per_poll_us = (time.perf_counter() - start) / polls * 1e6
    loops: dict[float | None, list[float]] = {i: [] for i in NVML_INTERVALS}
    for r in range(rounds):
        order = (
            NVML_INTERVALS[r % len(NVML_INTERVALS) :] + NVML_INTERVALS[: r % len(NVML_INTERVALS)]
        )
        for interval in order:
            running = None
            if interval is not None:
                running = _poller(nvml, interval)
                running.start()
            loops[interval].append(_main_thread_loops(seconds))
            if running is not None:
                running.stop()
    base = statistics.median(loops[None])
    rows = []
    for interval in NVML_INTERVALS:
        shown = "none" if interval is None else f"{interval:g} s"
        cost = "—" if interval is None else f"{per_poll_us:.1f}"
        per_second = "—" if interval is None else f"{per_poll_us / interval:.1f}"
        median = statistics.median(loops[interval])
        rows.append(
            f"{shown:>14} | {source:<6} | {n:>4} | {cost:>7} | {per_second:>11} | "
            f"{median:>19.0f} | {median / base:>5.3f}"
        )
    return rows


def run_workload(llm, running: int, round_no: int) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    n, prompt, output = WORKLOADS[running]
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    prompts = [
        TokensPrompt(prompt_token_ids=prompt_token_ids(prompt, 997 * round_no + 13 * i))
        for i in range(n)
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


HOOKED_METHODS = (
    "schedule",
    "update_from_output",
    "add_request",
    "finish_requests",
    "_free_request",
)


@dataclasses.dataclass
class HookCost:
    """One measured run of a workload on the "with" engine."""

    per_step_us: float  # all hook time / steps (arrivals and finishes included)
    decode_step_us: float  # median over steps that admitted and finished nothing
    per_request_us: float  # per request: its arrival, admission and finish (see hook_costs)
    share: float  # of the engine step's wall time
    steps: int


def _timed(fn, spent: dict[str, float], key: str):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t

    return wrapper


def timer_floor(llm, running: int, round_no: int) -> float:  # type: ignore[no-untyped-def]
    """µs per step: hook_costs' measure on the engine without the hook: each of vLLM's
    methods in HOOKED_METHODS under an outer and an inner timer, as the hooked
    engine's are (the mixin's method under one, vLLM's under the other). The
    outer less the inner is then the inner timer's own cost alone."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    vllm_cls = next(c for c in type(scheduler).__mro__ if c.__module__.startswith("vllm.v1"))
    spent = {"outer": 0.0, "inner": 0.0}
    steps = 0
    saved = {name: vllm_cls.__dict__[name] for name in HOOKED_METHODS}
    for name, fn in saved.items():
        setattr(vllm_cls, name, _timed(_timed(fn, spent, "inner"), spent, "outer"))
    original_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        return original_step()

    engine.step = step
    try:
        run_workload(llm, running, 10_000 + round_no)
    finally:
        for name, fn in saved.items():
            setattr(vllm_cls, name, fn)
        del engine.step
    return (spent["outer"] - spent["inner"]) / steps * 1e6


def hook_costs(llm, running: int, round_no: int) -> HookCost:  # type: ignore[no-untyped-def]
    """What the whole hook costs the "with" engine on one workload: every
    wrapper (the scheduler lock, schedule/update_from_output/add_request/
    finish_requests/_free_request and their on_* callbacks, the prefix-cache
    wrapper) as the time spent in the mixin's methods minus the time in vLLM's
    own methods they call (nested calls cancel out: _free_request runs inside
    vLLM's update_from_output). Each step's share is kept apart, so the steady
    state (a decode step at `running` requests: what grows with the batch) is
    told from the per-request work (arrival, first schedule, finish), which a
    workload of more requests has more of per step."""
    from vllm_runbook.collector.hook import RunbookSchedulerMixin

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    collector = scheduler.runbook_collector
    base = RunbookSchedulerMixin
    vllm_cls = next(c for c in type(scheduler).__mro__ if c.__module__.startswith("vllm.v1"))
    spent = {"outer": 0.0, "inner": 0.0, "prefix": 0.0, "step": 0.0}
    steps: list[tuple[float, bool]] = []  # (hook seconds, admitted or finished something)
    saved = {}

    def timed(fn, key: str):  # type: ignore[no-untyped-def]
        return _timed(fn, spent, key)

    def hook_total() -> float:
        return spent["outer"] - spent["inner"] + spent["prefix"]

    for name in HOOKED_METHODS:
        saved[(base, name)] = base.__dict__[name]
        saved[(vllm_cls, name)] = vllm_cls.__dict__[name]
        setattr(base, name, timed(base.__dict__[name], "outer"))
        setattr(vllm_cls, name, timed(vllm_cls.__dict__[name], "inner"))
    # The prefix-cache wrapper runs inside vLLM's schedule() (counted as
    # "inner" there): its own part is the lookup callback.
    collector.stats.on_prefix_lookup = timed(collector.stats.on_prefix_lookup, "prefix")
    original_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        before, admitted, finished = (
            hook_total(),
            collector.requests.first_schedules,
            sum(collector.requests.log.by_reason.values()),
        )
        t = time.perf_counter()
        try:
            return original_step()
        finally:
            spent["step"] += time.perf_counter() - t
            changed = (
                collector.requests.first_schedules != admitted
                or sum(collector.requests.log.by_reason.values()) != finished
            )
            steps.append((hook_total() - before, changed))

    engine.step = step
    try:
        run_workload(llm, running, 10_000 + round_no)
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
        del collector.stats.on_prefix_lookup, engine.step
    hook = hook_total()
    decode = statistics.median(t for t, changed in steps if not changed)
    n = WORKLOADS[running][0]
    # Per request: the steps that admitted or finished requests, less a decode
    # step each, and the hook outside the steps (add_request, as generate()
    # queues the prompts). Not the decode steps' spread above their median:
    # a time slice the OS takes from the hook in one decode step (4-12 ms on
    # a busy machine) would read as hundreds of µs per request.
    outside = hook - sum(t for t, _ in steps)
    per_request = sum(t - decode for t, changed in steps if changed) + outside
    return HookCost(
        per_step_us=hook / len(steps) * 1e6,
        decode_step_us=decode * 1e6,
        per_request_us=per_request / n * 1e6,
        share=hook / spent["step"],
        steps=len(steps),
    )


def e2e_prompt_lengths(round_no: int) -> list[int]:
    """128 prompt lengths spread over 16-300 tokens, shuffled per round."""
    import random

    lengths = [16 + (284 * i) // (E2E_PROMPTS - 1) for i in range(E2E_PROMPTS)]
    random.Random(round_no).shuffle(lengths)
    return lengths


def e2e_main(rounds: int) -> None:
    """Runs in its own process (see main): engines with their EngineCore in
    processes of their own. Prints one JSON line of per-round tok/s."""
    import json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids

    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    engines = {}
    for name, plugins in (("plugin", None), ("without A", ""), ("without B", "")):
        if plugins is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = plugins
        engines[name] = LLM(model=str(model), **E2E_ENGINE_ARGS)
    params = SamplingParams(max_tokens=E2E_OUTPUT, ignore_eos=True, temperature=0.0)
    names = list(engines)
    tps: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):  # round 0 warms up
        prompts = [
            TokensPrompt(prompt_token_ids=prompt_token_ids(n, 1009 * r + 7 * i))
            for i, n in enumerate(e2e_prompt_lengths(r))
        ]
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if r:
                tps[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    print("E2E " + json.dumps(tps))


def same_engine_main(rounds: int) -> None:
    """Runs in its own process: one engine (its EngineCore in a process of its
    own, the plugin as installed) whose hook is switched on and off between
    rounds (benchmarks/hook_toggle.py). Each round runs three batches, "on",
    "off A" and "off B", in SAME_ENGINE_ORDERS' order of the round; every batch
    has prompts of its own (the same lengths), so none hits the prefix cache
    another one filled. Prints one JSON line of per-round tok/s."""
    import json

    from hook_toggle import FLAG_ENV
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids

    _pin_cpus()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-runbook-bench-"))
    flag = tmp / "hook"
    flag.write_text("on")
    os.environ[FLAG_ENV] = str(flag)
    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    # The kind of class vLLM picks itself (async or not), with the switch; the
    # plugin wraps it as it wraps vLLM's own.
    llm = LLM(model=str(model), scheduler_cls="hook_toggle.ToggledScheduler", **E2E_ENGINE_ARGS)
    if llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
        llm.llm_engine.engine_core.shutdown()
        llm = LLM(
            model=str(model), scheduler_cls="hook_toggle.ToggledAsyncScheduler", **E2E_ENGINE_ARGS
        )
    params = SamplingParams(max_tokens=E2E_OUTPUT, ignore_eos=True, temperature=0.0)
    tps: dict[str, list[float]] = {name: [] for name in SAME_ENGINE_ORDERS[0]}
    for r in range(rounds + 1):  # round 0 warms up, in the order before round 1's
        order = SAME_ENGINE_ORDERS[(r - 1) % len(SAME_ENGINE_ORDERS)]
        for position, name in enumerate(order):
            seed = 1009 * r + 100_003 * position
            prompts = [
                TokensPrompt(prompt_token_ids=prompt_token_ids(n, seed + 7 * i))
                for i, n in enumerate(e2e_prompt_lengths(r))
            ]
            flag.write_text("on" if name == "on" else "off")
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if r:
                tps[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    print("SAME " + json.dumps(tps))


def _pin_cpus() -> None:
    """Cores apart: this process and the EngineCore (spawned from it) on the
    first, the model's worker threads on the rest. Unpinned, three busy
    processes share two cores and one round's on ÷ off varied by ±3.5 %
    (interquartile range, 60 rounds); pinned, by ±1.8–3 % (three runs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[1:])))
        os.sched_setaffinity(0, cpus[:1])


def step_toggle_main(rounds: int) -> None:
    """Runs in its own process: one engine as same_engine_main's, whose hook
    is switched on and off every BLOCK_STEPS steps inside each round
    (benchmarks/hook_toggle.py, `StepToggledScheduler`): one batch per
    round, prompts of its own. Prints one JSON line: the measured blocks of
    rounds 1.. as (round, kind, seconds, tokens, steps), and any error the
    collector met (which voids the run)."""
    import json

    from hook_toggle import STEP_LOG_ENV
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids

    _pin_cpus()
    log = Path(tempfile.mkdtemp(prefix="vllm-runbook-bench-")) / "blocks.jsonl"
    os.environ[STEP_LOG_ENV] = str(log)
    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    llm = LLM(model=str(model), scheduler_cls="hook_toggle.StepToggledScheduler", **E2E_ENGINE_ARGS)
    if llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
        llm.llm_engine.engine_core.shutdown()
        llm = LLM(
            model=str(model),
            scheduler_cls="hook_toggle.StepToggledAsyncScheduler",
            **E2E_ENGINE_ARGS,
        )
    params = SamplingParams(max_tokens=E2E_OUTPUT, ignore_eos=True, temperature=0.0)
    for r in range(rounds + 2):  # round 0 warms up; the last only makes the engine write its log
        # The same lengths in the same order every round (new tokens each): each
        # block's place in the round then has the same work in every round, and
        # the rotation gives it to each kind in turn.
        lengths = e2e_prompt_lengths(0) if r <= rounds else [16]
        prompts = [
            TokensPrompt(prompt_token_ids=prompt_token_ids(n, 1009 * r + 7 * i))
            for i, n in enumerate(lengths)
        ]
        llm.generate(prompts, params, use_tqdm=False)
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    blocks = [x["block"] for x in lines if "block" in x and x["block"][0] >= 1]
    errors = [x["error"] for x in lines if "error" in x]
    print("STEP " + json.dumps({"blocks": blocks, "errors": errors}))


def _child(
    flag: str, rounds: int, prefix: str, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs this script with `flag rounds` in a fresh interpreter; its JSON line."""
    import json
    import subprocess

    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, __file__, flag, str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith(prefix))
    return dict(json.loads(line[len(prefix) :]))


def same_engine_table(rounds: int) -> list[str]:
    tps = _child("--same-engine-child", rounds, "SAME ")
    on, a, b = tps["on"], tps["off A"], tps["off B"]
    ratios = sorted(p / ((x + y) / 2) for p, x, y in zip(on, a, b, strict=True))
    control = statistics.median(x / y for x, y in zip(a, b, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return [
        f"{rounds:>7} | {statistics.median(on):>13.0f} | "
        f"{statistics.median(a):>10.0f}, {statistics.median(b):>9.0f} | "
        f"{statistics.median(ratios):>8.3f} | {control:>11.3f} | {q1:>7.3f} – {q3:.3f}"
    ]


def _pooled(blocks: list[list[float]]) -> tuple[float, float, float, float, float]:
    """(on ÷ off, A ÷ B, tok/s on, off A, off B), each kind's tokens over its seconds."""
    tokens, seconds = [0.0] * 3, [0.0] * 3
    for _, kind, s, t, _ in blocks:
        tokens[int(kind)] += t
        seconds[int(kind)] += s
    tps = [t / s for t, s in zip(tokens, seconds, strict=True)]
    off = (tokens[1] + tokens[2]) / (seconds[1] + seconds[2])
    return tps[0] / off, tps[1] / tps[2], tps[0], tps[1], tps[2]


def _step_toggle_run(rounds: int, busy_us: float = 0.0) -> list[list[float]]:
    """step_toggle_main's measured blocks (its third kind with a busy wait of
    `busy_us` a step where given: hook_toggle.BUSY_ENV); a collector error voids
    the run."""
    from hook_toggle import BUSY_ENV

    # Always set: a value left in this shell's environment never reaches a plain run.
    result = _child("--step-toggle-child", rounds, "STEP ", {BUSY_ENV: repr(busy_us)})
    if result["errors"]:
        raise SystemExit(f"the collector failed during the run: {result['errors'][0]}")
    return list(result["blocks"])


def _bootstrap(blocks: list[list[float]], statistic: Any) -> list[Any]:
    """`statistic` of 2,000 resamples (seeded) of the blocks' triples of rounds,
    the unit in which each block's place in the round went to each kind once."""
    import random

    triples: dict[int, list[list[float]]] = {}
    for block in blocks:
        triples.setdefault((int(block[0]) - 1) // 3, []).append(block)
    rng, units = random.Random(0), list(triples.values())
    return [
        statistic([x for unit in rng.choices(units, k=len(units)) for x in unit])
        for _ in range(2000)
    ]


def step_toggle_table(rounds: int) -> list[str]:
    """The pooled ratios of step_toggle_main's blocks, with a 95 % interval of
    on ÷ off from the bootstrap over triples of rounds."""
    blocks = _step_toggle_run(rounds)
    ratio, control, on, a, b = _pooled(blocks)
    resampled = sorted(x[0] for x in _bootstrap(blocks, _pooled))
    low, high = resampled[49], resampled[1949]
    counts = [sum(1 for x in blocks if int(x[1]) == kind) for kind in range(3)]
    return [
        f"{rounds:>7} | {counts[0]:>5}, {counts[1]:>4}, {counts[2]:>4} | {on:>13.0f} | "
        f"{a:>10.0f}, {b:>9.0f} | {ratio:>8.4f} | {low:.4f} – {high:.4f} | {control:>11.4f}"
    ]


def busy_table(rounds: int, busy_us: float) -> list[str]:
    """step_toggle_table's run with its third kind a busy wait of `busy_us` a
    step: busy ÷ off A and hook on ÷ off A, each kind's tokens over its
    seconds pooled over its blocks, with the bootstrap's 95 % interval; and
    what each ratio reads as in µs a step: off A's mean step times (off A ÷
    kind - 1), the time a step would have to gain to lose that much. A
    measure that reads the busy wait as its size reads the hook's cost as
    its size too."""
    blocks = _step_toggle_run(rounds, busy_us)

    def ratios(chosen: list[list[float]]) -> tuple[float, float, float]:
        """(busy ÷ off A, on ÷ off A, off A's mean step in seconds)."""
        tokens, seconds, steps = [0.0] * 3, [0.0] * 3, [0] * 3
        for _, kind, s, t, n in chosen:
            tokens[int(kind)] += t
            seconds[int(kind)] += s
            steps[int(kind)] += int(n)
        tps = [t / s for t, s in zip(tokens, seconds, strict=True)]
        return tps[2] / tps[1], tps[0] / tps[1], seconds[1] / steps[1]

    busy, hook, step = ratios(blocks)
    resampled = _bootstrap(blocks, ratios)
    b = sorted(x[0] for x in resampled)
    h = sorted(x[1] for x in resampled)

    def read_as(ratio: float) -> float:
        return step * (1 / ratio - 1) * 1e6

    return [
        f"{rounds:>7} | {busy_us:>7.0f} | {step * 1e3:>15.2f} | {busy:>12.4f} | "
        f"{b[49]:.4f} – {b[1949]:.4f} | {read_as(busy):>10.1f} | {hook:>15.4f} | "
        f"{h[49]:.4f} – {h[1949]:.4f} | {read_as(hook):>10.1f}"
    ]


def e2e_table(rounds: int) -> list[str]:
    """Runs e2e_main in a fresh interpreter (this one runs its engines in-process)."""
    tps = _child("--e2e-child", rounds, "E2E ")
    plugin, a, b = tps["plugin"], tps["without A"], tps["without B"]
    ratio = statistics.median(p / ((x + y) / 2) for p, x, y in zip(plugin, a, b, strict=True))
    control = statistics.median(x / y for x, y in zip(a, b, strict=True))
    return [
        f"{rounds:>7} | {statistics.median(plugin):>12.0f} | "
        f"{statistics.median(a):>9.0f}, {statistics.median(b):>9.0f} | "
        f"{ratio:>16.3f} | {control:>12.3f}"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--e2e-rounds", type=int, default=9)
    parser.add_argument("--e2e-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--same-engine-rounds", type=int, default=0)
    parser.add_argument("--same-engine-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--step-toggle",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="the hook switched every few steps on one engine, alone",
    )
    parser.add_argument("--step-toggle-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--busy-us",
        type=float,
        default=0.0,
        metavar="µS",
        help="with --step-toggle: the third kind a busy wait of this many µs a step (a known cost)",
    )
    parser.add_argument("--nvml", action="store_true", help="the NVML poller alone")
    parser.add_argument("--gpus", type=int, default=8, help="--nvml without a GPU: fake GPUs")
    args = parser.parse_args()
    if args.e2e_child is not None:
        e2e_main(args.e2e_child)
        return
    if args.same_engine_child is not None:
        same_engine_main(args.same_engine_child)
        return
    if args.step_toggle_child is not None:
        step_toggle_main(args.step_toggle_child)
        return
    if args.same_engine_rounds < 0 or args.same_engine_rounds % len(SAME_ENGINE_ORDERS):
        parser.error(
            "--same-engine-rounds: 0 or a positive multiple of 6 (each order of the batches once)"
        )
    if args.busy_us and not args.step_toggle:
        parser.error("--busy-us: only with --step-toggle")
    if not 0 <= args.busy_us <= 100_000:  # NaN fails too
        parser.error("--busy-us: from 0 to 100000 µs")
    if args.step_toggle:
        if args.step_toggle < 0 or args.step_toggle % 3:
            parser.error("--step-toggle: a multiple of 3 rounds (each kind in each place once)")
        from hook_toggle import BLOCK_STEPS

        if args.busy_us:
            rows_busy = busy_table(args.step_toggle, args.busy_us)
            print(
                "\nend to end inside one engine (its EngineCore process), every "
                f"{BLOCK_STEPS} steps the hook on, off, or off with a busy wait of "
                f"{args.busy_us:g} µs a step, {args.step_toggle} rounds (pooled over blocks)"
            )
            print(BUSY_HEADER)
            print("-" * len(BUSY_HEADER))
            print(*rows_busy, sep="\n")
            return

        rows_step = step_toggle_table(args.step_toggle)
        print(
            "\nend to end inside one engine (its EngineCore process), the hook switched on and "
            f"off every {BLOCK_STEPS} steps, {args.step_toggle} rounds (pooled over blocks)"
        )
        print(STEP_TOGGLE_HEADER)
        print("-" * len(STEP_TOGGLE_HEADER))
        print(*rows_step, sep="\n")
        return
    if args.nvml:
        rows_nvml = nvml_table(args.rounds, args.gpus)
        print(f"\nNVML poller, {args.rounds} rotated rounds of 1 s (medians)")
        print(NVML_HEADER)
        print("-" * len(NVML_HEADER))
        print(*rows_nvml, sep="\n")
        return

    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model

    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    engines = {
        "without": LLM(model=str(model), **ENGINE_ARGS),
        "with": LLM(
            model=str(model),
            scheduler_cls="vllm_runbook.collector.scheduler.RunbookScheduler",
            **ENGINE_ARGS,
        ),
    }
    for llm in engines.values():  # warm-up
        run_workload(llm, 16, 0)

    rows = []
    for running in WORKLOADS:
        tps: dict[str, list[float]] = {"without": [], "with": []}
        costs: list[HookCost] = []
        floors: list[float] = []
        for r in range(args.rounds):
            order = ("without", "with") if r % 2 == 0 else ("with", "without")
            for name in order:
                tokens, elapsed = run_workload(engines[name], running, r + 1)
                tps[name].append(tokens / elapsed)
            for name in order:
                if name == "with":
                    costs.append(hook_costs(engines["with"], running, r))
                else:
                    floors.append(timer_floor(engines["without"], running, r))
        without, with_ = statistics.median(tps["without"]), statistics.median(tps["with"])
        cost = HookCost(
            *(
                statistics.median(getattr(c, field.name) for c in costs)
                for field in dataclasses.fields(HookCost)
            )
        )
        rows.append((running, without, with_, with_ / without, cost, statistics.median(floors)))

    print(f"\ncollector overhead, tiny CPU model, {args.rounds} alternated rounds (medians)")
    print(HEADER)
    print("-" * len(HEADER))
    for running, without, with_, ratio, c, f in rows:
        # The hook's time above the floor, over the hooked engine's step time.
        above = (c.per_step_us - f) * c.share / c.per_step_us
        print(
            f"{running:>8} | {without:>13.0f} | {with_:>10.0f} | {ratio:>6.3f} | "
            f"{c.per_step_us:>12.1f} | {c.decode_step_us:>14.1f} | {c.per_request_us:>10.1f} | "
            f"{100 * c.share:>12.2f}% | {f:>14.1f} | {100 * above:>10.2f}% "
            f"| {c.steps:>5.0f}"
        )
    if args.e2e_rounds:
        del engines
        rows_e2e = e2e_table(args.e2e_rounds)
        print(
            "\nend to end, three engines (EngineCore processes), "
            f"{args.e2e_rounds} rotated rounds (medians of per-round ratios)"
        )
        print(E2E_HEADER)
        print("-" * len(E2E_HEADER))
        print(*rows_e2e, sep="\n")
    if args.same_engine_rounds:
        rows_same = same_engine_table(args.same_engine_rounds)
        print(
            "\nend to end, one engine (its EngineCore process), the hook switched on and off "
            f"between batches, {args.same_engine_rounds} rounds in the batches' six orders "
            "(medians of per-round ratios)"
        )
        print(SAME_ENGINE_HEADER)
        print("-" * len(SAME_ENGINE_HEADER))
        print(*rows_same, sep="\n")


if __name__ == "__main__":
    main()
