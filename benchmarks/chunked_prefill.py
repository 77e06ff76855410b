"""Chunked prefill on vs off: the field reports' A/B, side by side on one machine.

The reports turn chunked prefill on for long prompts only after an A/B test on
a little traffic (step 3 of their five): it cut the P99 of their mixed load
(0.9 s → 0.8 s, 142 → 138 req/s), the prefill of 8k prompts (320 → 290 ms)
and 32k ones (2,100 → 1,250 ms), and cost short prompts about 5 % of their
throughput. In vLLM it is a restart-only setting (`--enable-chunked-prefill`,
on by default in V1; off, the budget must hold a whole prompt:
max_num_batched_tokens ≥ max_model_len), so the A/B is two engines. Here
both are in-process CPU engines (tiny random-weight Llama) in one process,
started once and served in alternating order, round after round, the same
open-loop schedule:

- mixed: a 50-300-token prompt every 0.25 s beside 8,192-9,000-token ones
  evenly spaced at 25 % of the measured prefill rate;
- short: the chat prompts alone (the reports' short-text throughput cost).

Per engine and workload it prints the short prompts' TTFT P50 / P99, the long
prompts' TTFT P99 and the generated tokens per second (first arrival to last
finish), pooled over the rounds, then each figure's B/A ratio per round
(median and range) and the load average around the run.

    .venv/bin/python benchmarks/chunked_prefill.py [--seconds 20] [--rounds 3] [--seed 3]
"""

from __future__ import annotations

import argparse
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

MAX_MODEL_LEN = 9216  # the 9,000-token prompts plus their output
COMMON = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=MAX_MODEL_LEN,
    hf_overrides={"max_position_embeddings": MAX_MODEL_LEN},  # the tiny model says 4096
    max_num_seqs=32,
    num_gpu_blocks_override=2048,  # 65,536 tokens: room for several long prompts
    enable_prefix_caching=False,  # every prompt is new anyway
    enforce_eager=True,
    seed=0,
    scheduler_cls="vllm_runbook.collector.scheduler.RunbookScheduler",
)
ENGINES = {
    # A: chunked prefill on at the reports' safe budget.
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=2048),
    # B: off; vLLM then needs a budget that holds the longest prompt.
    "whole": dict(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN),
}
SHORT_EVERY_S = 0.25
LONG_UTILIZATION = 0.25
OUTPUT_TOKENS = 16
HEADER = (
    " workload | prefill  | short TTFT p50 | short TTFT p99 | long TTFT p99 | gen tok/s | requests"
)


@dataclass(frozen=True)
class Arrival:
    at: float
    name: str
    long: bool
    prompt: int
    offset: int


def arrivals(seconds: float, seed: int, long_every_s: float | None) -> list[Arrival]:
    rng = random.Random(seed)
    out: list[Arrival] = []
    t, i = 0.0, 0
    while t < seconds:
        out.append(Arrival(t, f"s{i}", False, rng.randint(50, 300), rng.randrange(10**6)))
        t += SHORT_EVERY_S
        i += 1
    if long_every_s is not None:
        # Evenly spaced from half a gap in: every run has the same number of them.
        t, i = long_every_s / 2, 0
        while t < seconds:
            out.append(Arrival(t, f"l{i}", True, rng.randint(8192, 9000), rng.randrange(10**6)))
            t += long_every_s
            i += 1
    return sorted(out, key=lambda a: a.at)


@dataclass
class Pooled:
    short: list[float] = field(default_factory=list)  # TTFTs, seconds
    long: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, -(-int(q * 1000) * len(ordered) // 1000))
    return ordered[rank - 1]


def serve(llm: Any, tag: str, schedule: list[Arrival]) -> Pooled:
    """The schedule on one engine: (TTFT short, TTFT long, tokens, seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    prompts = {
        a.name: TokensPrompt(prompt_token_ids=prompt_token_ids(a.prompt, a.offset))
        for a in schedule
    }
    kind = {a.name: a.long for a in schedule}
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    out = Pooled()
    end = 0.0
    pending = list(schedule)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            engine.add_request(f"{tag}:{a.name}", prompts[a.name], params)
            arrived[a.name] = time.perf_counter() - start
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        after = time.perf_counter() - start
        for o in outputs:
            name = o.request_id.split(":", 1)[1]
            if name not in first and o.outputs and o.outputs[0].token_ids:
                first[name] = after
                (out.long if kind[name] else out.short).append(after - arrived[name])
            if o.finished:
                out.tokens += len(o.outputs[0].token_ids)
                end = after
    assert len(first) == len(schedule), "a request never produced a token"
    out.seconds = end - min(arrived.values())
    return out


def prefill_rate(llm: Any) -> float:
    """Prompt tokens per second of 8,192-token prefills on this engine now."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    prompts = [
        TokensPrompt(prompt_token_ids=prompt_token_ids(8192, 7919 * (i + 1))) for i in range(3)
    ]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return 3 * 8192 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM
    from vllm_runbook.collector.tiny_model import create_tiny_model

    load_start = os.getloadavg()
    workloads = ("mixed", "short")
    pooled = {(w, e): Pooled() for w in workloads for e in ENGINES}
    ratios: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny-llama")
        llms = {name: LLM(model=str(model), **COMMON, **extra) for name, extra in ENGINES.items()}
        for llm in llms.values():  # warm-up, not measured
            serve(llm, "warm", arrivals(2.0, args.seed - 1, 1.0))
        rate = prefill_rate(llms["whole"])
        long_every_s = 8600 / (LONG_UTILIZATION * rate)  # 8,600: the mean long prompt
        for r in range(args.rounds):
            for w in workloads:
                schedule = arrivals(
                    args.seconds, args.seed + r, long_every_s if w == "mixed" else None
                )
                order = list(ENGINES) if r % 2 == 0 else list(ENGINES)[::-1]
                runs = {e: serve(llms[e], f"{w}{r}", schedule) for e in order}
                for e, run in runs.items():
                    p = pooled[(w, e)]
                    p.short += run.short
                    p.long += run.long
                    p.tokens += run.tokens
                    p.seconds += run.seconds
                a, b = runs["chunked"], runs["whole"]
                figures = {
                    "short TTFT p99": percentile(a.short, 0.99) / percentile(b.short, 0.99),
                    "gen tok/s": (a.tokens / a.seconds) / (b.tokens / b.seconds),
                }
                if a.long and b.long:
                    figures["long TTFT p99"] = percentile(a.long, 0.99) / percentile(b.long, 0.99)
                for k, v in figures.items():
                    ratios.setdefault((w, k), []).append(v)
    load = os.getloadavg()
    print(
        f"chunked prefill on (budget 2048) vs off (budget {MAX_MODEL_LEN}), tiny CPU model, "
        f"{args.rounds} rounds of {args.seconds:g} s of arrivals: a 50-300-token prompt every "
        f"{SHORT_EVERY_S:g} s, in 'mixed' also an 8,192-9,000-token one every "
        f"{long_every_s:.2f} s ({LONG_UTILIZATION:.0%} of the measured prefill rate, "
        f"{rate:,.0f} tok/s); {OUTPUT_TOKENS} tokens out"
    )
    print(HEADER)
    print("-" * len(HEADER))
    for (w, e), p in pooled.items():
        long = f"{percentile(p.long, 0.99):11.3f} s" if p.long else f"{'-':>13}"
        print(
            f" {w:<8} | {e:<8} | {percentile(p.short, 0.5):12.3f} s | "
            f"{percentile(p.short, 0.99):12.3f} s | {long} | {p.tokens / p.seconds:9.1f} | "
            f"{len(p.short)} short + {len(p.long)} long"
        )
    for (w, k), values in ratios.items():
        print(
            f"{w}: {k} chunked/whole median {statistics.median(values):.2f} "
            f"(rounds {min(values):.2f}-{max(values):.2f})"
        )
    print(
        f"load average {load_start[0]:.1f} at the start, {load[0]:.1f} at the end; "
        f"{os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
