"""fcfs, priority and tiered side by side on a mixed workload.

One in-process CPU engine (tiny random-weight Llama, the collector's
scheduler class) serves the same open-loop arrival schedule three times,
once per policy, switched live between the runs, in rounds of rotated order: short prompts (30-200
tokens, the hot tier) at a steady rate beside a stream of long ones
(1,500-3,000 tokens, cold), a length ratio of at least 7.5:1. No client
gives a priority, so `priority` orders by arrival like `fcfs`.

Per policy it prints the hot tier's TTFT (arrival in the engine to the first
output token) P50 / P99, the cold tier's TTFT P99, the longest wait of any
request for its first schedule (the collector's queue time), the aging bound
plus the longest step (what `tiered` promises as the longest wait), and the
generated tokens per second over the run (first arrival to last finish).

Each round also gives its own figures (hot TTFT P99 fcfs / tiered, tiered's
throughput against fcfs, the load average around it); the last lines print
their median and spread (lowest-highest round) beside the pooled figure, and
the load average at the start and the end: the queueing the offered load
produces still depends on what else runs on the machine, so a figure is
stated with the conditions it was measured in.

    .venv/bin/python benchmarks/tiered.py [--seconds 15] [--rounds 5] [--seed 7]

`--burst N` runs the field reports' burst test instead ("a sudden burst of
500 QPS": 83 % failures before, 12 % after), scaled down to the CPU engine:
N requests arrive at once (6 hot : 3 warm : 1 cold, in random order, 4 tokens
out each), each
client gives up (and aborts its request) when it has no first token within
its tier's timeout (hot and warm `--timeout`, cold none: the report's cold
path has no limit); a request given up on is a failure. Per round: fcfs
twice (an A/A control: how far two identical runs land apart) and tiered
(the plugin's defaults: shares 40/45/15, deadlines 0.1 s / 1 s / none), in
rotated order; the table gives each policy's median over the rounds and
its spread (lowest-highest round).

    .venv/bin/python benchmarks/tiered.py --burst 160 [--rounds 5] [--timeout 1.0]
"""

from __future__ import annotations

import argparse
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
os.environ["VLLM_PLUGINS"] = ""  # the explicit scheduler class below, nothing else
os.environ.setdefault("VLLM_RUNBOOK_PORT", "off")

# The table's header row, as docs/tiered.md shows it.
HEADER = (
    " policy   | hot TTFT p50 | hot TTFT p99 | cold TTFT p99 | max wait | aging+step "
    "| gen tok/s | requests"
)
POLICIES = ("fcfs", "priority", "tiered")

ENGINE_ARGS = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=4096,  # the 3,000-token prompts plus their output
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    num_gpu_blocks_override=2048,
    enable_prefix_caching=False,  # every prompt is new anyway; no cache effects between runs
    enforce_eager=True,
    seed=0,
    scheduler_cls="vllm_runbook.collector.scheduler.RunbookScheduler",
)
HOT_EVERY_S = 0.20  # a short request every 0.2 s
# The long ones arrive at random (exponential gaps: they come in bursts), at a
# mean rate that fills this share of the engine's prefill rate measured first:
# a queue forms in bursts and drains between them, so the machine's speed
# (shared cores) does not decide whether there is queueing at all.
COLD_UTILIZATION = 0.6
OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the run's start
    name: str
    tier: str
    prompt: int
    offset: int


def arrivals(seconds: float, seed: int, cold_every_s: float) -> list[Arrival]:
    rng = random.Random(seed)
    out: list[Arrival] = []
    t, i = 0.0, 0
    while t < seconds:
        out.append(Arrival(t, f"h{i}", "hot", rng.randint(30, 200), rng.randrange(10**6)))
        t += HOT_EVERY_S
        i += 1
    t, i = rng.expovariate(1 / cold_every_s), 0
    while t < seconds:
        out.append(Arrival(t, f"c{i}", "cold", rng.randint(1500, 3000), rng.randrange(10**6)))
        t += rng.expovariate(1 / cold_every_s)
        i += 1
    return sorted(out, key=lambda a: a.at)


@dataclass
class Run:
    policy: str
    arrived: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    longest_step: float = 0.0
    end: float = 0.0
    waits: list[float] = field(default_factory=list)


@dataclass
class Pooled:
    """One policy's runs over all rounds."""

    policy: str
    hot: list[float] = field(default_factory=list)  # TTFTs
    cold: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0  # first arrival to last finish, summed over the rounds
    longest_step: float = 0.0

    def add(self, run: Run, schedule: list[Arrival]) -> None:
        tier = {a.name: a.tier for a in schedule}
        for name, t in run.first_token.items():
            (self.hot if tier[name] == "hot" else self.cold).append(t - run.arrived[name])
        self.waits += run.waits
        self.tokens += run.tokens
        self.seconds += run.end - min(run.arrived.values())
        self.longest_step = max(self.longest_step, run.longest_step)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, -(-int(q * 1000) * len(ordered) // 1000))
    return ordered[rank - 1]


def run_policy(llm: Any, policy: str, schedule: list[Arrival]) -> Run:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.control import parse_command
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    collector = scheduler.runbook_collector
    collector.control.submit(parse_command({"policy": policy}), idle=lambda: True)
    assert collector.control.knobs()["policy"] == policy
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    prompts = {
        a.name: TokensPrompt(prompt_token_ids=prompt_token_ids(a.prompt, a.offset))
        for a in schedule
    }
    run = Run(policy)
    logged = len(collector.requests.log.entries)
    pending = list(schedule)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            engine.add_request(f"{policy}:{a.name}", prompts[a.name], params)
            run.arrived[a.name] = time.perf_counter() - start
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        after = time.perf_counter()
        run.longest_step = max(run.longest_step, after - before)
        for out in outputs:
            name = out.request_id.split(":", 1)[1]
            if name not in run.first_token and out.outputs and out.outputs[0].token_ids:
                run.first_token[name] = after - start
            if out.finished:
                run.tokens += len(out.outputs[0].token_ids)
                run.end = after - start
    entries = list(collector.requests.log.entries)[logged:]
    run.waits = [e.queue_seconds for e in entries]
    assert len(run.first_token) == len(schedule), "a request never produced a token"
    return run


def row(p: Pooled, aging_s: float) -> str:
    return (
        f" {p.policy:<8} | {percentile(p.hot, 0.5):10.3f} s | {percentile(p.hot, 0.99):10.3f} s "
        f"| {percentile(p.cold, 0.99):11.3f} s | {max(p.waits):6.2f} s "
        f"| {aging_s + p.longest_step:8.2f} s | {p.tokens / p.seconds:9.1f} "
        f"| {len(p.hot)} hot + {len(p.cold)} cold"
    )


def prefill_rate(llm: Any) -> float:
    """Prompt tokens per second of full-budget prefill steps on this engine now."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    budget = int(ENGINE_ARGS["max_num_batched_tokens"])  # type: ignore[call-overload]
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    prompts = [
        TokensPrompt(prompt_token_ids=prompt_token_ids(budget, 7919 * (i + 1))) for i in range(12)
    ]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return 12 * budget / (time.perf_counter() - start)


BURST_HEADER = (
    " policy   | failed          | hot failed      | hot TTFT p99 (served) | warm failed     "
    "| requests"
)
BURST_RUNS = ("fcfs", "fcfs A/A", "tiered")
# Short answers: in a burst the queue for prefill and for a sequence slot is
# what a client waits on, not its own decoding.
BURST_OUTPUT_TOKENS = 4


@dataclass
class BurstRun:
    """One burst: per request, its tier and the TTFT (None: given up on)."""

    tier: dict[str, str] = field(default_factory=dict)
    ttft: dict[str, float | None] = field(default_factory=dict)

    def failed(self, tier: str | None = None) -> float:
        names = [n for n, t in self.tier.items() if tier is None or t == tier]
        return sum(1 for n in names if self.ttft[n] is None) / len(names)

    def hot_p99(self) -> float:
        served = [v for n, v in self.ttft.items() if self.tier[n] == "hot" and v is not None]
        return percentile(served, 0.99) if served else float("nan")


def burst_schedule(size: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for i in range(size):
        kind = ("hot",) * 6 + ("warm",) * 3 + ("cold",)
        tier = kind[i % 10]
        low, high = {"hot": (30, 200), "warm": (300, 900), "cold": (1500, 3000)}[tier]
        out.append(
            Arrival(0.0, f"{tier[0]}{i}", tier, rng.randint(low, high), rng.randrange(10**6))
        )
    rng.shuffle(out)
    return out


def run_burst(llm: Any, policy: str, schedule: list[Arrival], timeout: float, tag: str) -> BurstRun:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.control import parse_command
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    engine = llm.llm_engine
    collector = engine.engine_core.engine_core.scheduler.runbook_collector
    collector.control.submit(parse_command({"policy": policy}), idle=lambda: True)
    params = SamplingParams(max_tokens=BURST_OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    run = BurstRun()
    limit = {"hot": timeout, "warm": timeout, "cold": math.inf}
    start = time.perf_counter()
    for a in schedule:  # all at once: the burst
        engine.add_request(
            f"{tag}:{a.name}",
            TokensPrompt(prompt_token_ids=prompt_token_ids(a.prompt, a.offset)),
            params,
        )
        run.tier[a.name] = a.tier
    pending = {a.name for a in schedule}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            name = out.request_id.split(":", 1)[1]
            if name in pending and out.outputs and out.outputs[0].token_ids:
                pending.discard(name)
                run.ttft[name] = now
        late = [n for n in pending if now > limit[run.tier[n]]]
        if late:  # the clients give up: vLLM aborts a request whose client went away
            engine.abort_request([f"{tag}:{n}" for n in late])
            for n in late:
                pending.discard(n)
                run.ttft[n] = None
    for n in pending:  # finished without a token (aborted by the engine at a deadline)
        run.ttft[n] = None
    return run


def burst_main(args: argparse.Namespace) -> None:
    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model

    load_start = os.getloadavg()
    runs: dict[str, list[BurstRun]] = {name: [] for name in BURST_RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny-llama")
        llm = LLM(model=str(model), **ENGINE_ARGS)
        run_burst(llm, "fcfs", burst_schedule(32, args.seed - 1), math.inf, "warm-up")
        for r in range(args.rounds):
            schedule = burst_schedule(args.burst, args.seed + r)
            order = BURST_RUNS[r % 3 :] + BURST_RUNS[: r % 3]
            for name in order:
                policy = "tiered" if name == "tiered" else "fcfs"
                runs[name].append(run_burst(llm, policy, schedule, args.timeout, f"{r}{name}"))
    load = os.getloadavg()

    def spread(values: list[float], fmt: str) -> str:
        med = statistics.median(values)
        return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    print(
        f"burst: {args.burst} requests at once (6 hot 30-200 : 3 warm 300-900 : 1 cold "
        f"1500-3000 prompt tokens, {BURST_OUTPUT_TOKENS} out), clients give up after "
        f"{args.timeout:g} s without a first token (cold: never); tiny CPU model, budget "
        f"{ENGINE_ARGS['max_num_batched_tokens']}, max_num_seqs {ENGINE_ARGS['max_num_seqs']}; "
        f"{args.rounds} rounds, median (lowest-highest round)"
    )
    print(BURST_HEADER)
    print("-" * len(BURST_HEADER))
    for name, rs in runs.items():
        print(
            f" {name:<8} | {spread([100 * r.failed() for r in rs], '4.1f')} "
            f"| {spread([100 * r.failed('hot') for r in rs], '4.1f')} "
            f"| {spread([r.hot_p99() for r in rs], '5.3f')} s "
            f"| {spread([100 * r.failed('warm') for r in rs], '4.1f')} "
            f"| {len(rs[0].tier)}"
        )
    aa = [
        abs(a.failed() - b.failed()) * 100
        for a, b in zip(runs["fcfs"], runs["fcfs A/A"], strict=True)
    ]
    gain = [
        (a.failed() - b.failed()) * 100 for a, b in zip(runs["fcfs"], runs["tiered"], strict=True)
    ]
    print(
        f"per round: failures tiered vs fcfs {statistics.median(gain):+.1f} points lower (median; "
        f"spread {min(gain):+.1f}-{max(gain):+.1f}); A/A fcfs vs fcfs differ by "
        f"{statistics.median(aa):.1f} points (median; at most {max(aa):.1f}); load average "
        f"(1 min) {load_start[0]:.1f} at the start, {load[0]:.1f} at the end, {os.cpu_count()} CPUs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="arrivals per run")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of the three policies, in rotated order"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--burst", type=int, default=0, help="the burst test with N requests")
    parser.add_argument(
        "--timeout", type=float, default=1.0, help="burst: seconds a hot/warm client waits"
    )
    args = parser.parse_args()
    if args.burst:
        burst_main(args)
        return

    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model

    load_start = os.getloadavg()
    per_round: list[tuple[float, float, float, float]] = []  # ratio, throughput, load before/after
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny-llama")
        llm = LLM(model=str(model), **ENGINE_ARGS)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        aging_s = scheduler.runbook_collector.control.tiers.aging_seconds
        run_policy(llm, "fcfs", arrivals(4.0, args.seed + 1, 1.0))  # warm-up, not measured
        rate = prefill_rate(llm)
        cold_every_s = 2250 / (COLD_UTILIZATION * rate)  # 2,250: the mean long prompt
        pooled = {p: Pooled(p) for p in POLICIES}
        for r in range(args.rounds):
            # One schedule per round, the same for the three policies; the order
            # rotates so that a machine getting faster or slower hits each alike.
            schedule = arrivals(args.seconds, args.seed + r, cold_every_s)
            before = os.getloadavg()[0]
            runs = {}
            for policy in POLICIES[r % 3 :] + POLICIES[: r % 3]:
                runs[policy] = run_policy(llm, policy, schedule)
                pooled[policy].add(runs[policy], schedule)
            one = {p: Pooled(p) for p in ("fcfs", "tiered")}
            for p in one:
                one[p].add(runs[p], schedule)
            per_round.append(
                (
                    percentile(one["fcfs"].hot, 0.99) / percentile(one["tiered"].hot, 0.99),
                    (one["tiered"].tokens / one["tiered"].seconds)
                    / (one["fcfs"].tokens / one["fcfs"].seconds),
                    before,
                    os.getloadavg()[0],
                )
            )
    load = os.getloadavg()
    print(
        f"tiered vs fcfs vs priority, tiny CPU model, {args.rounds} rounds of {args.seconds:g} s "
        f"of arrivals: a 30-200-token prompt every {HOT_EVERY_S:g} s, a 1500-3000-token one "
        f"every {cold_every_s:.3f} s on average ({COLD_UTILIZATION:.0%} of the measured prefill "
        f"rate, {rate:,.0f} tok/s), {OUTPUT_TOKENS} tokens out; budget "
        f"{ENGINE_ARGS['max_num_batched_tokens']}, max_num_seqs {ENGINE_ARGS['max_num_seqs']}"
    )
    print(HEADER)
    print("-" * len(HEADER))
    for p in pooled.values():
        print(row(p, aging_s))
    fcfs, tiered = pooled["fcfs"], pooled["tiered"]
    print(
        f"tiered vs fcfs: hot TTFT p99 "
        f"{percentile(fcfs.hot, 0.99) / percentile(tiered.hot, 0.99):.1f}x lower, throughput "
        f"{(tiered.tokens / tiered.seconds) / (fcfs.tokens / fcfs.seconds):.1%} of fcfs, "
        f"longest wait {max(tiered.waits):.2f} s (bound {aging_s + tiered.longest_step:.2f} s); "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )
    for r, (ratio, throughput, before, after) in enumerate(per_round, 1):
        print(
            f"round {r}: hot TTFT p99 {ratio:.1f}x lower, throughput {throughput:.1%} of fcfs; "
            f"load average {before:.1f} -> {after:.1f}"
        )
    ratios = [r[0] for r in per_round]
    throughputs = [r[1] for r in per_round]
    print(
        f"per round ({len(per_round)}): hot TTFT p99 median {statistics.median(ratios):.1f}x "
        f"lower (spread {min(ratios):.1f}-{max(ratios):.1f}x), throughput median "
        f"{statistics.median(throughputs):.1%} of fcfs (spread {min(throughputs):.1%}-"
        f"{max(throughputs):.1%}); load average (1 min) {load_start[0]:.1f} at the start, "
        f"{load[0]:.1f} at the end, {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
