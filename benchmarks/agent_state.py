"""What one `/v1/state` answer costs the engine process: building and serializing it.

The agent builds the state in its HTTP thread, never in the scheduler's step,
but it runs in the engine's process (and holds the scheduler lock while it
reads the queues), so its cost is worth knowing. One in-process engine with the
hook (the plugin kept out with VLLM_PLUGINS=) is brought to N running and M
waiting requests, then stopped between two steps; the `/v1/state` route's
handler is called directly (build + JSON serialization, no socket), with and
without `?since_step` (a change's measurement), and once over loopback HTTP.

    .venv/bin/python benchmarks/agent_state.py [--calls 200]
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
HEADER = " running | waiting | answer | build+serialize µs (p50) |  p90 | HTTP GET µs (p50) | bytes"

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
LOADS = ((0, 0), (16, 0), (256, 64))  # (running, waiting)


def load(llm, running: int, waiting: int) -> None:  # type: ignore[no-untyped-def]
    """Bring the engine to `running` requests decoding and `waiting` queued
    (adding to what it holds: the loads only grow; none finishes meanwhile)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=512, ignore_eos=True, temperature=0.0)
    held = len(scheduler.requests)
    for i in range(held, running + waiting):
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids(48, 13 * i))
        engine.add_request(f"r{i}", prompt, params)
    scheduler.max_num_active_reqs = max(1, running)  # the rest wait
    for _ in range(100):
        if len(scheduler.running) >= running:
            break
        engine.step()
    assert (len(scheduler.running), len(scheduler.waiting)) == (running, waiting)


def timed_calls(fn, calls: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import httpx
    from vllm import LLM
    from vllm_runbook.collector.server import Request
    from vllm_runbook.collector.tiny_model import create_tiny_model

    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    llm = LLM(
        model=str(model),
        scheduler_cls="vllm_runbook.collector.scheduler.RunbookScheduler",
        **ENGINE_ARGS,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    collector = scheduler.runbook_collector
    server = collector.server
    handler = server.routes[("GET", "/v1/state")]

    rows = []
    for running, waiting in LOADS:
        if running or waiting:
            load(llm, running, waiting)
        step = collector.stats.steps
        collector.changes.on_change_applied(step + 1)  # a mark to measure `since` from
        for name, query in (("state", {}), ("since", {"since_step": [str(step + 1)]})):
            request = Request("GET", "/v1/state", query, {}, b"")
            answer = handler(request)
            assert answer.status == 200, answer.body
            times = timed_calls(lambda r=request: handler(r), args.calls)
            url = server.url + "/v1/state" + (f"?since_step={step + 1}" if query else "")
            with httpx.Client() as client:
                http = timed_calls(lambda c=client, u=url: c.get(u), max(20, args.calls // 4))
            deciles = statistics.quantiles(times, n=10)
            rows.append(
                (
                    running,
                    waiting,
                    name,
                    statistics.median(times),
                    deciles[-1],
                    statistics.median(http),
                    len(answer.body),
                )
            )

    print(f"\n/v1/state cost, tiny CPU model, {args.calls} calls each (handler called directly)")
    print(HEADER)
    print("-" * len(HEADER))
    for running, waiting, name, p50, p90, http, size in rows:
        print(
            f"{running:>8} | {waiting:>7} | {name:>6} | {p50:>24.0f} | {p90:>4.0f} | "
            f"{http:>17.0f} | {size:>5}"
        )


if __name__ == "__main__":
    main()
