"""Webhook ingest: sustained alerts/s and latency of `runbook serve`, durable.

Starts a real `runbook serve` (uvicorn) on SQLite and on PostgreSQL, posts
Alertmanager deliveries from concurrent clients for a fixed time, then
counts what the database holds: every acknowledged delivery must be there
(0 lost). Each delivery carries `--alerts` firing alerts for an automated
runbook, so each alert also creates its pending execution. The service runs
without its worker (`--no-worker`: the benchmark's engine does not exist, and
running executions is not ingest); `--worker` turns it on.

Two phases per store: closed loop (`--clients` senders, each sending as soon
as its previous delivery is answered: the saturation throughput, and the
latency of a full queue) and open loop at `--rate` alerts/s (deliveries due
at a fixed pace: the latency at that load). Lost = acknowledged deliveries
(and their executions) not in the database afterwards.

    .venv/bin/python benchmarks/webhook_ingest.py [--seconds 10] [--clients 16] [--alerts 1]
        [--rate 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select, text
from vllm_runbook.runbooks.demo.servers import free_port, logged_process
from vllm_runbook.runbooks.store import Journal, upgrade
from vllm_runbook.runbooks.store.models import Execution, WebhookEvent

TOKEN = "bench-token"
# The table's header row, as docs/benchmarks.md shows it (a test compares them).
HEADER = (
    "store       load               deliveries/s   alerts/s   p50 ms   p99 ms    acked  errors lost"
)
PG = os.environ.get("RUNBOOK_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
CONFIG = """\
engines:
  - name: engine-a
    agent: http://127.0.0.1:9
    labels: {instance: "10.1.2.3:8000"}
automation: {oom-pressure: auto}
"""


def delivery(n_alerts: int, seq: int) -> dict:
    labels = {
        "alertname": "VllmOOMPressure",
        "instance": "10.1.2.3:8000",
        "runbook": "oom-pressure",
    }
    alerts = [
        {
            "status": "firing",
            "labels": labels,
            "annotations": {},
            "fingerprint": f"fp-{seq}-{i}",
            "startsAt": "2026-11-29T10:00:00Z",
            "generatorURL": "",
        }
        for i in range(n_alerts)
    ]
    return {
        "version": "4",
        "groupKey": f"g{seq}",
        "status": "firing",
        "receiver": "r",
        "groupLabels": {},
        "commonLabels": labels,
        "commonAnnotations": {},
        "externalURL": "",
        "truncatedAlerts": 0,
        "alerts": alerts,
    }


@contextlib.contextmanager
def serve(db_url: str, config: Path, worker: bool = False) -> Iterator[str]:
    """`runbook serve` on `db_url`, its log beside `config` (its tail shown if it fails)."""
    port = free_port()
    env = {**os.environ, "RUNBOOK_WEBHOOK_TOKEN": TOKEN}
    cmd = [
        sys.executable,
        "-m",
        "vllm_runbook.runbooks.operate.cli",
        "serve",
        "--config",
        str(config),
        "--db",
        db_url,
        "--port",
        str(port),
        "--no-rules",
        *([] if worker else ["--no-worker"]),
    ]
    url = f"http://127.0.0.1:{port}"
    log = config.parent / f"serve-{port}.log"
    with logged_process(cmd, log, url + "/healthz", 60, env, stop_timeout=20):
        yield url


@dataclass
class Phase:
    """One load phase: closed loop (`rate` None: each client sends as soon as its
    previous delivery was answered) or open loop at `rate` deliveries/s."""

    name: str
    clients: int
    rate: float | None = None
    latencies: list[float] = field(default_factory=list)
    acked: int = 0
    errors: int = 0
    elapsed: float = 0.0


def drive(url: str, phase: Phase, seconds: float, n_alerts: int, seq: Iterator[int]) -> None:
    lock = threading.Lock()
    ready = threading.Barrier(phase.clients + 1)
    start = stop_at = 0.0

    def client() -> None:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        with httpx.Client(headers=headers, timeout=30) as c:
            c.get(url + "/healthz")  # connected before the clock starts
            ready.wait()
            ready.wait()
            while True:
                with lock:
                    n, slot = next(seq), next(slots)
                if phase.rate is None:
                    scheduled = time.perf_counter()
                else:
                    # Latency counts from when the delivery was due, so a server that
                    # falls behind shows it (no coordinated omission).
                    scheduled = start + slot / phase.rate
                    time.sleep(max(0.0, scheduled - time.perf_counter()))
                if scheduled >= stop_at or time.perf_counter() >= stop_at:
                    return  # a server behind schedule shows as a lower rate
                body = json.dumps(delivery(n_alerts, n)).encode()
                r = c.post(url + "/webhooks/alertmanager", content=body)
                done = time.perf_counter()
                with lock:
                    if r.status_code == 200:
                        phase.acked += 1
                        phase.latencies.append(done - scheduled)
                    else:
                        phase.errors += 1

    slots = itertools.count()
    threads = [threading.Thread(target=client) for _ in range(phase.clients)]
    for t in threads:
        t.start()
    ready.wait()  # every client connected
    start = time.perf_counter()
    stop_at = start + seconds
    ready.wait()  # go
    for t in threads:
        t.join()
    phase.elapsed = time.perf_counter() - start


def run(
    db_url: str, config: Path, seconds: float, phases: list[Phase], n_alerts: int, worker: bool
) -> tuple[list[Phase], int]:
    """Each phase against one `runbook serve`; returns them and the deliveries lost."""
    upgrade(db_url)
    seq = iter(range(10**9))
    with serve(db_url, config, worker) as url:
        for phase in phases:
            drive(url, phase, seconds, n_alerts, seq)
    store = Journal(db_url)
    with store.session() as s:
        events = s.scalar(select(func.count()).select_from(WebhookEvent)) or 0
        executions = s.scalar(select(func.count()).select_from(Execution)) or 0
    store.close()
    acked = sum(p.acked for p in phases)
    return phases, (acked - events) + (acked * n_alerts - executions)


def row(store: str, phase: Phase, n_alerts: int, lost: int) -> str:
    lat = sorted(phase.latencies) or [float("nan")]
    cells = [
        f"{store:<11}",
        f"{phase.name:<18}",
        f"{phase.acked / phase.elapsed:>12.1f}",
        f"{phase.acked * n_alerts / phase.elapsed:>10.1f}",
        f"{1000 * statistics.median(lat):>8.1f}",
        f"{1000 * lat[int(0.99 * (len(lat) - 1))]:>8.1f}",
        f"{phase.acked:>8d}",
        f"{phase.errors:>7d}",
        f"{lost:>5d}",
    ]
    return " ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10, help="per phase")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--alerts", type=int, default=1, help="alerts per delivery")
    parser.add_argument(
        "--rate",
        type=float,
        default=1000.0,
        help="open-loop phase: alerts/s offered (0: skip the phase)",
    )
    parser.add_argument("--worker", action="store_true", help="run the service's worker too")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="webhook-bench-"))
    config = tmp / "runbook.yaml"
    config.write_text(CONFIG)

    def phases() -> list[Phase]:
        out = [Phase(f"closed, {args.clients} clients", args.clients)]
        if args.rate > 0:
            out.append(Phase(f"open, {args.rate:g} alerts/s", 64, args.rate / args.alerts))
        return out

    results = [
        (
            "SQLite",
            *run(
                f"sqlite:///{tmp / 'bench.db'}",
                config,
                args.seconds,
                phases(),
                args.alerts,
                args.worker,
            ),
        )
    ]
    name = f"runbook_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(f"{PG}/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        results.append(
            (
                "PostgreSQL",
                *run(f"{PG}/{name}", config, args.seconds, phases(), args.alerts, args.worker),
            )
        )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    print(
        f"\nwebhook ingest: {args.alerts} alert(s) per delivery, {args.seconds:g} s per phase, "
        f"one uvicorn process, worker {'on' if args.worker else 'off'}, {os.cpu_count()} CPUs; "
        "latency from when a delivery was due to its 2xx (stored)"
    )
    print(HEADER)
    for store, done, lost in results:
        for phase in done:
            print(row(store, phase, args.alerts, lost))


if __name__ == "__main__":
    main()
