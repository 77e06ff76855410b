"""`runbook backtest` at scale: a day of N engines at 15 s, out of a real Prometheus.

Synthetic series (every series the catalog and the runbooks' checks read, with
the labels the collector and vLLM give them; histograms with 6 buckets) for
`--engines` engines over `--hours` hours at `--interval` seconds, one engine in
ten with a 20-minute preemption storm, are written as OpenMetrics, backfilled
with `promtool tsdb create-blocks-from openmetrics` and served by a real
Prometheus on loopback. Then the backtest runs in this process as `runbook
backtest` does (the same functions: read in chunks over the HTTP API, replay,
decide), timed: wall, this process' CPU, Prometheus' CPU (`prom cpu`), peak
RSS; `storms found`: VllmOOMPressure findings / storms in the data. The data
preparation is reported apart, above the table.

    python benchmarks/backtest.py [--engines 100] [--hours 24] [--interval 15]
"""

from __future__ import annotations

import argparse
import math
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.runbooks.demo.servers import free_port, logged_process

HEADER = (
    "engines hours step s evaluations findings storms found decisions queries wall s cpu s "
    "prom cpu s peak MB"
)
BUCKETS = ("0.05", "0.1", "0.5", "1", "5", "+Inf")
PER_VALUE = {"gpu": "0", "tier": "hot", "policy": "fcfs"}


def per_label(name: str) -> str | None:
    for s in SIGNALS.values():
        if s.metric and name in (s.metric, s.metric + "_bucket", s.metric + "_count"):
            return s.per
    return None


def series_of(names: list[str]) -> list[tuple[str, dict[str, str], str]]:
    """(name, extra labels, kind) per series of one engine; kind: gauge/counter/bucket."""
    out: list[tuple[str, dict[str, str], str]] = []
    for name in names:
        per = per_label(name)
        extra = {per: PER_VALUE[per]} if per else {}
        if name == "vllm:request_success_total":
            extra = {"finished_reason": "stop"}
        if name.endswith("_bucket"):
            out += [(name, {**extra, "le": le}, "bucket") for le in BUCKETS]
        elif name.endswith(("_total", "_count", "_sum")):
            out.append((name, extra, "counter"))
        else:
            out.append((name, extra, "gauge"))
    return out


def value_fn(name: str, labels: dict[str, str], kind: str, storm: tuple[int, int] | None) -> Any:
    """i (sample index) -> value."""
    in_storm = (lambda i: storm[0] <= i < storm[1]) if storm else (lambda i: False)
    if kind == "bucket":
        le = labels["le"]
        share = {"0.05": 0.2, "0.1": 0.5, "0.5": 0.9, "1": 0.97, "5": 0.995, "+Inf": 1.0}[le]
        return lambda i: 4.0 * i * share
    if "preemptions" in name:
        return lambda i: float(max(0, min(i, storm[1]) - storm[0]) * 3) if storm else 0.0
    if kind == "counter":
        return lambda i: 4.0 * i
    if "kv_cache_usage" in name:
        return lambda i: 0.99 if in_storm(i) else 0.5 + 0.1 * math.sin(i / 40)
    fixed = {
        "vllm_runbook_collector_up": 1.0,
        "vllm_runbook_warmup_done": 1.0,
        "vllm_runbook_max_num_seqs": 64.0,
        "vllm_runbook_startup_max_num_seqs": 64.0,
        "vllm_runbook_max_num_batched_tokens": 2048.0,
        "vllm_runbook_startup_max_num_batched_tokens": 2048.0,
        "vllm_runbook_scheduler_policy": 1.0,
        "vllm_runbook_kv_blocks_free": 100.0,
        "vllm_runbook_engine_start_time_seconds": 1.0,
        "vllm_runbook_budget_fill_ratio": 0.6,
        "vllm_runbook_kv_hit_ratio": 0.5,
    }
    if name in fixed:
        return lambda i: fixed[name]
    if name.endswith("requests_running"):
        return lambda i: 16.0 if in_storm(i) else 8.0
    return lambda i: 0.0


def write_openmetrics(
    path: Path, names: list[str], engines: int, hours: float, step: float, start: float
) -> int:
    n = int(hours * 3600 / step)
    stamps = [f"{start + i * step:.0f}" for i in range(n)]
    per_engine = series_of(names)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        # OpenMetrics wants one family's samples together: series by name first.
        for name, extra, kind in sorted(per_engine, key=lambda s: (s[0], sorted(s[1].items()))):
            for e in range(engines):
                storm = None
                if e % 10 == 0:
                    first = int((e // 10 * 2 + 1) * 3600 / step) % max(1, n - 100)
                    storm = (first, first + int(1200 / step))
                labels = {"instance": f"eng-{e:03d}", "model_name": "m", "engine": "0", **extra}
                text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                fn = value_fn(name, extra, kind, storm)
                head = f"{name}{{{text}}} "
                out.write("".join(f"{head}{fn(i):g} {stamps[i]}\n" for i in range(n)))
                count += n
        out.write("# EOF\n")
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=100)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--keep", type=Path, default=None, help="keep the TSDB in this folder")
    args = p.parse_args()

    from vllm_runbook.rules.backtest import PrometheusRange
    from vllm_runbook.runbooks.operate.cli import backtest as cli

    ns = argparse.Namespace(config=None, rules=None, runbooks=None)
    config, rules, runbooks, registry = cli.load(ns)
    from vllm_runbook.rules.backtest import Replay
    from vllm_runbook.runbooks.operate.backtest import Simulator

    names = Replay(
        rules, signals=Simulator.signals(runbooks), series=Simulator.extra_series()
    ).names
    end = math.floor(time.time() / 3600) * 3600 - 3600
    start = end - args.hours * 3600
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    if promtool is None or prometheus is None:
        raise SystemExit("promtool and prometheus are needed (Debian: prometheus)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        data = work / "data"
        t = time.perf_counter()
        om = work / "series.om"
        samples = write_openmetrics(om, names, args.engines, args.hours, args.interval, start)
        generated = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
            check=True,
            capture_output=True,
        )
        backfilled = time.perf_counter() - t
        om.unlink()
        print(
            f"prepared {samples:,} samples ({len(names)} names, {args.engines} engines, "
            f"{args.hours:g} h at {args.interval:g} s): generated {generated:.0f} s, "
            f"backfilled {backfilled:.0f} s"
        )
        (work / "prometheus.yml").write_text("global: {}\n")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            prometheus,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=30d",
            "--log.level=warn",
        ]
        with logged_process(cmd, work / "prometheus.log", url + "/-/ready", 120) as proc:
            import psutil

            prom = psutil.Process(proc.pid)
            prom_cpu0 = sum(prom.cpu_times()[:2])
            cpu0, wall0 = time.process_time(), time.perf_counter()
            source = PrometheusRange(url, timeout=300)
            replay, simulator, _ = cli.backtest(
                source, rules, runbooks, config, registry, start + 1, end, args.interval
            )
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            prom_cpu = sum(prom.cpu_times()[:2]) - prom_cpu0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        storms = sum(1 for f in replay.findings if f.alert == "VllmOOMPressure")
        print(HEADER)
        print(
            f"{args.engines:>7} {args.hours:>5g} {args.interval:>6g} {replay.evaluations:>11} "
            f"{len(replay.findings):>8} {storms:>6}/{args.engines // 10:<4} "
            f"{len(simulator.decisions):>9} {source.queries:>7} {wall:>6.0f} {cpu:>5.0f} "
            f"{prom_cpu:>10.0f} {peak:>7.0f}"
        )


if __name__ == "__main__":
    main()
