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

Scrapers side by side: `sequential` is the former one (one target after
another, every target every cycle, samples parsed by prometheus_client's
parser into metric families); `concurrent` is vllm_runbook.rules.scrape with
aiohttp's client (vllm_runbook.rules.fetch); `streams` is the same scraper
with the hand-written HTTP/1.1 client over asyncio streams that rules.fetch
held before aiohttp replaced it. `--rounds N` runs the modes N times in alternation (ABAB...: a
machine that others load drifts; each mode sees the same drift) and prints
one row per mode, the medians over all its cycles, plus `ms/req`: the
scraping process' CPU per attempted request (median over the rounds).
`wait` is `concurrent` as it was before the scrape deadline: every cycle
waits for every target. `late` (a line under the rows) counts the targets a
cycle did not wait for (rules.scrape_deadline and scrape_grace: the hanging
ones; their answers, or their timeouts, come in later). Cycles run back to
back (injected times), so a hanging target's request, late, spans several
cycles before its timeout.

`split` is the deployed shape past one replica: two `runbook serve` replicas
with `rules.replicas: split`, two processes running at once, each the
service's RulesLeader cycle (its lease renewed and the live replicas read from
PostgreSQL, a scratch database of `--database`; its share by rendezvous
hashing; then the RulesService scrape and evaluate) over its half of the
engines. Rows `split:a` and `split:b` are the replicas (targets: their share),
`split` the fleet: each cycle as long as the slower replica's, its CPU both
replicas'. The target server is a third process on the same machine (its CPU
per cycle is printed).

    python benchmarks/rules_eval.py [--engines 10 100 1000] [--cycles 9]
        [--timeout 2] [--slow 1] [--modes concurrent wait sequential streams split]
        [--rounds 1] [--database postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import random
import ssl
import statistics
import tempfile
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HEADER = (
    "engines targets    scraper cycles  series scrape s parse s eval s total s worst s"
    "  cpu s failed skipped peak MB"
)

CHURN_HEADER = (
    "engines replaced/min refreshes refresh ms refresh cpu ms parse ms cycles to eval"
    " found->evaluated s cycle s worst s  cpu s"
)

INTERVAL = 5.0  # the default rules.evaluation_interval
REFRESH = 30.0  # the default discovery.refresh_interval
HISTORY = 3600.0
MODEL = "llama-3-8b"


# -- the expositions (built once, in the parent: it imports vLLM) -----------------------


def fleet_inventory(ports: list[int]) -> Any:
    """The fleet's engines (agent and vLLM ports in pairs) as discovery would list them."""
    from vllm_runbook.rules.config import EngineConfig
    from vllm_runbook.runbooks.service.discovery import FILE_SD, Inventory

    inventory = Inventory()
    inventory.update(
        FILE_SD,
        [
            EngineConfig(
                name=f"engine-{i}",
                agent=f"http://127.0.0.1:{ports[2 * i]}",
                vllm=f"http://127.0.0.1:{ports[2 * i + 1]}",
            )
            for i in range(len(ports) // 2)
        ],
    )
    return inventory


def wanted_names() -> list[str]:
    """The sample names the bound catalog reads: what the scraper asks each target for."""
    from vllm_runbook.rules.evaluator import store_for_rules
    from vllm_runbook.rules.model import load_catalog

    return sorted(store_for_rules(load_catalog().bind()).retention)


def collector_bodies(engines: int, names: list[str]) -> list[tuple[bytes, bytes]]:
    """(whole page, the page asked with `name[]=` for `names`) of each engine's agent."""
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm_runbook.collector import metrics as M
    from vllm_runbook.collector.exporter import OnlySamples, Sample, StatsExporter

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
        asked = OnlySamples(registry, names)  # as the agent's /metrics answers name[]=
        out.append((generate_latest(registry), generate_latest(asked)))  # type: ignore[arg-type]
    return out


def vllm_bodies(engines: int) -> list[tuple[bytes, bytes]]:
    """vLLM's /metrics of one engine: the installed vLLM's PrometheusStatLogger registry
    (the Python/process collectors left out), every series given values per engine;
    (whole page, the page asked with `name[]=`): the same, since vLLM's /metrics
    ignores the filter (vLLM 0.32: the instrumentator's own /metrics route answers
    before prometheus_client's ASGI app, which would honour it)."""
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
        page = prometheus_client.generate_latest(registry)
        out.append((page, page))
    return out


# -- the targets' server (one process, one loop, one port per target) ----------------------

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"


def serve_targets(folder: str, kinds: list[str], slow: float, conn: Connection) -> None:
    """A request whose path has a query (`?name[]=...`) gets the filtered page, as
    prometheus_client answers it; a `refused` target's port is bound, never listened
    on (the connection is refused)."""
    bodies = [Path(folder, f"{i}.prom").read_bytes() for i in range(len(kinds))]
    filtered = [Path(folder, f"{i}.filtered.prom").read_bytes() for i in range(len(kinds))]

    async def main() -> None:
        import socket

        # At the end the hung handlers are cancelled: not worth a traceback each.
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        ports: list[int] = []
        closed = []  # the refused targets' bound sockets, and the servers: kept open
        for body, part, kind in zip(bodies, filtered, kinds, strict=True):
            if kind == "refused":
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                closed.append(sock)
                ports.append(sock.getsockname()[1])
                continue
            answer = RESPONSE + b"Content-Length: %d\r\n\r\n" % len(body) + body
            answer_part = RESPONSE + b"Content-Length: %d\r\n\r\n" % len(part) + part

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                answer: bytes = answer,
                answer_part: bytes = answer_part,
                kind: str = kind,
            ) -> None:
                try:
                    while True:
                        head = await reader.readuntil(b"\r\n\r\n")
                        if kind == "dead":
                            await asyncio.sleep(3600)
                        elif kind == "slow":
                            await asyncio.sleep(slow)
                        asked = b"?" in head.split(b"\r\n", 1)[0]
                        writer.write(answer_part if asked else answer)
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=512)
            ports.append(server.sockets[0].getsockname()[1])
            closed.append(server)
        conn.send(ports)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop

    asyncio.run(main())


# -- one measurement (its own process: peak RSS is its own) --------------------------------


# -- the former HTTP client, kept to measure against (mode `streams`) ---------------------

MAX_BODY = 64 * 2**20
MAX_HEAD = 64 * 2**10


class _FetchError(Exception):
    pass


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class StreamsFetcher:
    """The former rules.fetch.Fetcher (until aiohttp replaced it): a hand-written
    HTTP/1.1 GET over asyncio streams, one kept-alive connection per target."""

    def __init__(self, user_agent: str = "vllm-runbook-rules") -> None:
        self.user_agent = user_agent
        self._idle: dict[str, _Conn] = {}
        self._ssl: ssl.SSLContext | None = None

    async def get(self, url: str) -> tuple[int, bytes]:
        """(status, body). OSError / FetchError / IncompleteReadError when it fails;
        cancelling it (a timeout) closes the connection."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _FetchError(f"not an http(s) URL: {url}")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {self.user_agent}\r\n"
            "Accept: text/plain;version=0.0.4\r\nConnection: keep-alive\r\n\r\n"
        ).encode("latin-1")
        conn = self._idle.pop(url, None)
        if conn is not None:
            try:
                return await self._exchange(url, conn, request)
            except asyncio.CancelledError:
                conn.close()
                raise
            except (OSError, EOFError, asyncio.IncompleteReadError):
                conn.close()  # the server closed the idle connection: one fresh try
        port = parts.port or (443 if parts.scheme == "https" else 80)
        context = self._context() if parts.scheme == "https" else None
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=context, limit=MAX_HEAD
        )
        return await self._exchange(url, _Conn(reader, writer), request)

    async def _exchange(self, url: str, conn: _Conn, request: bytes) -> tuple[int, bytes]:
        keep = False
        try:
            conn.writer.write(request)
            status, headers = _head(await _read_head(conn.reader))
            length = headers.get("content-length")
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_chunked(conn.reader)
            elif length is not None:
                try:
                    size = int(length)
                except ValueError:
                    raise _FetchError(f"bad Content-Length {length!r}") from None
                if not 0 <= size <= MAX_BODY:
                    raise _FetchError(f"body of {size} bytes (at most {MAX_BODY})")
                body = await conn.reader.readexactly(size)
            else:
                body = await _read_to_eof(conn.reader)
                return status, body
            keep = headers.get("connection", "").lower() != "close"
            return status, body
        finally:
            if keep:
                self._idle[url] = conn
            else:
                conn.close()

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def forget(self, url: str) -> None:
        """Close the idle connection to `url` (a target that went away)."""
        conn = self._idle.pop(url, None)
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        for conn in self._idle.values():
            conn.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _FetchError(f"response headers over {MAX_HEAD} bytes") from None


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
        raise _FetchError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    try:
        status = int(status_line[1])
    except ValueError:
        raise _FetchError(f"bad status line: {lines[0][:80]!r}") from None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _FetchError(f"bad chunk size {line[:40]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(chunks)
        total += size
        if total > MAX_BODY:
            raise _FetchError(f"body over {MAX_BODY} bytes")
        chunks.append((await reader.readexactly(size + 2))[:-2])


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := await reader.read(2**16):
        total += len(chunk)
        if total > MAX_BODY:
            raise _FetchError(f"body over {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
    """`runbook serve`'s rules cycle (RulesService.run_cycle, with the service's metrics)
    over the engines on `ports`, its scraper as `mode` says: `concurrent` as deployed
    (each target asked for the wanted names only), `wait` the same but every cycle
    waits for every target (no scrape deadline, as before), `full` the whole page of every
    target (the scraper before it asked), `streams` the former HTTP client, `sequential`
    the former scraper, `thawed` as deployed but with every object in garbage
    collection (no heap freeze, service/heap.py)."""
    from vllm_runbook.rules.scrape import NO_BACKOFF, Scraper, _line_finder, parse_wanted
    from vllm_runbook.runbooks.model.config import Config
    from vllm_runbook.runbooks.service import heap
    from vllm_runbook.runbooks.service.rules_service import RulesService
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics

    logging.getLogger("vllm_runbook").setLevel(logging.ERROR)  # the dead ones, incidents
    inventory = fleet_inventory(ports)
    metrics = ServiceMetrics()
    service = RulesService.from_config(
        Config(), inventory=inventory, scrape_timeout=timeout, metrics=metrics
    )
    store = service.windows
    targets = service.scraper.targets  # agent, vLLM of each engine: the files' order
    now = 1_700_000_000.0
    series = fill(store, folder, targets, now, _line_finder(store), parse_wanted)
    service.evaluate(now)
    service.scraper.close()
    if mode != "thawed":
        # as `runbook serve` does once built and after its first cycle (service/heap.py):
        # the imports and the windows (here filled at once) leave garbage collection
        heap.freeze("filled")
    hooks: dict[str, Any] = {"on_error": metrics.scrape_failed, "observer": metrics}
    if mode == "wait":  # as before the scrape deadline: every cycle waits for every target
        service.scraper.deadline = service.scraper.grace = None
    elif mode == "thawed":
        pass  # as deployed, but for the heap: every object in garbage collection
    elif mode == "sequential":
        service.scraper = old_scraper_class()(
            store, targets, timeout=timeout, concurrency=1, backoff=NO_BACKOFF, filter_names=False
        )
    elif mode != "concurrent":
        service.scraper = Scraper(
            store,
            targets,
            timeout=timeout,
            filter_names=False,
            deadline=service.scraper.deadline,  # the service's, from its configuration
            grace=service.scraper.grace,
            **hooks,
        )
        if mode == "streams":
            service.scraper.client = StreamsFetcher()  # type: ignore[assignment]
    scraper = service.scraper
    rows = []
    with scraper:
        for c in range(1, cycles + 1):
            t = now + c * INTERVAL
            cycle_cpu = time.process_time()
            service.scrape(t)
            cycle = scraper.last_cycle
            assert cycle is not None
            start = time.perf_counter()
            service.evaluate(t)
            evaluate = time.perf_counter() - start
            rows.append(
                {
                    "scrape": cycle.seconds - cycle.parse_seconds,
                    "parse": cycle.parse_seconds,
                    "evaluate": evaluate,
                    "total": cycle.seconds + evaluate,
                    "cpu": time.process_time() - cycle_cpu,
                    "attempted": cycle.attempted,
                    "failed": cycle.failed,
                    "skipped": cycle.skipped,
                    "late": cycle.late,
                }
            )
    conn.send(
        {
            "rows": rows,
            "series": series,
            "rss_mb": peak_rss_mb(),
        }
    )


def measure_replica(
    folder: str,
    ports: list[int],
    cycles: int,
    timeout: float,
    database: str,
    holder: str,
    holders: list[str],
    conn: Connection,
) -> None:
    """One `runbook serve` replica with `rules.replicas: split`: the service's
    RulesLeader cycle (its lease and the live replicas' read from PostgreSQL, its
    share by rendezvous hashing, then RulesService's scrape and evaluate) over every
    engine on `ports`, of which it scrapes and evaluates its share. Tells the parent
    when its lease is taken, then waits for "go" (the other replica's lease taken)."""
    from vllm_runbook.rules.scrape import _line_finder, parse_wanted
    from vllm_runbook.runbooks.model.config import Config
    from vllm_runbook.runbooks.service.leader import RulesLeader
    from vllm_runbook.runbooks.service.rules_service import RulesService
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
    from vllm_runbook.runbooks.store import Journal

    logging.getLogger("vllm_runbook").setLevel(logging.ERROR)
    inventory = fleet_inventory(ports)
    metrics = ServiceMetrics()
    config = Config.model_validate({"rules": {"replicas": "split"}})
    service = RulesService.from_config(
        config, inventory=inventory, scrape_timeout=timeout, metrics=metrics
    )
    service.set_share(holders, holder)  # what the leader's first cycle does: history for it
    store = service.windows
    index = {f"http://127.0.0.1:{port}/metrics": i for i, port in enumerate(ports)}
    mine = service.scraper.targets
    now = 1_700_000_000.0
    series = fill(
        store, folder, mine, now, _line_finder(store), parse_wanted, [index[t.url] for t in mine]
    )
    service.evaluate(now)
    clock = {"now": now}
    journal = Journal(database)
    leader = RulesLeader(
        journal,
        lambda: service,
        120.0,  # outlives the run: the other replica's share stays put
        metrics=metrics,
        holder=holder,
        clock=lambda: clock["now"],
        split=config.rules.replicas == "split",
        freeze_heap=True,  # as `runbook serve`: after its first cycle (service/heap.py)
    )
    assert leader._hold()  # this replica's lease: live for the other from now on
    conn.send("ready")
    assert conn.recv() == "go"
    rows: list[dict[str, float]] = []
    try:
        for c in range(1, cycles + 1):
            clock["now"] = now + c * INTERVAL
            cycle_cpu = time.process_time()
            started = time.perf_counter()
            assert leader.cycle(), "the replica did not evaluate"
            total = time.perf_counter() - started
            assert leader.replicas == tuple(sorted(holders)), leader.replicas
            cycle = service.scraper.last_cycle
            assert cycle is not None
            rows.append(
                {
                    "scrape": cycle.seconds - cycle.parse_seconds,
                    "parse": cycle.parse_seconds,
                    "evaluate": total - cycle.seconds,  # and the lease's renewal
                    "total": total,
                    "cpu": time.process_time() - cycle_cpu,
                    "attempted": cycle.attempted,
                    "failed": cycle.failed,
                    "skipped": cycle.skipped,
                    "late": cycle.late,
                }
            )
        conn.send({"rows": rows, "series": series, "rss_mb": peak_rss_mb(), "targets": len(mine)})
        conn.recv()  # its lease stays live until the other replica is done too
    finally:
        journal.release_lease(leader.lease_name, holder)
        service.close()
        journal.close()


def measure_split(
    folder: str, ports: list[int], cycles: int, timeout: float, server: str
) -> dict[str, dict[str, Any]]:
    """Two replicas (`measure_replica`, two processes at once) on a scratch database of
    the PostgreSQL `server`; per replica and the fleet: a fleet cycle is the pair's
    cycles of the same index, as long as the slower, costing both CPUs."""
    import uuid

    from sqlalchemy import create_engine, text
    from vllm_runbook.runbooks.store.schema import upgrade

    name = f"rules_eval_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = server.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade(url)
        holders = [f"replica-{x}-{name}" for x in "ab"]
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for holder in holders:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=measure_replica,
                args=(folder, ports, cycles, timeout, url, holder, holders, child),
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for parent, proc in zip(pipes, procs, strict=True):
            while not parent.poll(1.0):
                if not proc.is_alive():
                    raise SystemExit(f"a replica died: exit code {proc.exitcode}")
            assert parent.recv() == "ready"
        for parent in pipes:
            parent.send("go")
        runs = []
        for parent, proc in zip(pipes, procs, strict=True):
            while not parent.poll(1.0):
                if not proc.is_alive():
                    raise SystemExit(f"a replica died: exit code {proc.exitcode}")
            runs.append(parent.recv())
        for parent, proc in zip(pipes, procs, strict=True):
            parent.send("release")
            proc.join()
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    a, b = runs
    fleet = []
    for x, y in zip(a["rows"], b["rows"], strict=True):
        row = {k: max(x[k], y[k]) for k in ("scrape", "parse", "evaluate", "total")}
        row |= {k: x[k] + y[k] for k in ("cpu", "attempted", "failed", "skipped", "late")}
        fleet.append(row)
    return {
        "a": a,
        "b": b,
        "": {
            "rows": fleet,
            "series": a["series"] + b["series"],
            "rss_mb": max(a["rss_mb"], b["rss_mb"]),
        },
    }


def measure_churn(
    folder: str,
    ports: list[int],
    engines: int,
    replaced_per_min: float,
    minutes: float,
    timeout: float,
    conn: Connection,
) -> None:
    """`runbook serve`'s inventory and rules cycle under churn: every REFRESH seconds
    the discovered fleet loses and gains replaced_per_min / 2 engines (the file_sd
    file rewritten, read, the inventory updated, the scraper's targets changed)."""
    import json

    from vllm_runbook.rules.config import EngineConfig
    from vllm_runbook.runbooks.model.config import Config
    from vllm_runbook.runbooks.service.discovery import (
        FILE_SD,
        FileSD,
        Inventory,
        PrometheusDiscovery,
        targets_to_engines,
    )
    from vllm_runbook.runbooks.service.rules_service import RulesService

    logging.getLogger("vllm_runbook").setLevel(logging.ERROR)  # dead targets, incidents
    pool = len(ports) // 2

    def engine(i: int) -> EngineConfig:
        return EngineConfig(
            name=f"10.0.{i // 250}.{i % 250}:9360",
            agent=f"http://127.0.0.1:{ports[2 * i]}",
            vllm=f"http://127.0.0.1:{ports[2 * i + 1]}",
            labels={"namespace": "llm", "pod": f"llama-{i}"},
        )

    sd = Path(folder, "agents.json")
    source = FileSD([sd])

    def write_sd(active: list[int]) -> None:
        groups = [
            {"targets": [engine(i).agent.removeprefix("http://")], "labels": engine(i).labels}
            for i in active
        ]
        sd.write_text(json.dumps(groups))

    # The discovered engines as the service gets them; the file_sd read and a
    # Prometheus /api/v1/targets answer of the same fleet are timed as parse cost.
    inventory = Inventory()
    active = list(range(engines))
    write_sd(active)
    source.read()
    inventory.update(FILE_SD, [engine(i) for i in active])
    service = RulesService.from_config(Config(), inventory=inventory, scrape_timeout=timeout)
    now = 1_700_000_000.0
    targets = [t for i in active for t in engine(i).targets()]
    fill_targets(service.windows, folder, targets, [(2 * i, 2 * i + 1) for i in active], now)
    service.evaluate(now)
    api = {
        "status": "success",
        "data": {
            "activeTargets": [
                {
                    "discoveredLabels": {
                        "__address__": engine(i).agent.removeprefix("http://"),
                        "__meta_kubernetes_pod_name": f"llama-{i}",
                        "__meta_kubernetes_namespace": "llm",
                        "__scheme__": "http",
                        "__metrics_path__": "/metrics",
                    },
                    "labels": {"job": "llm/vllm-runbook-agents", "instance": f"llama-{i}"},
                    "scrapePool": "podMonitor/llm/vllm-runbook-agents/0",
                    "scrapeUrl": engine(i).agent + "/metrics",
                    "health": "up",
                    "lastError": "",
                }
                for i in active
            ]
        },
    }
    api_body = json.dumps(api).encode()
    prom = PrometheusDiscovery.model_validate(
        {"url": "http://prometheus:9090", "match": {"job": ".+/vllm-runbook-agents"}}
    )
    started = time.process_time()
    for _ in range(5):
        targets_to_engines(json.loads(api_body)["data"]["activeTargets"], prom, 8000)
    api_parse = (time.process_time() - started) / 5

    per_refresh = round(replaced_per_min * REFRESH / 60)
    next_new = engines
    cycles = int(minutes * 60 / INTERVAL)
    every = int(REFRESH / INTERVAL)
    refreshes: list[dict[str, float]] = []
    waiting: dict[str, tuple[float, int]] = {}  # new engine -> (refresh time, cycle)
    found: list[tuple[int, float]] = []  # (cycles, seconds from the refresh to evaluated)
    rows = []
    rng = random.Random(3)
    with service.scraper:
        for c in range(1, cycles + 1):
            t = now + c * INTERVAL
            if c % every == 0:
                gone = set(rng.sample(active, per_refresh))
                new = []
                while len(new) < per_refresh:
                    i = next_new % pool
                    next_new += 1
                    if i not in active and i not in gone:
                        new.append(i)
                active = [i for i in active if i not in gone] + new
                write_sd(active)
                wall, cpu = time.perf_counter(), time.process_time()
                read = source.read()  # the file changed: re-read
                parse = time.perf_counter() - wall
                inventory.update(FILE_SD, [engine(i) for i in active] if read else [])
                service.follow_inventory()
                refreshes.append(
                    {
                        "wall": time.perf_counter() - wall,
                        "cpu": time.process_time() - cpu,
                        "parse": parse,
                    }
                )
                # Found by this refresh, somewhere in the interval before this cycle.
                refreshed_at = t - rng.uniform(0, INTERVAL)
                for i in new:
                    waiting[engine(i).name] = (refreshed_at, c)
            cycle_cpu = time.process_time()
            started = time.perf_counter()
            service.run_cycle(t)
            wall = time.perf_counter() - started
            rows.append({"total": wall, "cpu": time.process_time() - cycle_cpu})
            evaluated = {key[0] for key, eng in service.windows.engines.items() if eng.last_ts == t}
            for name in [n for n in waiting if n in evaluated]:
                refreshed_at, cycle = waiting.pop(name)
                found.append((c - cycle + 1, t - refreshed_at + wall))
    conn.send(
        {
            "rows": rows,
            "refreshes": refreshes,
            "found": found,
            "never": len(waiting),
            "api_parse": api_parse,
            "per_refresh": per_refresh,
        }
    )


def fill_targets(
    store: Any, folder: str, targets: list[Any], files: list[tuple[int, int]], now: float
) -> None:
    from vllm_runbook.rules.scrape import _line_finder, parse_wanted

    lines = _line_finder(store)
    pairs = [(targets[2 * k], a) for k, (a, _) in enumerate(files)]
    pairs += [(targets[2 * k + 1], b) for k, (_, b) in enumerate(files)]
    steps = int(HISTORY / INTERVAL)
    for target, index in pairs:
        for name, labels, value in parse_wanted(Path(folder, f"{index}.prom").read_text(), lines):
            n = min(steps, int(store.retention[name] / INTERVAL) + 1)
            t0 = now - (n - 1) * INTERVAL
            series = store.add(target.instance, name, labels, t0, 0.0)
            if series is None:
                continue
            series.ts.extend(array("d", (t0 + k * INTERVAL for k in range(1, n))))
            values = array("d", [value] * (n - 1))
            series.values.extend(values)
            if series.adjusted is not None:
                series.adjusted.extend(values)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb() -> float:
    """VmHWM: this process' own peak (ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fill(
    store: Any,
    folder: str,
    targets: list[Any],
    now: float,
    lines: Any,
    parse: Any,
    files: list[int] | None = None,
) -> int:
    """An hour of history (at the interval) of every series each target exposes
    (target k's page: file `files[k]`, default k)."""
    count = 0
    steps = int(HISTORY / INTERVAL)
    for k, target in enumerate(targets):
        i = k if files is None else files[k]
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


def write_bodies(folder: str, engines: int) -> None:
    """{2e}.prom / {2e+1}.prom: engine e's agent / vLLM page; .filtered.prom: asked with
    `name[]=` for the names the catalog reads."""
    names = wanted_names()
    agent, vllm = collector_bodies(engines, names), vllm_bodies(engines)
    for e in range(engines):
        for i, (whole, part) in ((2 * e, agent[e]), (2 * e + 1, vllm[e])):
            Path(folder, f"{i}.prom").write_bytes(whole)
            Path(folder, f"{i}.filtered.prom").write_bytes(part)


def fault_kinds(n: int, faults: str) -> list[str]:
    """1 % of `n` targets hang (accept, never answer), 1 % are `faults` (slow | refused)."""
    bad = max(1, round(0.01 * n))
    kinds = ["ok"] * n
    for k in range(bad):
        dead = int((k + 0.5) * n / bad)
        kinds[dead], kinds[(dead + 1) % n] = "dead", faults
    return kinds


def run_child(target: Any, *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    while not parent.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"the measurement ({target.__name__}) died: exit code {proc.exitcode}")
    result = parent.recv()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--cycles", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=2.0, help="per target (s)")
    parser.add_argument("--slow", type=float, default=1.0, help="slow targets answer after (s)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["concurrent", "sequential"],
        help="concurrent (as deployed) | wait (no scrape deadline) | full (whole pages) | "
        "thawed (no heap freeze: service/heap.py) | "
        "streams | sequential | "
        "split (two replicas, rules.replicas: split, two processes at once); "
        "a mode named twice is measured twice (an A/A control)",
    )
    parser.add_argument(
        "--database",
        default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
        help="split mode: a PostgreSQL the replicas share (a scratch database is "
        "created next to this one, and dropped)",
    )
    parser.add_argument(
        "--faults",
        choices=["slow", "refused"],
        default="slow",
        help="besides the 1 %% hanging targets, 1 %% slow or refusing connections",
    )
    parser.add_argument(
        "--sequential-cycles", type=int, default=2, help="cycles of the sequential scraper"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure the modes this many times, alternated"
    )
    parser.add_argument(
        "--churn",
        type=float,
        metavar="PER_MIN",
        help="churn mode: discovered engines, this many replaced per minute",
    )
    parser.add_argument("--minutes", type=float, default=3.0, help="churn mode: simulated time")
    args = parser.parse_args()
    if args.churn is not None:
        churn(args)
        return
    most = max(args.engines)
    folder = tempfile.mkdtemp(prefix="rules-eval-")
    write_bodies(folder, most)
    agent, vllm = (len(Path(folder, f"{i}.prom").read_bytes()) for i in (0, 1))
    asked = sum(len(Path(folder, f"{i}.filtered.prom").read_bytes()) for i in (0, 1))
    print(
        f"rules cycle as deployed: {args.timeout:g} s timeout per target, 1 % of targets dead "
        f"(never answer), 1 % "
        + (f"slow ({args.slow:g} s)" if args.faults == "slow" else "refusing connections")
        + f", interval {INTERVAL:g} s, "
        f"{int(HISTORY / 60)} min of history; agent /metrics {agent / 1024:.0f} KiB, "
        f"vLLM /metrics {vllm / 1024:.0f} KiB, asked for the wanted names "
        f"{asked / 1024:.1f} KiB (vLLM's ignores the filter); load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(HEADER)
    labels: list[str] = []  # a mode named twice: measured twice, the second as "mode'"
    for mode in args.modes:
        labels.append(mode + "'" * sum(1 for x in labels if x.rstrip("'") == mode))
    # what each label prints: split, its replicas then the fleet
    shown = {
        label: [f"{label}:a", f"{label}:b", label] if label.startswith("split") else [label]
        for label in labels
    }
    for engines in args.engines:
        n = 2 * engines
        kinds = fault_kinds(n, args.faults)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        server = ctx.Process(target=serve_targets, args=(folder, kinds, args.slow, child))
        server.start()
        ports = parent.recv()
        server_pid = server.pid
        assert server_pid is not None
        try:
            runs: dict[str, list[dict[str, Any]]] = {x: [] for lb in labels for x in shown[lb]}
            served: dict[str, list[float]] = {label: [] for label in labels}
            for _round in range(args.rounds):
                for label in labels:  # alternated: each mode sees the machine's drift
                    mode = label.rstrip("'")
                    cycles = args.cycles if mode != "sequential" else args.sequential_cycles
                    before = process_cpu(server_pid)
                    if mode == "split":
                        parts = measure_split(folder, ports, cycles, args.timeout, args.database)
                        for key, part in parts.items():
                            runs[f"{label}:{key}" if key else label].append(part)
                    else:
                        runs[label].append(
                            run_child(measure, folder, ports, mode, cycles, args.timeout)
                        )
                    served[label].append((process_cpu(server_pid) - before) / cycles)
            per_request: dict[str, float] = {}
            means: dict[str, float] = {}
            steady: dict[str, float] = {}
            for label in (x for lb in labels for x in shown[lb]):
                rows = [row for r in runs[label] for row in r["rows"]]
                r = runs[label][0]

                def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                    return statistics.median(row[key] for row in rows)

                means[label] = statistics.mean(row["total"] for row in rows)
                # each run's first cycle reads every agent's whole page too (the
                # filter's check at a target's first answer): a start, not the rest
                steady[label] = statistics.mean(
                    row["total"] for run in runs[label] for row in run["rows"][1:]
                )
                per_request[label] = statistics.median(
                    statistics.median(row["cpu"] / max(1, row["attempted"]) for row in run["rows"])
                    for run in runs[label]
                )
                print(
                    f"{engines:>7} {r.get('targets', n):>7} {label:>10} {len(rows):>6} "
                    f"{r['series']:>7} "
                    f"{med('scrape'):>8.2f} {med('parse'):>7.2f} {med('evaluate'):>6.2f} "
                    f"{med('total'):>7.2f} {max(row['total'] for row in rows):>7.2f} "
                    f"{med('cpu'):>6.2f} "
                    f"{sum(row['failed'] for row in rows):>6} "
                    f"{sum(row['skipped'] for row in rows):>7} "
                    f"{max(run['rss_mb'] for run in runs[label]):>7.0f}",
                    flush=True,
                )
            if args.rounds > 1 or len(labels) > 1:
                first = labels[0]
                print(
                    "        target server cpu per cycle (median of rounds; it shares the "
                    "machine): "
                    + ", ".join(f"{lb} {statistics.median(v):.2f} s" for lb, v in served.items())
                )
                base = per_request[first]
                print(
                    "        late (targets a cycle did not wait for, all cycles): "
                    + ", ".join(
                        f"{lb} {sum(row.get('late', 0) for r in runs[lb] for row in r['rows'])}"
                        for lb in means
                    )
                )
                print(
                    "        mean cycle (all cycles): "
                    + ", ".join(f"{label} {v:.2f} s" for label, v in means.items())
                )
                print(
                    "        mean cycle (all but each run's first): "
                    + ", ".join(f"{label} {v:.2f} s" for label, v in steady.items())
                )
                print(
                    "        cpu per request (median of rounds): "
                    + ", ".join(
                        f"{label} {1000 * v:.3f} ms"
                        + (f" ({v / base:.2f}x {first})" if base and label != first else "")
                        for label, v in per_request.items()
                    ),
                    flush=True,
                )
        finally:
            parent.send("stop")
            server.join(10)
            if server.is_alive():
                server.kill()


def churn(args: argparse.Namespace) -> None:
    engines = args.engines[0]
    pool = engines + int(args.churn * args.minutes) + 10
    folder = tempfile.mkdtemp(prefix="rules-churn-")
    write_bodies(folder, pool)
    kinds = fault_kinds(2 * pool, "slow")
    print(
        f"churn: {engines} discovered engines (file_sd), {args.churn:g} replaced per minute, "
        f"refresh every {REFRESH:g} s, cycle every {INTERVAL:g} s, {args.minutes:g} min "
        f"simulated; {args.timeout:g} s timeout, 1 % dead, 1 % slow ({args.slow:g} s); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve_targets, args=(folder, kinds, args.slow, child))
    server.start()
    ports = parent.recv()
    try:
        r = run_child(measure_churn, folder, ports, engines, args.churn, args.minutes, args.timeout)
    finally:
        parent.send("stop")
        server.join(10)
        if server.is_alive():
            server.kill()
    refreshes, found, rows = r["refreshes"], r["found"], r["rows"]

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    cycles_to_eval = max(c for c, _ in found) if found else 0
    seconds = [s for _, s in found]
    print(CHURN_HEADER)
    print(
        f"{engines:>7} {args.churn:>12g} {len(refreshes):>9} "
        f"{1000 * med([x['wall'] for x in refreshes]):>10.1f} "
        f"{1000 * med([x['cpu'] for x in refreshes]):>14.1f} "
        f"{1000 * med([x['parse'] for x in refreshes]):>8.1f} "
        f"{cycles_to_eval:>14} "
        f"{med(seconds):>8.2f}/{max(seconds) if seconds else float('nan'):<8.2f} "
        f"{med([x['total'] for x in rows]):>7.2f} {max(x['total'] for x in rows):>7.2f} "
        f"{med([x['cpu'] for x in rows]):>6.2f}"
    )
    print(
        f"        new engines evaluated: {len(found)} of {len(found) + r['never']} "
        f"({r['per_refresh']} per refresh); a Prometheus /api/v1/targets answer of "
        f"{engines} targets parsed and selected in {1000 * r['api_parse']:.0f} ms of CPU"
    )


if __name__ == "__main__":
    main()
