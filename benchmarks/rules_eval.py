"""Cost of one rules cycle for 1, 100 and 1,000 simulated engines.

Each engine exposes every series the catalog reads (2 GPUs, 5 finish
reasons, vLLM's 22 latency buckets), with one hour of history at a 15 s
scrape interval already in the window store (filled directly, which takes
seconds instead of minutes). A cycle is then: append one scrape's samples
for every engine (ingest), evaluate the 17 rules for every engine
(evaluate). Prints the median of 5 cycles and the process' memory growth.

    python benchmarks/rules_eval.py [ENGINES ...]
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from array import array

from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.rules.window import WindowStore

# The table's header row, as docs/benchmarks.md shows it (a test compares them).
HEADER = " engines  rules   series    samples  ingest ms  evaluate ms  total ms  memory MB"
SCRAPE = 15.0
HISTORY = 3600.0
LATENCY_BUCKETS = (
    "0.3",
    "0.5",
    "0.8",
    "1.0",
    "1.5",
    "2.0",
    "2.5",
    "5.0",
    "10.0",
    "15.0",
    "20.0",
    "30.0",
    "40.0",
    "50.0",
    "60.0",
    "120.0",
    "240.0",
    "480.0",
    "960.0",
    "1920.0",
    "7680.0",
    "+Inf",
)
REASONS = ("stop", "length", "abort", "error", "repetition")


def engine_series(store: WindowStore) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, extra labels, per-scrape increment or gauge value) the rules read."""
    out: list[tuple[str, dict[str, str], float]] = []
    for name in store.retention:
        counter = name in store.counters
        if name.endswith("_bucket"):
            out += [(name, {"le": le}, 10.0 * (i + 1)) for i, le in enumerate(LATENCY_BUCKETS)]
        elif name == SIGNALS["requests_finished"].metric:
            out += [(name, {"finished_reason": r}, 10.0) for r in REASONS]
        elif "gpu" in name:
            out += [(name, {"gpu": str(g)}, 0.5) for g in range(2)]
        else:
            out.append((name, {}, 100.0 if counter else 0.5))
    return out


def fill(store: WindowStore, engines: int, now: float) -> int:
    """One hour of samples for every engine; returns the number of series."""
    per_engine = engine_series(store)
    steps = int(HISTORY / SCRAPE)
    count = 0
    for e in range(engines):
        labels = {"model_name": "llama", "engine": "0"}
        for name, extra, value in per_engine:
            keep = store.retention[name]
            n = min(steps, int(keep / SCRAPE) + 1)
            t0 = now - (n - 1) * SCRAPE
            series = store.add(f"engine-{e}", name, {**labels, **extra}, t0, 0.0)
            assert series is not None
            series.ts.extend(array("d", (t0 + i * SCRAPE for i in range(1, n))))
            if series.adjusted is not None:
                vals = array("d", (i * value for i in range(1, n)))
                series.values.extend(vals)
                series.adjusted.extend(vals)
            else:
                series.values.extend(array("d", [value] * (n - 1)))
            count += 1
    return count


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench(engines: int, cycles: int = 5) -> dict[str, float]:
    rules = load_catalog().bind()
    gc.collect()
    before = rss_mb()
    store = store_for_rules(rules)
    now = 1_700_000_000.0
    series = fill(store, engines, now)
    evaluator = Evaluator(rules, store, MemoryIncidentSink())
    per_engine = engine_series(store)
    ingest, evaluate = [], []
    for c in range(1, cycles + 1):
        t = now + c * SCRAPE
        start = time.perf_counter()
        for e in range(engines):
            instance = f"engine-{e}"
            for name, extra, value in per_engine:
                v = value * (HISTORY / SCRAPE + c) if name in store.counters else value
                store.add(instance, name, {"model_name": "llama", "engine": "0", **extra}, t, v)
        ingest.append(time.perf_counter() - start)
        start = time.perf_counter()
        evaluator.evaluate(t)
        evaluate.append(time.perf_counter() - start)
    samples = sum(len(s) for eng in store for lst in eng.by_name.values() for s in lst)
    return {
        "engines": engines,
        "rules": len(rules),
        "series": series,
        "samples": samples,
        "ingest_ms": statistics.median(ingest) * 1000,
        "evaluate_ms": statistics.median(evaluate) * 1000,
        "rss_mb": rss_mb() - before,
    }


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [1, 100, 1000]
    print(
        f"rules cycle, {int(HISTORY / 60)} min of history at {SCRAPE:g} s scrapes, "
        "median of 5 cycles"
    )
    print(HEADER)
    for n in sizes:
        r = bench(n)
        total = r["ingest_ms"] + r["evaluate_ms"]
        print(
            f"{r['engines']:>8} {r['rules']:>6} {r['series']:>8} {r['samples']:>10} "
            f"{r['ingest_ms']:>10.1f} {r['evaluate_ms']:>12.1f} {total:>9.1f} {r['rss_mb']:>10.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
