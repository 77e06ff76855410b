"""The scraper at fleet size: concurrent scrapes with bounded parallelism, per-target
timeouts, backoff from dead targets, and a parse that keeps only what the rules read.

Real HTTP servers on loopback; nothing here asserts on wall time. Concurrency is
shown by servers that answer only once other requests have arrived (a scraper
that fetched one target after another would time out on them).
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.evaluator import store_for_rules
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scrape import (
    BACKOFF,
    NO_BACKOFF,
    Backoff,
    ExpositionError,
    ScrapeCycle,
    Scraper,
    ScrapeResult,
    Target,
    _line_finder,
    parse_wanted,
)
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.rules.window import Series, WindowStore
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.service.leader import RulesLeader
from vllm_runbook.runbooks.service.rules_service import RulesService
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import Journal

RULES = load_catalog().bind()
GOOD = b'vllm_runbook_kv_cache_usage_peak_ratio{engine="0",model_name="m"} 0.5\n'

Behaviour = Callable[[str], tuple[int, bytes] | None]  # path -> (status, body); None: hang


class Fleet:
    """One threaded HTTP server on loopback; each path is one target."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Behaviour] = {}
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.release = threading.Event()  # lets hanging handlers go at teardown
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with fleet.lock:
                    fleet.requests[self.path] = fleet.requests.get(self.path, 0) + 1
                answer = fleet.behaviour[self.path](self.path)
                if answer is None:
                    fleet.release.wait(30)
                    return
                status, body = answer
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def target(self, name: str, behaviour: Behaviour) -> Target:
        path = f"/{name}/metrics"
        self.behaviour[path] = behaviour
        return Target(f"http://127.0.0.1:{self.httpd.server_address[1]}{path}", name)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def ok(_path: str) -> tuple[int, bytes]:
    return 200, GOOD


def hang(_path: str) -> None:
    return None


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


def errors(scraper: Scraper, url: str, reason: str) -> int:
    return scraper.error_counts[(url, reason)]


def test_slow_target_answers_only_if_the_others_are_fetched_meanwhile(fleet: Fleet) -> None:
    """The slow target (listed first) answers once every other target has been asked,
    the dead one included: fetched one after another it would time out instead."""
    others = 7  # 6 healthy + 1 that never answers
    asked = threading.Semaphore(0)

    def counted(behaviour: Behaviour) -> Behaviour:
        def serve(path: str) -> tuple[int, bytes] | None:
            asked.release()
            return behaviour(path)

        return serve

    def slow(_path: str) -> tuple[int, bytes]:
        for _ in range(others):
            assert asked.acquire(timeout=20)
        return 200, GOOD.replace(b"0.5", b"0.75")

    targets = [fleet.target("slow", slow), fleet.target("dead", counted(hang))]
    targets += [fleet.target(f"ok{i}", counted(ok)) for i in range(6)]
    store = store_for_rules(RULES)
    with Scraper(store, targets, timeout=5.0, concurrency=8) as scraper:
        results = scraper.scrape_once(now=100.0)
    assert [(r.target.instance, r.ok, r.reason) for r in results] == [
        ("slow", True, None),
        ("dead", False, "unreachable"),
    ] + [(f"ok{i}", True, None) for i in range(6)]
    assert results[1].error == "no answer within 5 s"
    assert scraper.last_cycle is not None
    assert (scraper.last_cycle.attempted, scraper.last_cycle.failed) == (8, 1)
    assert scraper.up == {t.url: t.instance != "dead" for t in targets}


def test_parallelism_is_bounded(fleet: Fleet) -> None:
    """Each handler holds its answer until `limit` requests are in flight (or every
    request has arrived): all succeed, and never were more than `limit` in flight."""
    limit, count = 3, 9
    state = {"in_flight": 0, "most": 0, "arrived": 0}
    cond = threading.Condition()

    def gated(_path: str) -> tuple[int, bytes]:
        with cond:
            state["in_flight"] += 1
            state["arrived"] += 1
            state["most"] = max(state["most"], state["in_flight"])
            cond.notify_all()
            cond.wait_for(lambda: state["in_flight"] >= limit or state["arrived"] == count, 20)
            return 200, GOOD

    def finished(_result: ScrapeResult) -> None:
        # Called on the scraper's loop before it starts another request: a freed
        # slot means a finished request.
        with cond:
            state["in_flight"] -= 1

    targets = [fleet.target(f"e{i}", gated) for i in range(count)]
    observer = _Recorder(on_target=finished)
    with Scraper(store_for_rules(RULES), targets, concurrency=limit, observer=observer) as scraper:
        results = scraper.scrape_once(now=1.0)
    assert [r.ok for r in results] == [True] * count
    assert (state["most"], state["arrived"]) == (limit, count)


class _Recorder:
    def __init__(self, on_target: Callable[[ScrapeResult], None] | None = None) -> None:
        self.targets: list[ScrapeResult] = []
        self.cycles: list[ScrapeCycle] = []
        self.on_target = on_target

    def target_scraped(self, result: ScrapeResult) -> None:
        self.targets.append(result)
        if self.on_target is not None:
            self.on_target(result)

    def cycle_scraped(self, cycle: ScrapeCycle) -> None:
        self.cycles.append(cycle)


def test_dead_target_is_backed_off_exponentially_and_retried(fleet: Fleet) -> None:
    """Attempts at a dead target over cycles every 5 s (injected times): after the
    n-th failure in a row it is skipped for 10 x 2^(n-1) s, at most 40 s."""
    dead = Target(dead_url(), "gone")
    live = fleet.target("live", ok)
    recorder = _Recorder()
    store = store_for_rules(RULES)
    backoff = Backoff(base=10.0, cap=40.0)
    attempted_at = []
    with Scraper(store, [dead, live], backoff=backoff, observer=recorder) as scraper:
        for now in range(0, 155, 5):
            results = scraper.scrape_once(now=float(now))
            assert results[1].ok
            if results[0].reason != BACKOFF:
                assert results[0].reason == "unreachable"
                attempted_at.append(now)
    assert attempted_at == [0, 10, 30, 70, 110, 150]
    assert [backoff.delay(n) for n in range(1, 6)] == [10.0, 20.0, 40.0, 40.0, 40.0]
    assert errors(scraper, dead.url, "unreachable") == len(attempted_at)
    assert fleet.requests["/live/metrics"] == 31
    assert [(c.attempted, c.failed, c.skipped) for c in recorder.cycles[:3]] == [
        (2, 1, 0),
        (1, 0, 1),
        (2, 1, 0),
    ]
    # The observer hears of attempts only: 31 live + 6 dead.
    assert len(recorder.targets) == 31 + len(attempted_at)


def test_a_target_that_answers_again_leaves_backoff(fleet: Fleet) -> None:
    mode = {"answer": False}

    def flaky(path: str) -> tuple[int, bytes] | None:
        return ok(path) if mode["answer"] else None

    target = fleet.target("flaky", flaky)
    store = store_for_rules(RULES)
    with Scraper(store, [target], timeout=3.0, backoff=Backoff(10.0, 40.0)) as scraper:
        assert scraper.scrape_once(now=0.0)[0].reason == "unreachable"
        assert scraper.scrape_once(now=9.0)[0].reason == BACKOFF
        mode["answer"] = True
        assert scraper.scrape_once(now=10.0)[0].ok
        assert scraper.scrape_once(now=15.0)[0].ok  # not backed off any more
    assert fleet.requests["/flaky/metrics"] == 3


def test_answering_targets_are_not_backed_off_and_errors_count_per_target(
    fleet: Fleet,
) -> None:
    """503 and garbage cost nothing: tried every cycle, counted every time, per target."""
    busy = fleet.target("busy", lambda _p: (503, b"busy\n"))
    garbage = fleet.target(
        "garbage",
        lambda _p: (200, b'vllm_runbook_kv_cache_usage_peak_ratio{engine="0",model_name="m"} x\n'),
    )
    dead = Target(dead_url(), "gone")
    good = fleet.target("good", ok)
    store = store_for_rules(RULES)
    with Scraper(store, [busy, garbage, dead, good], backoff=Backoff(10.0, 40.0)) as scraper:
        for now in (0.0, 5.0, 10.0):
            scraper.scrape_once(now=now)
    counts = {
        (t.instance, reason): errors(scraper, t.url, reason)
        for t in (busy, garbage, dead, good)
        for reason in ("unreachable", "http_status", "parse")
    }
    assert {k: v for k, v in counts.items() if v} == {
        ("busy", "http_status"): 3,
        ("garbage", "parse"): 3,
        ("gone", "unreachable"): 2,  # at 0 and 10; skipped at 5
    }
    assert scraper.up == {busy.url: False, garbage.url: False, dead.url: False, good.url: True}


# -- the parse -------------------------------------------------------------------------


def _fixture_exposition() -> bytes:
    """Every family the catalog reads, with awkward label values, plus families no rule
    reads (some whose names start like wanted ones)."""
    registry = CollectorRegistry()
    usage = M.build(M.KV_CACHE_USAGE_PEAK, registry)
    usage.labels(model_name='we"ird,{m}\\o\nk', engine="0").set(0.97)
    usage.labels(model_name="m", engine="1").set(-math.inf)
    gpu = M.build(M.GPU_MEMORY_USED, registry)
    for g in range(2):
        gpu.labels(model_name="m", engine="0", gpu=str(g)).set(1e9 * (g + 1))
    latency = Histogram(
        "vllm:e2e_request_latency_seconds",
        "e2e",
        ["model_name", "engine"],
        buckets=(0.3, 1.0, 2.5),
        registry=registry,
    )
    for v in (0.1, 0.5, 2.0, 9.0):
        latency.labels("m", "0").observe(v)
    success = Counter(
        "vllm:request_success", "ok", ["model_name", "engine", "finished_reason"], registry=registry
    )
    success.labels("m", "0", "stop").inc(7)
    # Not read by any rule:
    Gauge("vllm:num_requests_running_extra", "x", ["model_name", "engine"], registry=registry)
    M.build(M.STEPS, registry).labels(model_name="m", engine="0").inc(5)
    iteration = Histogram(
        "vllm:iteration_tokens_total", "it", ["model_name", "engine"], registry=registry
    )
    iteration.labels("m", "0").observe(64)
    Counter("vllm:e2e_request_latency_seconds_other", "x", registry=registry).inc()
    return (
        generate_latest(registry) + b"# a comment\n\nvllm:generation_tokens_total 3 1700000000000\n"
    )


def test_parse_keeps_exactly_the_series_the_catalog_reads() -> None:
    text = _fixture_exposition().decode()
    store = store_for_rules(RULES)
    oracle = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    unwanted = {name for name, _, _ in oracle if not store.wants(name)}
    assert {"vllm:iteration_tokens_total_bucket", "vllm_runbook_steps_total"} <= unwanted
    assert {
        "vllm:e2e_request_latency_seconds_other_total",  # starts like a wanted name
        "vllm:e2e_request_latency_seconds_sum",  # no rule reads it
    } <= unwanted
    parsed = parse_wanted(text, _line_finder(store))
    assert parsed == [sample for sample in oracle if store.wants(sample[0])]
    names = {name for name, _, _ in parsed}
    assert names == {
        M.KV_CACHE_USAGE_PEAK.series_name,
        M.GPU_MEMORY_USED.series_name,
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
        SIGNALS["generation_tokens"].metric,
    }
    assert names <= set(store.retention)
    assert len(parsed) == 2 + 2 + 4 + 1 + 1  # usage, GPUs, buckets (with +Inf), two counters


def test_wanted_names_come_from_the_bound_rules() -> None:
    """A catalog narrowed to one rule parses that rule's series only."""
    one = [r for r in RULES if r.alert == "VllmOOMPressure"]
    store = store_for_rules(one)
    parsed = parse_wanted(_fixture_exposition().decode(), _line_finder(store))
    assert {name for name, _, _ in parsed} == set(store.retention) & {
        M.KV_CACHE_USAGE_PEAK.series_name,
        M.GPU_MEMORY_USED.series_name,
    }
    assert parsed


@pytest.mark.parametrize(
    "line",
    [
        'vllm_runbook_kv_cache_usage_peak_ratio{engine="0",model_name="m"} 0.5x',
        'vllm_runbook_kv_cache_usage_peak_ratio{engine="0,model_name="m"} 0.5',
        "vllm_runbook_kv_cache_usage_peak_ratio{engine=0} 0.5",
        "vllm_runbook_kv_cache_usage_peak_ratio",
    ],
)
def test_a_broken_wanted_line_fails_the_parse(line: str) -> None:
    lines = _line_finder(store_for_rules(RULES))
    if " " not in line:
        assert parse_wanted(line + "\n", lines) == []  # a bare name is not a sample line
        return
    with pytest.raises(ExpositionError):
        parse_wanted(f"# HELP x y\n{line}\n", lines)


def test_a_broken_unwanted_line_is_not_read() -> None:
    lines = _line_finder(store_for_rules(RULES))
    assert parse_wanted('vllm_runbook_steps_total{engine="0" garbage\n', lines) == []


def test_sequential_mode_is_concurrency_one(fleet: Fleet) -> None:
    """concurrency=1 with NO_BACKOFF is the former scraper: one target after another."""
    seen_in_flight = []
    state = {"in_flight": 0}
    lock = threading.Lock()

    def tracked(_path: str) -> tuple[int, bytes]:
        with lock:
            state["in_flight"] += 1
            seen_in_flight.append(state["in_flight"])
        return 200, GOOD

    def finished(result: ScrapeResult) -> None:
        if result.target.instance != "gone":  # the dead one never reached a server
            with lock:
                state["in_flight"] -= 1

    targets = [fleet.target(f"s{i}", tracked) for i in range(5)]
    dead = Target(dead_url(), "gone")
    recorder = _Recorder(on_target=finished)
    with Scraper(
        store_for_rules(RULES),
        [*targets, dead],
        concurrency=1,
        backoff=NO_BACKOFF,
        observer=recorder,
    ) as scraper:
        scraper.scrape_once(now=0.0)
        scraper.scrape_once(now=5.0)
    assert seen_in_flight == [1] * 10
    assert errors(scraper, dead.url, "unreachable") == 2


# -- what the service exports ------------------------------------------------------------


def test_the_leader_exports_cycle_time_and_per_target_scrape_durations(
    tmp_path: Path, fleet: Fleet, incident_store: Journal
) -> None:
    live = fleet.target("live", ok)
    dead = dead_url()
    config_path = tmp_path / "runbook.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {"name": "live", "agent": live.url.removesuffix("/metrics")},
                    {"name": "gone", "agent": dead.removesuffix("/metrics")},
                ],
                "rules": {"evaluation_interval": "5s"},
            }
        ),
        encoding="utf-8",
    )
    config = load_config(config_path)
    metrics = ServiceMetrics(scrape_targets=[live.url, dead])
    times = iter([1000.0, 1005.0])
    leader = RulesLeader(
        incident_store,
        lambda: RulesService.from_config(config, metrics=metrics),
        60.0,
        metrics=metrics,
        clock=lambda: next(times),
    )

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return metrics.registry.get_sample_value(name, labels or {})

    def durations() -> set[str]:
        return {
            s.labels["target"] for s in metrics.scrape_duration.collect()[0].samples if s.value > 0
        }

    prefix = "vllm_runbook_service_"
    try:
        assert leader.cycle()
        assert durations() == {live.url, dead}
        assert value(prefix + "rules_cycle_seconds_count") == 1.0
        assert value(prefix + "scrape_targets_backed_off") == 0.0
        assert leader.cycle()  # 5 s later: the dead target is backed off (10 s)
        assert value(prefix + "rules_cycle_seconds_count") == 2.0
        assert value(prefix + "scrape_targets_backed_off") == 1.0
        errors = {"target": dead, "reason": "unreachable"}
        assert value(prefix + "scrape_errors_total", errors) == 1.0
        assert fleet.requests["/live/metrics"] == 2
    finally:
        leader.stop()
    assert durations() == set()  # a follower reports no scrapes
    assert value(prefix + "scrape_targets_backed_off") == 0.0


def test_known_series_are_stored_as_a_full_parse_would(fleet: Fleet) -> None:
    """Scrapes whose series come and go (engine versions change): the store holds
    exactly what parsing every sample and adding it would hold."""
    bodies = [
        _fixture_exposition(),
        _fixture_exposition().replace(b'engine="1"', b'engine="1",extra="x"'),
        _fixture_exposition().replace(b"0.97", b"0.5"),
        _fixture_exposition(),
    ]
    turn = {"n": 0}

    def changing(_path: str) -> tuple[int, bytes]:
        return 200, bodies[turn["n"]]

    target = fleet.target("changing", changing)
    store, reference = store_for_rules(RULES), store_for_rules(RULES)
    lines = _line_finder(reference)
    with Scraper(store, [target]) as scraper:
        for n, body in enumerate(bodies):
            turn["n"] = n
            now = 10.0 * (n + 1)
            [result] = scraper.scrape_once(now=now)
            seen: set[Series] = set()
            expected = 0
            for name, labels, value in parse_wanted(body.decode(), lines):
                if reference.add("changing", name, labels, now, value, seen) is not None:
                    expected += 1
            reference.end_scrape(target.url, now, seen)
            assert (result.ok, result.samples) == (True, expected)

    def contents(s: WindowStore) -> dict[object, object]:
        return {
            (key, name, tuple(sorted(series.labels.items()))): (
                list(series.ts),
                list(series.values),
                series.stale_at,
            )
            for key, eng in s.engines.items()
            for name, lst in eng.by_name.items()
            for series in lst
        }

    assert contents(store) == contents(reference)
    # The fixture stores 9 series (its unlabelled counter names no engine), + 1 relabelled.
    assert len(contents(store)) == 10
