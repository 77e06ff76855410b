"""Webhook ingest: sustained alerts/s and latency of `runbook serve`, durable.

Starts a real `runbook serve` (uvicorn) on SQLite and on PostgreSQL, posts
Alertmanager deliveries from concurrent clients for a fixed time, then
counts what the database holds: every acknowledged delivery must be there
(0 lost). Each delivery carries `--alerts` firing alerts for an automated
runbook, so each alert also creates its pending execution.

    .venv/bin/python benchmarks/webhook_ingest.py [--seconds 10] [--clients 16] [--alerts 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runbooks.store import Store, upgrade  # noqa: E402
from runbooks.store.models import Execution, WebhookEvent  # noqa: E402

TOKEN = "bench-token"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(db_url: str, config: Path):
    port = free_port()
    env = {**os.environ, "RUNBOOK_WEBHOOK_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runbooks.cli",
            "serve",
            "--config",
            str(config),
            "--db",
            db_url,
            "--port",
            str(port),
            "--no-rules",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def run(db_url: str, config: Path, seconds: float, clients: int, n_alerts: int) -> dict:
    upgrade(db_url)
    latencies: list[float] = []
    acked = [0]
    errors = [0]
    lock = threading.Lock()
    seq = iter(range(10**9))
    with serve(db_url, config) as url:
        stop_at = time.monotonic() + seconds

        def client() -> None:
            with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
                while time.monotonic() < stop_at:
                    with lock:
                        n = next(seq)
                    t = time.perf_counter()
                    r = c.post(url + "/webhooks/alertmanager", json=delivery(n_alerts, n))
                    dt = time.perf_counter() - t
                    with lock:
                        if r.status_code == 200:
                            acked[0] += 1
                            latencies.append(dt)
                        else:
                            errors[0] += 1

        start = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    store = Store(db_url)
    with store.session() as s:
        events = s.scalar(select(func.count()).select_from(WebhookEvent)) or 0
        executions = s.scalar(select(func.count()).select_from(Execution)) or 0
    store.close()
    latencies.sort()
    return {
        "deliveries/s": acked[0] / elapsed,
        "alerts/s": acked[0] * n_alerts / elapsed,
        "p50 ms": 1000 * statistics.median(latencies),
        "p99 ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "acked": acked[0],
        "errors": errors[0],
        "lost": acked[0] - events + (acked[0] * n_alerts - executions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--alerts", type=int, default=1, help="alerts per delivery")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="webhook-bench-"))
    config = tmp / "runbook.yaml"
    config.write_text(CONFIG)
    rows = []
    rows.append(
        (
            "SQLite",
            run(f"sqlite:///{tmp / 'bench.db'}", config, args.seconds, args.clients, args.alerts),
        )
    )
    name = f"runbook_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(f"{PG}/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        rows.append(
            ("PostgreSQL", run(f"{PG}/{name}", config, args.seconds, args.clients, args.alerts))
        )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    print(
        f"\nwebhook ingest: {args.clients} clients, {args.alerts} alert(s) per delivery, "
        f"{args.seconds:.0f} s, one uvicorn process"
    )
    cols = ["deliveries/s", "alerts/s", "p50 ms", "p99 ms", "acked", "errors", "lost"]
    print(f"{'store':<11}" + "".join(f"{c:>14}" for c in cols))
    for store, r in rows:
        print(
            f"{store:<11}"
            + "".join(f"{r[c]:>14.1f}" if isinstance(r[c], float) else f"{r[c]:>14d}" for c in cols)
        )


if __name__ == "__main__":
    main()
