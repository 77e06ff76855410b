"""The scraper at fleet size: concurrent scrapes with bounded parallelism, per-target
timeouts, backoff from dead targets, and a parse that keeps only what the rules read.

Real HTTP servers on loopback; nothing here asserts on wall time. Concurrency is
shown by servers that answer only once other requests have arrived (a scraper
that fetched one target after another would time out on them).
"""

from __future__ import annotations

import collections
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs
from urllib.request import urlopen

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.server import AgentServer
from vllm_runbook.rules import scrape
from vllm_runbook.rules.evaluator import store_for_rules
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scrape import (
    BACKOFF,
    LATE,
    NO_BACKOFF,
    Backoff,
    ExpositionError,
    ScrapeCycle,
    Scraper,
    ScrapeResult,
    Target,
    _line_finder,
    parse_wanted,
    wanted_families,
)
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.rules.window import Series, WindowStore
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.service.leader import REPLICA_LEASE_PREFIX, RulesLeader
from vllm_runbook.runbooks.service.rules_service import RulesService, rendezvous_owner
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import Journal

RULES = load_catalog().bind()
GOOD = b'vllm_runbook_kv_cache_usage_peak_ratio{engine="0",model_name="m"} 0.5\n'

Behaviour = Callable[[str], tuple[int, bytes] | None]  # path?query -> (status, body); None: hang


class Fleet:
    """One threaded HTTP server on loopback; each path is one target."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Behaviour] = {}
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}  # path (without the query) -> requests
        self.queries: list[str] = []  # of every request, in order
        self.release = threading.Event()  # lets hanging handlers go at teardown
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")  # the scraper's name[]= filter
                with fleet.lock:
                    fleet.requests[path] = fleet.requests.get(path, 0) + 1
                    fleet.queries.append(query)
                answer = fleet.behaviour[path](self.path)
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

    # Only the filtered asks count: each target's whole page, read once at its first
    # answer to check the filter, comes after it.
    def counted(behaviour: Behaviour) -> Behaviour:
        def serve(path: str) -> tuple[int, bytes] | None:
            if "?" in path:
                asked.release()
            return behaviour(path)

        return serve

    def slow(path: str) -> tuple[int, bytes]:
        for _ in range(others if "?" in path else 0):
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
    # one request per target (no filter, so no check of it): in flight = requests
    with Scraper(
        store_for_rules(RULES), targets, concurrency=limit, observer=observer, filter_names=False
    ) as scraper:
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
    assert fleet.requests["/live/metrics"] == 31 + 1  # + its whole page, checked at first
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
    assert fleet.requests["/flaky/metrics"] == 3 + 1  # + its whole page, at its first answer


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
        filter_names=False,  # one request per target: in flight = requests
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
        assert fleet.requests["/live/metrics"] == 2 + 1  # + its whole page, checked at first
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


# -- asking for the wanted names only ------------------------------------------------------


def test_each_target_is_asked_for_the_names_the_rules_read(fleet: Fleet) -> None:
    target = fleet.target("e", ok)
    store = store_for_rules(RULES)
    with Scraper(store, [target]) as scraper:
        for now in (0.0, 5.0):
            assert scraper.scrape_once(now=now)[0].ok
    # at its first answer the whole page is read too: the filter loses nothing
    assert [bool(q) for q in fleet.queries] == [True, False, True]
    assert scraper.unfiltered == set()
    asked = parse_qs(fleet.queries[0])
    assert set(asked) == {"name[]"}
    assert sorted(asked["name[]"]) == sorted(store.retention)  # the sample names kept
    assert "vllm:e2e_request_latency_seconds_bucket" in asked["name[]"]


WAITING = b'vllm:num_requests_waiting{engine="0",model_name="m"} 3\n'


@pytest.mark.parametrize(
    "filtered",
    [(400, b"no such parameter\n"), (200, b""), (200, GOOD)],
    # empty: prometheus_client's multiprocess registry; partial: a registry that
    # finds some collectors by name, not others
    ids=["refused", "empty", "partial"],
)
def test_a_target_that_does_not_take_the_filter_is_asked_for_the_whole_page(
    fleet: Fleet, filtered: tuple[int, bytes]
) -> None:
    def page(path: str) -> tuple[int, bytes]:
        return filtered if "?" in path else (200, GOOD + WAITING)

    target = fleet.target("e", page)
    store = store_for_rules(RULES)
    with Scraper(store, [target]) as scraper:
        first, second = scraper.scrape_once(now=0.0)[0], scraper.scrape_once(now=5.0)[0]
    assert (first.ok, first.samples, second.ok, second.samples) == (True, 2, True, 2)
    assert scraper.unfiltered == {target.url}
    # the filtered ask, the whole page, then only the whole page
    assert [bool(q) for q in fleet.queries] == [True, False, False]
    assert scraper.error_counts == {}


def test_a_target_that_ignores_the_filter_is_read_whole_without_a_second_request(
    fleet: Fleet,
) -> None:
    """vLLM's own /metrics sends its whole page to a filtered URL: a family no wanted
    name belongs to says so, and that answer is the page (no second request)."""
    page = (
        b"# HELP vllm:cache_config_info info\n# TYPE vllm:cache_config_info gauge\n"
        b'vllm:cache_config_info{block_size="16"} 1.0\n'
        b"# TYPE vllm_runbook_kv_cache_usage_peak_ratio gauge\n" + GOOD + WAITING
    )
    target = fleet.target("e", lambda _path: (200, page))
    store = store_for_rules(RULES)
    with Scraper(store, [target]) as scraper:
        results = [scraper.scrape_once(now=now)[0] for now in (0.0, 5.0, 10.0)]
    assert [(r.ok, r.samples) for r in results] == [(True, 2)] * 3
    assert scraper.unfiltered == {target.url}
    assert [bool(q) for q in fleet.queries] == [True, False, False]


def test_a_filtered_page_is_not_taken_for_a_whole_one() -> None:
    """The families a filtered page may have: the wanted names and their prefixes
    before an underscore (a histogram `x` of `x_bucket`, a counter `x_total`)."""
    store = store_for_rules(RULES)
    families = wanted_families(store)
    assert "vllm:e2e_request_latency_seconds" in families
    assert "vllm:e2e_request_latency_seconds_bucket" in families
    assert "vllm:num_preemptions_total" in families
    assert "vllm:cache_config_info" not in families
    scraper = Scraper(store, [])
    try:
        assert not scraper._ignores_filter(
            "# TYPE vllm:e2e_request_latency_seconds histogram\n"
            "# TYPE vllm:num_preemptions_total counter\n"
        )
        assert scraper._ignores_filter("# TYPE vllm:num_preemptions_total counter\n# TYPE x gauge")
    finally:
        scraper.close()


def test_the_fleet_checks_its_filters_at_spread_phases(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first answer's check, each target reads its whole page again every
    CHECK_FILTER_EVERY attempts at a phase of its own (never sooner than that after
    the first): not all in one cycle."""
    monkeypatch.setattr(scrape, "CHECK_FILTER_EVERY", 4)
    targets = [fleet.target(f"t{k}", ok) for k in range(8)]
    whole: dict[str, list[int]] = collections.defaultdict(list)

    def page(name: str) -> Behaviour:
        def answer(path: str) -> tuple[int, bytes]:
            if "?" not in path:
                whole[name].append(cycle)
            return 200, GOOD

        return answer

    for t in targets:
        fleet.behaviour[f"/{t.instance}/metrics"] = page(t.instance)
    phases = {t.instance: scrape._phase(t.url) for t in targets}
    assert all(0 <= p < 4 for p in phases.values())
    cycle = 0
    with Scraper(store_for_rules(RULES), targets) as scraper:
        for cycle in range(12):
            assert all(r.ok for r in scraper.scrape_once(now=5.0 * cycle))
    for name, p in phases.items():
        assert whole[name] == [0] + [k for k in range(4 + p, 12) if (k - p) % 4 == 0], name
    assert len({p for p in phases.values()}) > 1  # crc32 of 8 URLs: not one phase


def test_without_the_filter_every_target_is_asked_for_its_whole_page(fleet: Fleet) -> None:
    target = fleet.target("e", ok)
    with Scraper(store_for_rules(RULES), [target], filter_names=False) as scraper:
        assert scraper.scrape_once(now=0.0)[0].ok
    assert fleet.queries == [""]


def test_the_agent_answers_name_filters_with_those_samples_only() -> None:
    """The collector agent's /metrics honours `name[]=` as prometheus_client's own
    exposition does, custom collectors (which describe no names) included."""
    registry = CollectorRegistry()
    Gauge("g_one", "one", registry=registry).set(1)
    Counter("c_two", "two", registry=registry).inc(2)

    class Custom:
        def describe(self) -> list[object]:
            return []

        def collect(self) -> Iterator[object]:
            family = GaugeMetricFamily("custom_three", "three", labels=["x"])
            family.add_metric(["a"], 3.0)
            yield family

    registry.register(Custom())  # type: ignore[arg-type]
    server = AgentServer("127.0.0.1", 0, registry).start()
    try:

        def get(query: str) -> dict[str, float]:
            with urlopen(f"{server.url}/metrics{query}", timeout=10) as response:
                text = response.read().decode()
            return {
                s.name: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }

        assert get("?name[]=c_two_total&name[]=custom_three") == {
            "c_two_total": 2.0,
            "custom_three": 3.0,
        }
        assert get("?name[]=nothing") == {}
        assert {"g_one", "c_two_total", "c_two_created", "custom_three"} <= set(get(""))
    finally:
        server.close()


# -- replicas that split the fleet -----------------------------------------------------------


@pytest.mark.service
def test_two_replicas_split_the_engines_and_one_takes_all_when_the_other_dies(
    tmp_path: Path, fleet: Fleet, rules_pg_database: str
) -> None:
    """Two `split` replicas on PostgreSQL: each engine scraped and evaluated by exactly
    one (rendezvous hashing over the live replicas' leases); one killed (its lease
    left to lapse), the other evaluates every engine from its first cycle after."""
    names = [f"e{i}" for i in range(12)]
    targets = {name: fleet.target(name, ok) for name in names}
    config_path = tmp_path / "runbook.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {"name": n, "agent": t.url.removesuffix("/metrics")} for n, t in targets.items()
                ],
                # a grace as long as the deadline: on a busy machine a target may
                # be slower than 250 ms, and this test counts one request per cycle
                "rules": {"evaluation_interval": "5s", "replicas": "split", "scrape_grace": "3s"},
            }
        ),
        encoding="utf-8",
    )
    config = load_config(config_path)
    assert config.rules.replicas == "split"
    store = Journal(rules_pg_database)
    ttl = 4.0  # seconds: far longer than a cycle of 12 engines on loopback
    a, b = (
        RulesLeader(
            store,
            lambda: RulesService.from_config(config),
            ttl,
            holder=f"replica-{x}-{tmp_path.name}",
            split=True,
        )
        for x in "ab"
    )

    def share(leader: RulesLeader) -> set[str]:
        assert leader.service is not None
        scraped = {t.instance for t in leader.service.scraper.targets}
        evaluated = {key[0] for key in leader.service.windows.engines}
        assert evaluated == scraped  # what it scraped is all it evaluates
        return scraped

    try:
        assert a.cycle()
        assert share(a) == set(names)  # alone
        assert b.cycle() and a.cycle()
        expected = {n: rendezvous_owner(n, sorted([a.holder, b.holder])) for n in names}
        assert share(a) == {n for n in names if expected[n] == a.holder}
        assert share(b) == {n for n in names if expected[n] == b.holder}
        assert share(a) and share(b)
        before = dict(fleet.requests)
        assert a.cycle() and b.cycle()
        assert {p: fleet.requests[p] - before[p] for p in before} == {
            f"/{n}/metrics": 1
            for n in names  # each engine once per cycle of the pair
        }
        # b dies: no stop, no release; a keeps its share until b's lease lapses
        assert a.cycle()
        assert share(a) == {n for n in names if expected[n] == a.holder}
        deadline = time.monotonic() + 2 * ttl
        while b.holder in store.live_holders(REPLICA_LEASE_PREFIX):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert a.cycle()
        assert share(a) == set(names)
        assert a.replicas == (a.holder,)
    finally:
        a.stop()
        b.stop()
        store.close()


def test_rendezvous_moves_only_the_engines_of_the_replica_that_left() -> None:
    engines = [f"engine-{i}" for i in range(300)]
    three = ["r1", "r2", "r3"]
    before = {e: rendezvous_owner(e, three) for e in engines}
    after = {e: rendezvous_owner(e, ["r1", "r3"]) for e in engines}
    assert {e for e in engines if before[e] != after[e]} == {
        e for e in engines if before[e] == "r2"
    }
    assert all(60 <= list(before.values()).count(r) <= 140 for r in three)


# -- a cycle deadline: hanging targets do not hold the cycle --------------------------


def _series_times(store: WindowStore, instance: str) -> list[float]:
    [series] = store.engines[(instance, "m", "0")].by_name["vllm_runbook_kv_cache_usage_peak_ratio"]
    return list(series.ts[series.start :])


def _wait_for_late_answer(scraper: Scraper) -> None:
    """Until the loop, driven between cycles, has received the late answer (or its timeout)."""
    until = time.monotonic() + 20
    while not scraper._late and time.monotonic() < until:
        time.sleep(0.01)
    assert scraper._late, "the late request got nothing between cycles"


@pytest.mark.parametrize(
    ("deadline", "grace"), [(2.0, None), (None, 0.2)], ids=["deadline", "grace"]
)
def test_a_hanging_target_does_not_hold_the_cycle_and_its_late_answer_keeps_its_time(
    fleet: Fleet, deadline: float | None, grace: float | None
) -> None:
    """The cycle stops waiting at its deadline (or after `grace` without an answer)
    while the held target still holds its request: the others' samples are in, the
    held one is late, not failed. Its request goes on between cycles; its answer is
    ingested by the next cycle at the time of the cycle that asked, and it is not
    asked again before it answered."""
    gate = threading.Event()

    def held(path: str) -> tuple[int, bytes]:
        assert gate.wait(20)
        return 200, GOOD.replace(b"0.5", b"0.25")

    targets = [fleet.target("a", ok), fleet.target("held", held), fleet.target("b", ok)]
    targets += [fleet.target(f"ok{i}", ok) for i in range(8)]  # 10 of 11 answer: the grace
    store = store_for_rules(RULES)
    recorder = _Recorder()
    with Scraper(
        store, targets, timeout=30.0, deadline=deadline, grace=grace, observer=recorder
    ) as scraper:
        results = scraper.scrape_once(now=100.0)
        assert not gate.is_set()  # it returned while the target still held its answer
        assert [(r.ok, r.reason) for r in results] == [
            (True, None),
            (False, LATE),
        ] + [(True, None)] * 9
        cycle = scraper.last_cycle
        assert cycle is not None
        assert (cycle.attempted, cycle.failed, cycle.skipped, cycle.late) == (11, 0, 0, 1)
        metrics = ServiceMetrics()  # what `runbook serve` exports of the cycle
        metrics.cycle_scraped(cycle)
        late_gauge = "vllm_runbook_service_scrape_targets_late"
        assert metrics.registry.get_sample_value(late_gauge) == 1.0
        assert _series_times(store, "a") == _series_times(store, "b") == [100.0]
        assert ("held", "m", "0") not in store.engines
        assert scraper.error_counts == collections.Counter()
        gate.set()
        _wait_for_late_answer(scraper)
        assert ("held", "m", "0") not in store.engines  # kept for the next cycle
        results = scraper.scrape_once(now=105.0)
        # settled first (late), then asked again: this cycle's result is the new one
        assert [(r.ok, r.late) for r in results] == [(True, False)] * 11
        # ingested at the time of the cycle that asked for it; asked again at 105
        assert _series_times(store, "held") == [100.0, 105.0]
        [held_series] = store.engines[("held", "m", "0")].by_name[
            "vllm_runbook_kv_cache_usage_peak_ratio"
        ]
        assert list(held_series.values) == [0.25, 0.25]
        assert _series_times(store, "a") == [100.0, 105.0]
        cycle = scraper.last_cycle
        assert cycle is not None and (cycle.attempted, cycle.failed, cycle.late) == (11, 0, 0)
        metrics.cycle_scraped(cycle)
        assert metrics.registry.get_sample_value(late_gauge) == 0.0
    assert fleet.requests["/held/metrics"] == 2 + 1  # + its whole page, at its first answer
    assert [r.late for r in recorder.targets if r.target.instance == "held"] == [True, False]
    assert scraper.error_counts == collections.Counter()


def test_a_late_target_that_never_answers_fails_at_its_timeout_and_is_backed_off(
    fleet: Fleet,
) -> None:
    """Late at the deadline, not asked again while in flight; its own timeout then
    makes it a failure (counted once, with the time of the cycle that asked), backed
    off from that time as any other."""
    dead = fleet.target("dead", hang)
    live = fleet.target("live", ok)
    store = store_for_rules(RULES)
    backoff = Backoff(base=10.0, cap=40.0)
    with Scraper(store, [dead, live], timeout=2.5, deadline=1.0, backoff=backoff) as scraper:
        first = scraper.scrape_once(now=0.0)
        assert [(r.ok, r.reason) for r in first] == [(False, LATE), (True, None)]
        assert errors(scraper, dead.url, "unreachable") == 0
        _wait_for_late_answer(scraper)  # its 2.5 s timeout passed between cycles
        dead_result, live_result = scraper.scrape_once(now=5.0)
        assert (dead_result.ok, dead_result.reason, dead_result.late) == (
            False,
            "unreachable",
            True,
        )
        assert dead_result.error == "no answer within 2.5 s"
        assert live_result.ok
        cycle = scraper.last_cycle
        assert cycle is not None
        assert (cycle.attempted, cycle.failed, cycle.skipped, cycle.late) == (1, 1, 0, 0)
        assert errors(scraper, dead.url, "unreachable") == 1
        assert scraper.up[dead.url] is False
        assert scraper.state[dead.url].retry_at == 0.0 + backoff.delay(1)
        assert scraper.scrape_once(now=9.0)[0].reason == BACKOFF
        assert scraper.scrape_once(now=10.0)[0].reason == LATE  # tried again: late again
        assert fleet.requests["/dead/metrics"] == 2
        assert _series_times(store, "live") == [0.0, 5.0, 9.0, 10.0]
    assert errors(scraper, dead.url, "unreachable") == 1  # the one in flight at close: neither


def test_close_drops_late_requests_and_stops_the_thread_that_drives_them(fleet: Fleet) -> None:
    gate = threading.Event()

    def held(_path: str) -> tuple[int, bytes]:
        assert gate.wait(20)
        return 200, GOOD

    target = fleet.target("held", held)
    scraper = Scraper(store_for_rules(RULES), [target], timeout=30.0, deadline=0.2)
    assert scraper.scrape_once(now=1.0)[0].reason == LATE
    driver = scraper._drainer
    assert driver is not None and driver.is_alive()
    scraper.close()
    assert not driver.is_alive() and scraper._inflight == {} and scraper._loop is None
    gate.set()
    [result] = scraper.scrape_once(now=2.0)  # asked again, on a new loop
    assert result.ok and not result.late
    scraper.close()
    assert fleet.requests["/held/metrics"] == 2 + 1


def test_without_a_deadline_or_grace_a_cycle_waits_for_every_target(fleet: Fleet) -> None:
    def slowish(path: str) -> tuple[int, bytes]:
        time.sleep(0.3)
        return ok(path)

    with Scraper(store_for_rules(RULES), [fleet.target("s", slowish)], timeout=10.0) as scraper:
        assert scraper.scrape_once(now=1.0)[0].ok
        assert scraper._drainer is None and scraper._inflight == {}


def test_the_grace_waits_for_stragglers_only(fleet: Fleet) -> None:
    """One of two targets answered: too few for the grace (GRACE_AFTER), so the cycle
    waits for the other, here until its timeout: a failure of this cycle, not late."""
    targets = [fleet.target("live", ok), fleet.target("dead", hang)]
    with Scraper(store_for_rules(RULES), targets, timeout=1.0, grace=0.05) as scraper:
        live, dead = scraper.scrape_once(now=1.0)
    assert live.ok and (dead.reason, dead.late) == ("unreachable", False)
    assert scraper.last_cycle is not None and scraper.last_cycle.late == 0


@pytest.mark.parametrize("field", ["deadline", "grace"])
def test_deadline_and_grace_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be positive"):
        Scraper(store_for_rules(RULES), [], **{field: 0.0})  # type: ignore[arg-type]
