"""Collector overhead: the same workload with and without the hook.

Two in-process engines with identical settings live in one process: one
with vLLM's plain Scheduler, one with `vllm_runbook.collector.scheduler.RunbookScheduler`
(the plugin is kept out with VLLM_PLUGINS=, so the only difference is the
hook). Rounds alternate between them, so drift on a shared machine hits both.

Prints output tokens/s of both and their ratio, then what the whole hook costs
per step at 16 and at 256 running requests: every wrapper (the scheduler lock,
schedule/update_from_output/add_request/finish_requests with their callbacks,
the prefix-cache wrapper), measured as time in the mixin's methods minus time
in vLLM's methods they call, per step and as a share of the engine step.

    .venv/bin/python benchmarks/collector_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")

# The table's header row, as docs/benchmarks.md shows it (a test compares them).
HEADER = " running | tok/s without | tok/s with |  ratio | hook µs/step | share of step | steps"

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
WORKLOADS = {16: (16, 48, 192), 256: (256, 48, 64)}  # running: (requests, prompt, output)


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


HOOKED_METHODS = ("schedule", "update_from_output", "add_request", "finish_requests")


def hook_costs(llm, running: int) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """What the whole hook costs the "with" engine on one workload: every
    wrapper (the scheduler lock, schedule/update_from_output/add_request/
    finish_requests and their on_* callbacks, the prefix-cache wrapper) as the
    time spent in the mixin's methods minus the time in vLLM's own methods
    they call. Returns (µs per step, share of the engine step's wall time,
    steps)."""
    from vllm_runbook.collector.hook import RunbookSchedulerMixin

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    collector = scheduler.runbook_collector
    base = RunbookSchedulerMixin
    vllm_cls = next(c for c in type(scheduler).__mro__ if c.__module__.startswith("vllm.v1"))
    spent = {"outer": 0.0, "inner": 0.0, "prefix": 0.0, "step": 0.0}
    steps = [0]
    saved = {}

    def timed(fn, key: str):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

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
        steps[0] += 1
        t = time.perf_counter()
        try:
            return original_step()
        finally:
            spent["step"] += time.perf_counter() - t

    engine.step = step
    try:
        run_workload(llm, running, 10_000)
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
        del collector.stats.on_prefix_lookup, engine.step
    hook = spent["outer"] - spent["inner"] + spent["prefix"]
    return hook / steps[0] * 1e6, hook / spent["step"], steps[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

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
        for r in range(args.rounds):
            order = ("without", "with") if r % 2 == 0 else ("with", "without")
            for name in order:
                tokens, elapsed = run_workload(engines[name], running, r + 1)
                tps[name].append(tokens / elapsed)
        per_step, share, steps = hook_costs(engines["with"], running)
        without, with_ = statistics.median(tps["without"]), statistics.median(tps["with"])
        rows.append((running, without, with_, with_ / without, per_step, share, steps))

    print(f"\ncollector overhead, tiny CPU model, {args.rounds} alternated rounds (medians)")
    print(HEADER)
    print("-" * len(HEADER))
    for running, without, with_, ratio, cost, share, n in rows:
        print(
            f"{running:>8} | {without:>13.0f} | {with_:>10.0f} | {ratio:>6.3f} | "
            f"{cost:>12.1f} | {100 * share:>12.2f}% | {n:>5}"
        )


if __name__ == "__main__":
    main()
