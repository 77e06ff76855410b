"""Collector overhead: the same workload with and without the hook.

Two in-process engines with identical settings live in one process: one
with vLLM's plain Scheduler, one with `vllm_runbook.collector.scheduler.RunbookScheduler`
(the plugin is kept out with VLLM_PLUGINS=, so the only difference is the
hook). Rounds alternate between them, so drift on a shared machine hits both.

Prints output tokens/s of both and their ratio, then the median per-step hook
cost (on_schedule + on_update) at 16 and at 256 running requests.

    .venv/bin/python benchmarks/collector_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The table's header row, as docs/benchmarks.md shows it (a test compares them).
HEADER = " running | tok/s without | tok/s with |  ratio | hook µs/step | steps"

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


def hook_costs(llm, running: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Per-step µs spent in the hook, for steps with `running` requests."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    collector = scheduler._runbook
    on_schedule, on_update = collector.on_schedule, collector.on_update
    per_step: dict[int, float] = {}
    step = [0]

    def timed_schedule(sched, output, elapsed, free_before):  # type: ignore[no-untyped-def]
        step[0] += 1
        t = time.perf_counter()
        on_schedule(sched, output, elapsed, free_before)
        if len(sched.running) == running:
            per_step[step[0]] = time.perf_counter() - t

    def timed_update(sched, so, mro):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        on_update(sched, so, mro)
        if step[0] in per_step:
            per_step[step[0]] += time.perf_counter() - t

    collector.on_schedule, collector.on_update = timed_schedule, timed_update
    try:
        run_workload(llm, running, 10_000)
    finally:
        del collector.on_schedule, collector.on_update
    return [v * 1e6 for v in per_step.values()]


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
        costs = hook_costs(engines["with"], running)
        without, with_ = statistics.median(tps["without"]), statistics.median(tps["with"])
        rows.append(
            (running, without, with_, with_ / without, statistics.median(costs), len(costs))
        )

    print(f"\ncollector overhead, tiny CPU model, {args.rounds} alternated rounds (medians)")
    print(HEADER)
    print("-" * 70)
    for running, without, with_, ratio, cost, n in rows:
        print(
            f"{running:>8} | {without:>13.0f} | {with_:>10.0f} | {ratio:>6.3f} | "
            f"{cost:>12.1f} | {n:>5}"
        )


if __name__ == "__main__":
    main()
