"""The autopilot against fixed settings, side by side in one run.

One in-process CPU engine (the tiny random-weight model; 256 KV blocks of
32, budget 512, max_num_seqs 32 at start) serves a closed loop of clients:
each finished request is replaced at once. Three workloads:

- long: prompts 300-600 tokens, 150 out (the issue's storm, output halved
  so that a run fits on 2 shared cores);
- short: chat-like prompts 20-80 tokens, 32 out;
- mix: short for the first half of the run, long for the second.

For each, the same engine runs, one after the other:
- static max_num_seqs (a sweep): the setting stays put;
- oom-pressure's fixed cap: at the first preemption the budget is halved;
  if preemptions go on for `--condition-seconds` (the runbook waits 30 s;
  scaled down here), max_num_seqs is capped at half the KV capacity at the
  current footprint, as the runbook's `set_max_num_seqs kv_capacity` does,
  and held there;
- the autopilot, switched on at the start (from max_num_seqs 32).

Printed per row: generated tokens/s and preemptions per 1,000 finished
requests over the measured part (after `--warmup` seconds; for `mix`, the
whole run: `--seconds` short, then `--seconds` long), P50/P99 end-to-end
latency of the requests finished in it, the max_num_seqs range over the
measured part, and for `mix` the seconds after the shift until the last
preemption with max_num_seqs within +-2 of its final value from then on
("settle"; "never" when preemptions go on to the end).

Seconds (run lengths, tokens/s, latencies, settling) are the CPU seconds
of the thread that runs the engine (the in-process EngineCore, one OpenMP
thread) unless `--wall-clock`: on a machine shared with other work, wall
time measures the neighbours. On an idle machine the two agree.

    .venv/bin/python benchmarks/autopilot.py [--seconds 12] [--warmup 8]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")
# One OpenMP thread: on 2 cores shared with other work, a second OpenMP
# thread spin-waits at every barrier against the neighbours, and the engine
# ran 30x slower (measured: 39 steps in 6 s instead of 1,367).
os.environ.setdefault("OMP_NUM_THREADS", "1")

HEADER = (
    " workload | setting            |  tok/s | preempt/1k req |  P50 s |  P99 s | seqs  | settle s"
)
ENGINE_ARGS = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=32,
    max_num_batched_tokens=512,
    num_gpu_blocks_override=256,
    enable_prefix_caching=True,
    enforce_eager=True,
    seed=0,
)
LONG = ((300, 600), 150)
SHORT = ((20, 80), 32)
CLIENTS = 48
SWEEP = {"long": (32, 16, 12, 10, 8, 6), "short": (32, 16), "mix": (32, 12, 10, 8)}


@dataclass
class Run:
    workload: str
    setting: str
    # (seconds since start, end-to-end seconds, generated tokens) per finished request.
    finished: list[tuple[float, float, int]] = field(default_factory=list)
    # (seconds since start, tokens generated) per request output of each step.
    tokens: list[tuple[float, int]] = field(default_factory=list)
    # (seconds since start, max_num_seqs after the step, cumulative preemptions).
    trace: list[tuple[float, int, int]] = field(default_factory=list)


class Bench:
    def __init__(
        self, llm: Any, seconds: float, warmup: float, condition: float, wall_clock: bool
    ) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.collector = self.scheduler.runbook_collector
        self.seconds, self.warmup, self.condition = seconds, warmup, condition
        self.ids = itertools.count()
        self.clock = time.perf_counter if wall_clock else time.thread_time

    def _add(self, shape: tuple[tuple[int, int], int], rng: random.Random) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm_runbook.collector.tiny_model import prompt_token_ids

        (low, high), output = shape
        i = next(self.ids)
        request_id = f"bench-{i}"
        prompt = prompt_token_ids(rng.randint(low, high), 7919 * i)
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        return request_id

    def _command(self, **body: Any) -> None:
        from vllm_runbook.collector.control import parse_command

        control = self.collector.control
        # This thread is the engine's, between steps: apply at once.
        control.submit(parse_command(body, restore=not body), idle=lambda: True)

    def run(self, workload: str, setting: str) -> Run:
        rng = random.Random(1)  # every setting sees the same request sequence
        self._command()  # restore: startup values, the autopilot off
        if setting.startswith("static"):
            self._command(max_num_seqs=int(setting.split()[1]))
        elif setting == "autopilot":
            self._command(autopilot=True)
        result = Run(workload, setting)
        total = run_seconds(workload, self.seconds, self.warmup)
        shape = {"long": LONG, "short": SHORT, "mix": SHORT}[workload]
        started: dict[str, float] = {}
        generated: dict[str, int] = {}
        clock = self.clock
        start = clock()
        for _ in range(CLIENTS):
            started[self._add(shape, rng)] = 0.0
        oom_stage, oom_since, oom_count = 0, 0.0, 0
        collector = self.collector
        base = collector.stats.preemptions
        while (now := clock() - start) < total:
            if workload == "mix" and now >= total / 2:
                shape = LONG
            for out in self.engine.step():
                # Cumulative outputs: count this step's new tokens (a request
                # preempted and recomputed does not count its tokens twice).
                count = len(out.outputs[0].token_ids)
                new_tokens = max(0, count - generated.get(out.request_id, 0))
                generated[out.request_id] = count
                result.tokens.append((now, new_tokens))
                if out.finished:
                    t0 = started.pop(out.request_id)
                    generated.pop(out.request_id, None)
                    result.finished.append((now, now - t0, count))
                    started[self._add(shape, rng)] = now
            preempted = collector.stats.preemptions - base
            result.trace.append((now, int(self.scheduler.max_num_active_reqs), preempted))
            if setting == "oom-pressure cap":
                if oom_stage == 0 and preempted:
                    self._command(scale_max_num_batched_tokens=0.5, clamp=True)
                    oom_stage, oom_since, oom_count = 1, now, preempted
                elif oom_stage == 1 and now - oom_since >= self.condition:
                    if preempted > oom_count:
                        stats = collector.state().stats
                        from vllm_runbook.runbooks.engine.sources import kv_capacity_seqs

                        capacity = kv_capacity_seqs(stats) or 1
                        seqs = int(self.scheduler.max_num_active_reqs)
                        self._command(max_num_seqs=max(1, min(seqs, math.floor(capacity * 0.5))))
                    oom_stage = 2
        self.engine.abort_request(list(started))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return result


def run_seconds(workload: str, seconds: float, warmup: float) -> float:
    """Warm-up then the measured part; `mix` is short for `seconds`, then long
    for `seconds`, all measured."""
    return 2 * seconds if workload == "mix" else warmup + seconds


def summarize(run: Run, warmup: float, total: float) -> dict[str, Any]:
    measured_from = 0.0 if run.workload == "mix" else warmup
    done = [(t, e2e, n) for t, e2e, n in run.finished if t >= measured_from]
    trace = [(t, s, p) for t, s, p in run.trace if t >= measured_from]
    seconds = total - measured_from
    tokens = sum(n for t, n in run.tokens if t >= measured_from)
    preempted = trace[-1][2] - trace[0][2] if trace else 0
    latencies = sorted(e2e for _, e2e, _ in done)
    row: dict[str, Any] = {
        "tok_s": tokens / seconds,
        "preempt_per_1k": 1000.0 * preempted / max(1, len(done)),
        "p50": statistics.median(latencies) if latencies else math.nan,
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else math.nan,
        "seqs": (min(s for _, s, _ in trace), max(s for _, s, _ in trace)) if trace else (0, 0),
        "settle": None,
    }
    if run.workload == "mix":
        row["settle"] = settle_seconds(run.trace, total / 2)
    return row


def settle_seconds(trace: list[tuple[float, int, int]], shift: float) -> float | None:
    """Seconds after `shift` from which no preemption happens and max_num_seqs
    stays within ±2 of its final value; None if preemptions go on to the end."""
    final_seqs, final_preempted = trace[-1][1], trace[-1][2]
    settled_at = shift
    for t, seqs, preempted in trace:
        if t < shift:
            continue
        if preempted < final_preempted or abs(seqs - final_seqs) > 2:
            settled_at = t
    if settled_at >= trace[-1][0] - 1.0:
        return None
    return settled_at - shift


def best_static(rows: list[tuple[str, str, dict[str, Any]]], workload: str) -> int | None:
    """The sweep's fastest static max_num_seqs without a preemption."""
    free = [
        (row["tok_s"], int(setting.split()[1]))
        for w, setting, row in rows
        if w == workload and setting.startswith("static") and row["preempt_per_1k"] == 0
    ]
    return max(free)[1] if free else None


def spread(a: list[float], b: list[float]) -> float:
    """The A/A spread: how far the medians of two runs of one setting differ,
    relative to their mean (0.05 = 5 %)."""
    ma, mb = statistics.median(a), statistics.median(b)
    return abs(ma - mb) / ((ma + mb) / 2)


def rounds(
    bench: Bench,
    workload: str,
    static: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Interleaved rounds: static best (A), the autopilot, static best again (A'),
    until the A/A spread of the medians is below `args.target_spread` (at least
    `args.min_rounds`, at most `args.max_rounds`)."""
    total = run_seconds(workload, args.seconds, args.warmup)
    setting = f"static {static}"
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "autopilot": [], "A'": []}
    done = 0
    while done < args.max_rounds:
        for name in ("A", "autopilot", "A'"):
            run = bench.run(workload, "autopilot" if name == "autopilot" else setting)
            runs[name].append(summarize(run, args.warmup, total))
        done += 1
        a = [r["tok_s"] for r in runs["A"]]
        a2 = [r["tok_s"] for r in runs["A'"]]
        print(
            f"  {workload} round {done}: static {static} {a[-1]:.0f}, "
            f"autopilot {runs['autopilot'][-1]['tok_s']:.0f}, static {static} again {a2[-1]:.0f} "
            f"tok/s (load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
        if done >= args.min_rounds and spread(a, a2) < args.target_spread:
            break
    a = [r["tok_s"] for r in runs["A"]]
    a2 = [r["tok_s"] for r in runs["A'"]]
    pilot = [r["tok_s"] for r in runs["autopilot"]]
    static_median = statistics.median(a + a2)
    return {
        "workload": workload,
        "static": static,
        "rounds": done,
        "static_median": static_median,
        "autopilot_median": statistics.median(pilot),
        "ratio": statistics.median(pilot) / static_median,
        "aa_spread": spread(a, a2),
        "static_range": (min(a + a2), max(a + a2)),
        "autopilot_range": (min(pilot), max(pilot)),
        "autopilot_preempt_per_1k": statistics.median(
            r["preempt_per_1k"] for r in runs["autopilot"]
        ),
        "static_preempt_per_1k": max(r["preempt_per_1k"] for r in runs["A"] + runs["A'"]),
    }


def print_rounds(results: list[dict[str, Any]], target: float) -> None:
    print(
        " workload | static best | rounds | static tok/s (median, range) "
        "| autopilot tok/s (median, range) | ratio | A/A spread | autopilot preempt/1k req"
    )
    for r in results:
        (slo, shi), (plo, phi) = r["static_range"], r["autopilot_range"]
        print(
            f" {r['workload']:<8} | static {r['static']:<4} | {r['rounds']:>6} "
            f"| {r['static_median']:>6.0f} ({slo:.0f}-{shi:.0f}) "
            f"| {r['autopilot_median']:>6.0f} ({plo:.0f}-{phi:.0f}) "
            f"| {100 * r['ratio']:>4.0f} % | {100 * r['aa_spread']:>8.1f} % "
            f"| {r['autopilot_preempt_per_1k']:.1f}"
        )
    for r in results:
        ok = "below" if r["aa_spread"] < target else "NOT below"
        print(
            f"autopilot on {r['workload']}: {100 * r['ratio']:.0f} % of the best "
            f"preemption-free static setting (static {r['static']}, median of "
            f"{2 * r['rounds']} runs: {r['static_median']:.0f} tok/s); A/A spread "
            f"{100 * r['aa_spread']:.1f} % ({ok} the {100 * target:.0f} % it needs)"
        )


def parse_static(text: str) -> dict[str, int]:
    """'long=10,mix=12' -> {'long': 10, 'mix': 12}."""
    out = {}
    for item in filter(None, text.split(",")):
        workload, _, value = item.partition("=")
        out[workload.strip()] = int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds first")
    parser.add_argument("--condition-seconds", type=float, default=3.0)
    parser.add_argument("--workloads", default="long,short,mix")
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="wall seconds instead of the engine thread's CPU time",
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the sweep table (no interleaved rounds)",
    )
    parser.add_argument(
        "--static",
        default="",
        help="best static max_num_seqs per workload (long=10,mix=12): skips the sweep",
    )
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=9)
    parser.add_argument("--target-spread", type=float, default=0.05)
    args = parser.parse_args()

    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model

    model = create_tiny_model(Path(tempfile.gettempdir()) / "vllm-runbook-bench-model")
    llm = LLM(model=str(model), **ENGINE_ARGS)
    bench = Bench(llm, args.seconds, args.warmup, args.condition_seconds, args.wall_clock)
    load = os.getloadavg()[0]
    rows: list[tuple[str, str, dict[str, Any]]] = []
    given = parse_static(args.static)
    for workload in args.workloads.split(","):
        if workload in given:
            continue
        settings = [f"static {n}" for n in SWEEP[workload]] + ["oom-pressure cap", "autopilot"]
        total = run_seconds(workload, args.seconds, args.warmup)
        for setting in settings:
            run = bench.run(workload, setting)
            rows.append((workload, setting, summarize(run, args.warmup, total)))
    clock = "wall" if args.wall_clock else "the engine thread's CPU"
    print(
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} after the sweep; {CLIENTS} closed-loop clients; "
        f"seconds are {clock} seconds"
    )
    if rows:
        print_sweep(rows)
    if args.sweep_only:
        return
    results = []
    for workload in args.workloads.split(","):
        static = given.get(workload) or best_static(rows, workload)
        if static is None:
            print(f"{workload}: no static setting ran without preemptions; no rounds")
            continue
        results.append(rounds(bench, workload, static, args))
    print(
        f"interleaved rounds (static best, autopilot, static best again), {CLIENTS} "
        f"closed-loop clients, {clock} seconds; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    print_rounds(results, args.target_spread)


def print_sweep(rows: list[tuple[str, str, dict[str, Any]]]) -> None:
    print(HEADER)
    best: dict[str, float] = {}
    for workload, setting, row in rows:
        if setting.startswith("static") and row["preempt_per_1k"] == 0:
            best[workload] = max(best.get(workload, 0.0), row["tok_s"])
    for workload, setting, row in rows:
        settle = row["settle"]
        settle_text = "" if workload != "mix" else ("never" if settle is None else f"{settle:.1f}")
        low, high = row["seqs"]
        print(
            f" {workload:<8} | {setting:<18} | {row['tok_s']:>6.0f} "
            f"| {row['preempt_per_1k']:>14.1f} | {row['p50']:>6.2f} | {row['p99']:>6.2f} "
            f"| {low:>2}-{high:<2} | {settle_text}"
        )
    for workload, setting, row in rows:
        if setting == "autopilot" and workload in best:
            print(
                f"autopilot on {workload}: {100 * row['tok_s'] / best[workload]:.0f} % of the best "
                f"preemption-free static setting ({best[workload]:.0f} tok/s)"
            )


if __name__ == "__main__":
    main()
