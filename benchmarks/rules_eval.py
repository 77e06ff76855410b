"""Cost of one rules cycle as deployed, for 10, 100 and 1,000 engines.

Each engine has two targets, as `runbook serve` scrapes them: the collector
agent's /metrics (the collector's own exporter, `StatsExporter`, with
realistic values) and vLLM's /metrics (the installed vLLM's own
`PrometheusStatLogger` registry, every family with values). Every target is a
real HTTP/1.1 endpoint on loopback: one server process, one asyncio loop, one
listening port per target. 1 % of the targets are dead (they accept the
connection and never answer: a hung engine, the costly kind) and 1 % are slow
(they answer after `--slow` seconds).

The scraping process holds an hour of history (at the evaluation interval)
for every series the catalog reads, then runs cycles at the deployed
interval (the times are injected, so the backoff from dead targets follows
the deployed schedule while the cycles run back to back): scrape every due
target over HTTP, parse, ingest, evaluate the whole catalog. Columns (median
over the cycles): scrape = the scrape's wall time less the parse, parse =
parsing and storing the samples, evaluate = the catalog, total = the cycle;
worst = the slowest cycle (one that retries the dead targets waits for their
timeout); cpu = the scraping process' CPU seconds per cycle (median: on a
machine others load, the wall times grow, this does not); peak MB = the
scraping process' peak RSS.

Two scrapers side by side: `sequential` is the former one (one target after
another, every target every cycle, samples parsed by prometheus_client's
parser into metric families); `concurrent` is vllm_runbook.rules.scrape.

    python benchmarks/rules_eval.py [--engines 10 100 1000] [--cycles 9]
        [--timeout 2] [--slow 1] [--modes concurrent sequential]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from array import array
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HEADER = (
    "engines targets    scraper cycles  series scrape s parse s eval s total s worst s"
    "  cpu s failed skipped peak MB"
)

INTERVAL = 5.0  # the default rules.evaluation_interval
HISTORY = 3600.0
MODEL = "llama-3-8b"


# -- the expositions (built once, in the parent: it imports vLLM) -----------------------


def collector_bodies(engines: int) -> list[bytes]:
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm_runbook.collector import metrics as M
    from vllm_runbook.collector.exporter import Sample, StatsExporter

    rng = random.Random(1)
    out = []
    for _ in range(engines):
        samples: list[Sample] = []
        for spec in M.ALL_METRICS:
            if spec.type == "histogram":
                counts, total = [], 0.0
                for _b in (*spec.buckets, "+Inf"):
                    total += rng.randint(0, 5000)
                    counts.append(total)
                samples.append(Sample(spec, rng.uniform(10, 100), buckets=tuple(counts)))
            elif spec.extra_labels == ("gpu",):
                value = rng.uniform(0.2, 0.9) * (80e9 if "bytes" in spec.name else 1)
                samples += [Sample(spec, value, (str(g),)) for g in range(2)]
            elif spec.extra_labels == ("policy",):
                samples += [Sample(spec, float(p == "fcfs"), (p,)) for p in M.POLICIES]
            elif spec.type == "counter":
                samples.append(Sample(spec, float(rng.randint(10_000, 10_000_000))))
            else:
                samples.append(Sample(spec, rng.uniform(0.05, 0.95)))
        registry = CollectorRegistry()
        registry.register(StatsExporter(lambda s=samples: s, (MODEL, "0")))  # type: ignore[misc]
        out.append(generate_latest(registry))
    return out


def vllm_bodies(engines: int) -> list[bytes]:
    """vLLM's /metrics of one engine: the installed vLLM's PrometheusStatLogger registry
    (the Python/process collectors left out), every series given values per engine."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class Config:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

        def __getattr__(self, name: str) -> None:
            return None  # every optional feature off

    config = Config(
        observability_config=Config(show_hidden_metrics=False, kv_cache_metrics=False),
        model_config=Config(served_model_name=MODEL, max_model_len=8192, is_diffusion=False),
        cache_config=Config(num_gpu_blocks=4096),
        scheduler_config=Config(max_num_seqs=256, max_num_batched_tokens=8192),
        parallel_config=Config(data_parallel_size=1),
    )
    PrometheusStatLogger(config, [0])  # type: ignore[arg-type]
    registry = prometheus_client.REGISTRY
    for name in ("process", "platform", "python_gc"):
        collector = getattr(prometheus_client, f"{name.upper()}_COLLECTOR", None)
        if collector is not None:
            registry.unregister(collector)
    metrics = [c for c in list(registry._collector_to_names) if hasattr(c, "_metrics")]
    rng = random.Random(2)
    out = []
    for _ in range(engines):
        for metric in metrics:
            for child in metric._metrics.values():
                if isinstance(metric, Histogram):
                    for _ in range(20):
                        child.observe(rng.lognormvariate(0, 1.5))
                elif isinstance(metric, Counter):
                    child.inc(rng.randint(1, 10_000))
                elif isinstance(metric, Gauge):
                    child.set(rng.uniform(0, 100))
        out.append(prometheus_client.generate_latest(registry))
    return out


# -- the targets' server (one process, one loop, one port per target) ----------------------

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"


def serve_targets(folder: str, kinds: list[str], slow: float, conn: Connection) -> None:
    bodies = [Path(folder, f"{i}.prom").read_bytes() for i in range(len(kinds))]

    async def main() -> None:
        # At the end the hung handlers are cancelled: not worth a traceback each.
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        servers = []
        for body, kind in zip(bodies, kinds, strict=True):
            answer = RESPONSE + b"Content-Length: %d\r\n\r\n" % len(body) + body

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                answer: bytes = answer,
                kind: str = kind,
            ) -> None:
                try:
                    while True:
                        await reader.readuntil(b"\r\n\r\n")
                        if kind == "dead":
                            await asyncio.sleep(3600)
                        elif kind == "slow":
                            await asyncio.sleep(slow)
                        writer.write(answer)
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                    pass
                finally:
                    writer.close()

            servers.append(await asyncio.start_server(handle, "127.0.0.1", 0, backlog=512))
        conn.send([s.sockets[0].getsockname()[1] for s in servers])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop

    asyncio.run(main())


# -- one measurement (its own process: peak RSS is its own) --------------------------------


def old_scraper_class() -> type:
    """The former scraper's parse: wanted lines through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families
    from vllm_runbook.rules.scrape import Scraper

    class FamiliesScraper(Scraper):
        def ingest(self, target: Any, text: str, now: float, seen: Any) -> int:
            keep = []
            for line in text.splitlines():
                if not line or line[0] == "#":
                    continue
                end = len(line)
                for sep in ("{", " "):
                    i = line.find(sep)
                    if 0 <= i < end:
                        end = i
                if self.store.wants(line[:end]):
                    keep.append(line)
            count = 0
            for family in text_string_to_metric_families("\n".join(keep) + "\n"):
                for s in family.samples:
                    if self.store.add(target.instance, s.name, s.labels, now, s.value, seen):
                        count += 1
            return count

    return FamiliesScraper


def measure(
    folder: str, ports: list[int], mode: str, cycles: int, timeout: float, conn: Connection
) -> None:
    from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
    from vllm_runbook.rules.incidents import MemoryIncidentSink
    from vllm_runbook.rules.model import load_catalog
    from vllm_runbook.rules.scrape import NO_BACKOFF, Scraper, Target, _line_finder, parse_wanted

    logging.getLogger("vllm_runbook.rules.scrape").setLevel(logging.ERROR)  # the dead ones
    rules = load_catalog().bind()
    store = store_for_rules(rules)
    targets = [
        Target(f"http://127.0.0.1:{port}/metrics", f"engine-{i // 2}")
        for i, port in enumerate(ports)
    ]
    now = 1_700_000_000.0
    series = fill(store, folder, targets, now, _line_finder(store), parse_wanted)
    evaluator = Evaluator(rules, store, MemoryIncidentSink())
    evaluator.evaluate(now)
    if mode == "sequential":
        scraper = old_scraper_class()(
            store, targets, timeout=timeout, concurrency=1, backoff=NO_BACKOFF
        )
    else:
        scraper = Scraper(store, targets, timeout=timeout)
    rows = []
    with scraper:
        for c in range(1, cycles + 1):
            t = now + c * INTERVAL
            cycle_cpu = time.process_time()
            results = scraper.scrape_once(t)
            cycle = scraper.last_cycle
            assert cycle is not None
            start = time.perf_counter()
            evaluator.evaluate(t)
            evaluate = time.perf_counter() - start
            rows.append(
                {
                    "scrape": cycle.seconds - cycle.parse_seconds,
                    "parse": cycle.parse_seconds,
                    "evaluate": evaluate,
                    "total": cycle.seconds + evaluate,
                    "cpu": time.process_time() - cycle_cpu,
                    "ok": sum(r.ok for r in results),
                    "failed": cycle.failed,
                    "skipped": cycle.skipped,
                }
            )
    conn.send(
        {
            "rows": rows,
            "series": series,
            "rss_mb": peak_rss_mb(),
        }
    )


def peak_rss_mb() -> float:
    """VmHWM: this process' own peak (ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fill(store: Any, folder: str, targets: list[Any], now: float, lines: Any, parse: Any) -> int:
    """An hour of history (at the interval) of every series each target exposes."""
    count = 0
    steps = int(HISTORY / INTERVAL)
    for i, target in enumerate(targets):
        text = Path(folder, f"{i}.prom").read_text()
        for name, labels, value in parse(text, lines):
            n = min(steps, int(store.retention[name] / INTERVAL) + 1)
            t0 = now - (n - 1) * INTERVAL
            series = store.add(target.instance, name, labels, t0, 0.0)
            if series is None:
                continue
            series.ts.extend(array("d", (t0 + k * INTERVAL for k in range(1, n))))
            if series.adjusted is not None:
                values = array("d", (value * k / (n - 1) for k in range(1, n)))
                series.values.extend(values)
                series.adjusted.extend(values)
            else:
                series.values.extend(array("d", [value] * (n - 1)))
            count += 1
    return count


def run_child(target: Any, *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--cycles", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=2.0, help="per target (s)")
    parser.add_argument("--slow", type=float, default=1.0, help="slow targets answer after (s)")
    parser.add_argument("--modes", nargs="+", default=["concurrent", "sequential"])
    parser.add_argument(
        "--sequential-cycles", type=int, default=2, help="cycles of the sequential scraper"
    )
    args = parser.parse_args()
    most = max(args.engines)
    folder = tempfile.mkdtemp(prefix="rules-eval-")
    agent, vllm = collector_bodies(most), vllm_bodies(most)
    for e in range(most):
        Path(folder, f"{2 * e}.prom").write_bytes(agent[e])
        Path(folder, f"{2 * e + 1}.prom").write_bytes(vllm[e])
    print(
        f"rules cycle as deployed: {args.timeout:g} s timeout per target, 1 % of targets dead "
        f"(never answer), 1 % slow ({args.slow:g} s), interval {INTERVAL:g} s, "
        f"{int(HISTORY / 60)} min of history; agent /metrics {len(agent[0]) / 1024:.0f} KiB, "
        f"vLLM /metrics {len(vllm[0]) / 1024:.0f} KiB; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(HEADER)
    for engines in args.engines:
        n = 2 * engines
        bad = max(1, round(0.01 * n))
        kinds = ["ok"] * n
        for k in range(bad):
            dead = int((k + 0.5) * n / bad)
            kinds[dead], kinds[(dead + 1) % n] = "dead", "slow"
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        server = ctx.Process(target=serve_targets, args=(folder, kinds, args.slow, child))
        server.start()
        ports = parent.recv()
        try:
            for mode in args.modes:
                cycles = args.cycles if mode == "concurrent" else args.sequential_cycles
                r = run_child(measure, folder, ports, mode, cycles, args.timeout)
                rows = r["rows"]

                def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                    return statistics.median(row[key] for row in rows)

                print(
                    f"{engines:>7} {n:>7} {mode:>10} {len(rows):>6} {r['series']:>7} "
                    f"{med('scrape'):>8.2f} {med('parse'):>7.2f} {med('evaluate'):>6.2f} "
                    f"{med('total'):>7.2f} {max(row['total'] for row in rows):>7.2f} "
                    f"{med('cpu'):>6.2f} "
                    f"{sum(row['failed'] for row in rows):>6} "
                    f"{sum(row['skipped'] for row in rows):>7} {r['rss_mb']:>7.0f}",
                    flush=True,
                )
        finally:
            parent.send("stop")
            server.join(10)
            if server.is_alive():
                server.kill()


if __name__ == "__main__":
    main()
