"""`runbook tune` against an exhaustive static sweep of the live knobs, in one run.

One in-process CPU engine (the tiny random-weight model; 256 KV blocks of
32) started at generous settings (max_num_seqs 64, budget 1024) serves a
closed loop of clients: each finished request is replaced at once. Two
workloads whose best settings differ:

- long: prompts 300-600 tokens, 150 out (a few fit the KV cache);
- short: chat-like prompts 20-80 tokens, 32 out (many fit).

For each workload, on the same engine and traffic:
1. the sweep: every (max_num_seqs, budget) of the grid held for `--window`
   seconds, measured like tune measures a point (`AgentEngine.measure`: from
   the step the setting took effect at) and judged like tune judges one
   (`judge_point`: the SLA and an OOM rate under 0.1 %). The best static
   setting is the fastest that meets both;
2. interleaved rounds: the best static setting held `--eval-seconds` (A),
   then `runbook tune`'s walk (the same `Tuner` the CLI runs, from the
   startup values, `--window` seconds per point), then the setting it kept
   held `--eval-seconds`, then the best static setting again (A'). A and A'
   are the same setting: their spread is the noise (A/A).

Printed: the sweep, then per workload the medians over the rounds: the
static best's and tune's kept setting's throughput (scheduled tokens/s),
their ratio (the goal: >= 95 %), whether tune's setting met both limits, how
long tune ran (the goal: within 10 minutes) and the share of it with the
SLA broken (the goal: at most 10 %), and the A/A spread.

Seconds are wall seconds (tune's windows are): on a machine shared with
other work the neighbours are measured too; the A/A spread says how much.

    .venv/bin/python benchmarks/tune.py [--window 10] [--eval-seconds 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")
# One OpenMP thread (see benchmarks/autopilot.py: a second one spin-waits
# against the neighbours on 2 shared cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

SWEEP_HEADER = " workload | max_num_seqs | budget |  tok/s | e2e P99 s | OOM %  | meets"
ROUNDS_HEADER = (
    " workload | static best  | rounds | static tok/s | tune kept    | tune tok/s | ratio "
    "| kept meets | tune s | SLA broken | A/A spread"
)
ENGINE_ARGS = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
    num_gpu_blocks_override=256,
    enable_prefix_caching=True,
    enforce_eager=True,
    seed=0,
)
WORKLOADS = {"long": ((300, 600), 150), "short": ((20, 80), 32)}
CLIENTS = 64
SEQS = (64, 32, 16, 12, 10, 8)
BUDGETS = (1024, 512, 256)


class Traffic:
    """The closed loop, run by the engine's thread (the in-process EngineCore)."""

    def __init__(self, llm: Any, workload: str) -> None:
        self.engine = llm.llm_engine
        self.collector = self.engine.engine_core.engine_core.scheduler.runbook_collector
        self.shape = WORKLOADS[workload]
        self.ids = itertools.count()
        self.rng = random.Random(1)
        self.stop = threading.Event()

    def _add(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm_runbook.collector.tiny_model import prompt_token_ids

        (low, high), output = self.shape
        i = next(self.ids)
        prompt = prompt_token_ids(self.rng.randint(low, high), 7919 * i)
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
        self.engine.add_request(f"bench-{i}", TokensPrompt(prompt_token_ids=prompt), params)

    def run(self) -> None:
        for _ in range(CLIENTS):
            self._add()
        while not self.stop.is_set():
            for out in self.engine.step():
                if out.finished:
                    self._add()


class Experiment:
    """Holds settings and runs tune through the engine's agent, over HTTP."""

    def __init__(self, agent_url: str, limits: Any, window: float) -> None:
        from vllm_runbook.runbooks.engine.client import EngineClient
        from vllm_runbook.runbooks.operate.tune import AgentEngine

        self.client = EngineClient(agent_url)
        self.agent = AgentEngine(self.client, poll_seconds=0.25)
        self.limits = limits
        self.window = window

    def hold(self, knobs: dict[str, int], seconds: float) -> Any:
        """`knobs` held `seconds`, measured from the step they took effect at."""
        now = self.client.state().knobs
        change = {k: v for k, v in knobs.items() if getattr(now, k) != v}
        if not change:
            # No change, no step mark: step aside and back, so that the
            # window starts at a mark like every other point's.
            self.client.set_knobs(max_num_seqs=knobs["max_num_seqs"] - 1)
            change = {"max_num_seqs": knobs["max_num_seqs"]}
        step = self.client.set_knobs(**change).effective_from_step
        return self.agent.measure(step, seconds)

    def tune(self, max_points: int) -> dict[str, Any]:
        from vllm_runbook.runbooks.operate.tune import Tuner

        self.client.restore()
        tuner = Tuner(self.agent, self.limits, window_seconds=self.window, max_points=max_points)
        return tuner.run()


def sweep(x: Experiment, workload: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm_runbook.runbooks.operate.tune import judge_point

    rows = []
    for seqs in SEQS:
        for budget in BUDGETS:
            if budget < seqs:  # the agent's floor: every admitted sequence decodes each step
                continue
            w = x.hold({"max_num_seqs": seqs, "max_num_batched_tokens": budget}, args.window)
            failures, _ = judge_point(w, x.limits)
            rows.append(
                {
                    "workload": workload,
                    "max_num_seqs": seqs,
                    "max_num_batched_tokens": budget,
                    "tok_s": w.throughput or 0.0,
                    "p99": w.e2e_p99,
                    "oom": w.oom_rate,
                    "meets": not failures,
                }
            )
            print_sweep_row(rows[-1])
    return rows


def print_sweep_row(r: dict[str, Any]) -> None:
    p99 = "-" if r["p99"] is None else f"{r['p99']:.2f}"
    oom = "-" if r["oom"] is None else f"{100 * r['oom']:.2f}"
    print(
        f" {r['workload']:<8} | {r['max_num_seqs']:>12} | {r['max_num_batched_tokens']:>6} "
        f"| {r['tok_s']:>6.0f} | {p99:>9} | {oom:>6} | {'yes' if r['meets'] else 'no'}",
        flush=True,
    )


def spread(a: list[float], b: list[float]) -> float:
    """How far the medians of two runs of one setting differ, relative to their mean."""
    ma, mb = statistics.median(a), statistics.median(b)
    return abs(ma - mb) / ((ma + mb) / 2)


def rounds(
    x: Experiment, workload: str, best: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    from vllm_runbook.runbooks.operate.tune import judge_point

    knobs = {k: best[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    a: list[float] = []
    a2: list[float] = []
    tuned: list[float] = []
    kept_meets: list[bool] = []
    seconds: list[float] = []
    broken: list[float] = []
    kept_text: list[str] = []
    for n in range(args.rounds):
        a.append(x.hold(knobs, args.eval_seconds).throughput or 0.0)
        report = x.tune(args.max_points)
        kept = {k: report["kept"][k] for k in knobs}
        kept_text.append(f"{kept['max_num_seqs']}/{kept['max_num_batched_tokens']}")
        w = x.hold(kept, args.eval_seconds)
        tuned.append(w.throughput or 0.0)
        kept_meets.append(not judge_point(w, x.limits)[0])
        seconds.append(report["tune_seconds"])
        broken.append(report["sla_broken_share"])
        a2.append(x.hold(knobs, args.eval_seconds).throughput or 0.0)
        if args.show_tune:
            from vllm_runbook.runbooks.operate.tune import format_report

            print(format_report(report), flush=True)
        print(
            f"  {workload} round {n + 1}: static {a[-1]:.0f}, tune kept {kept_text[-1]} "
            f"{tuned[-1]:.0f} ({'meets' if kept_meets[-1] else 'FAILS'}), static again "
            f"{a2[-1]:.0f} tok/s; tune ran {seconds[-1]:.0f} s, SLA broken "
            f"{100 * broken[-1]:.0f} % (load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    static_median = statistics.median(a + a2)
    return {
        "workload": workload,
        "static": f"{knobs['max_num_seqs']}/{knobs['max_num_batched_tokens']}",
        "rounds": args.rounds,
        "static_median": static_median,
        "kept": ",".join(sorted(set(kept_text))),
        "tune_median": statistics.median(tuned),
        "ratio": statistics.median(tuned) / static_median if static_median else 0.0,
        "kept_meets": f"{sum(kept_meets)}/{len(kept_meets)}",
        "tune_seconds": statistics.median(seconds),
        "sla_broken": max(broken),
        "aa_spread": spread(a, a2),
    }


def print_rounds(results: list[dict[str, Any]]) -> None:
    print(ROUNDS_HEADER)
    for r in results:
        print(
            f" {r['workload']:<8} | {r['static']:<12} | {r['rounds']:>6} "
            f"| {r['static_median']:>12.0f} | {r['kept']:<12} | {r['tune_median']:>10.0f} "
            f"| {100 * r['ratio']:>4.0f} % | {r['kept_meets']:>10} | {r['tune_seconds']:>6.0f} "
            f"| {100 * r['sla_broken']:>8.0f} % | {100 * r['aa_spread']:>8.1f} %"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=10.0, help="seconds per point")
    parser.add_argument("--eval-seconds", type=float, default=20.0, help="seconds per A/tune/A'")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after a switch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-points", type=int, default=12, help="tune's --max-points")
    parser.add_argument("--workloads", default="long,short")
    parser.add_argument(
        "--show-tune", action="store_true", help="print each tune's report (every point)"
    )
    parser.add_argument(
        "--sla-p99",
        default="long=60,short=20",
        help="P99 end-to-end SLA seconds per workload (long=60,short=20)",
    )
    args = parser.parse_args()
    sla = {k: float(v) for k, _, v in (i.partition("=") for i in args.sla_p99.split(","))}

    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model
    from vllm_runbook.runbooks.operate.tune import TuneLimits

    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    llm = LLM(model=str(model), **ENGINE_ARGS)
    load = os.getloadavg()[0]
    results = []
    print(SWEEP_HEADER, flush=True)
    for workload in args.workloads.split(","):
        traffic = Traffic(llm, workload)
        url = str(traffic.collector.server.url)
        x = Experiment(url, TuneLimits(sla_e2e_p99=sla[workload]), args.window)
        found: dict[str, Any] = {}

        def experiment(
            x: Experiment = x,
            workload: str = workload,
            traffic: Traffic = traffic,
            found: dict[str, Any] = found,
        ) -> None:
            try:
                x.client.restore()
                time.sleep(args.warmup)
                rows = sweep(x, workload, args)
                meeting = [r for r in rows if r["meets"]]
                if not meeting:
                    print(f"{workload}: no static setting met the limits; no rounds")
                    return
                best = max(meeting, key=lambda r: r["tok_s"])
                found["result"] = rounds(x, workload, best, args)
            finally:
                traffic.stop.set()

        worker = threading.Thread(target=experiment)
        worker.start()
        traffic.run()  # the engine's thread steps until the experiment ends
        worker.join()
        engine = traffic.engine
        engine.abort_request([f"bench-{i}" for i in range(next(traffic.ids))])
        while engine.has_unfinished_requests():
            engine.step()
        if "result" in found:
            results.append(found["result"])
    print(
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {CLIENTS} closed-loop clients; "
        f"{args.window:g} s per point, {args.eval_seconds:g} s per A/tune/A' hold; "
        f"SLA P99 end-to-end {args.sla_p99} s; OOM rate < 0.1 %"
    )
    print_rounds(results)


if __name__ == "__main__":
    main()
