"""Scraper against a real HTTP server on loopback, and against targets that fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scrape import NO_BACKOFF, Scraper, Target
from vllm_runbook.runbooks.demo.servers import free_port

RULES = load_catalog().bind({"VllmOOMPressure": {"for": "0s"}})


class Exposition:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.usage = M.build(M.KV_CACHE_USAGE_PEAK, self.registry)
        self.preemptions = M.build(M.PREEMPTIONS, self.registry)
        self.steps = M.build(M.STEPS, self.registry)  # read by no rule: not stored
        self.status = 200
        self.body: bytes | None = None

    def payload(self) -> bytes:
        return self.body if self.body is not None else generate_latest(self.registry)


@pytest.fixture
def server() -> Iterator[tuple[str, Exposition]]:
    exposition = Exposition()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = exposition.payload()
            self.send_response(exposition.status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics", exposition
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_scrape_feeds_the_evaluator(server: tuple[str, Exposition]) -> None:
    url, exp = server
    store = store_for_rules(RULES)
    scraper = Scraper(store, [Target(url, "llama-0")])
    sink = MemoryIncidentSink()
    evaluator = Evaluator(RULES, store, sink)
    labels = {"model_name": "tiny", "engine": "0"}
    exp.usage.labels(**labels).set(0.97)
    exp.preemptions.labels(**labels)  # a labelled counter shows up once it has labels
    exp.steps.labels(**labels).inc(5)
    [result] = scraper.scrape_once(now=1000.0)
    assert (result.ok, result.samples) == (True, 2)  # usage and preemptions; steps not wanted
    exp.preemptions.labels(**labels).inc(3)
    scraper.scrape_once(now=1010.0)
    evaluator.evaluate(1010.0)
    [event] = sink.of("VllmOOMPressure", "firing")
    assert (event.engine, event.value) == (("llama-0", "tiny", "0"), 0.97)


def test_a_target_that_leaves_is_forgotten_and_its_finding_resolves(
    server: tuple[str, Exposition],
) -> None:
    """The inventory dropped an engine (discovery): its series go with it, so its
    firing alert resolves at the next evaluation; one that stays keeps firing."""
    url, exp = server
    store = store_for_rules(RULES)
    stays = Target(url + "?stays", "llama-1")
    scraper = Scraper(store, [Target(url, "llama-0"), stays])
    sink = MemoryIncidentSink()
    evaluator = Evaluator(RULES, store, sink)
    labels = {"model_name": "tiny", "engine": "0"}
    exp.usage.labels(**labels).set(0.97)
    exp.preemptions.labels(**labels)
    scraper.scrape_once(now=1000.0)
    exp.preemptions.labels(**labels).inc(3)
    scraper.scrape_once(now=1010.0)
    evaluator.evaluate(1010.0)
    firing = {e.engine[0] for e in sink.of("VllmOOMPressure", "firing")}
    assert firing == {"llama-0", "llama-1"}
    removed = scraper.set_targets([stays])
    assert [t.instance for t in removed] == ["llama-0"]
    assert set(scraper.state) == {stays.url}
    exp.preemptions.labels(**labels).inc(3)
    scraper.scrape_once(now=1020.0)
    evaluator.evaluate(1020.0)
    assert [e.engine[0] for e in sink.of("VllmOOMPressure", "resolved")] == ["llama-0"]
    assert {e.engine[0] for e in sink.of("VllmOOMPressure", "firing")} == {"llama-0", "llama-1"}
    still = {k[0] for r, k, _ in evaluator.firing() if r.alert == "VllmOOMPressure"}
    assert still == {"llama-1"}


def test_unreachable_target_is_counted_not_raised(server: tuple[str, Exposition]) -> None:
    url, exp = server
    dead = Target(f"http://127.0.0.1:{free_port()}/metrics", "gone")
    store = store_for_rules(RULES)
    scraper = Scraper(store, [dead, Target(url, "llama-0")], timeout=2.0, backoff=NO_BACKOFF)
    exp.usage.labels(model_name="tiny", engine="0").set(0.5)
    results = scraper.scrape_once(now=1.0)
    assert [(r.ok, r.reason) for r in results] == [(False, "unreachable"), (True, None)]
    assert results[0].error and results[0].error.startswith("ConnectionRefusedError")
    reported: list[tuple[str, str]] = []
    scraper.on_error = lambda target, reason: reported.append((target, reason))
    scraper.scrape_once(now=2.0)
    assert scraper.error_counts == {(dead.url, "unreachable"): 2}
    assert reported == [(dead.url, "unreachable")]  # the injected callback, once per failure
    assert scraper.up == {dead.url: False, url: True}
    scraper.close()


def test_http_error_and_garbage_are_counted(server: tuple[str, Exposition]) -> None:
    url, exp = server
    store = store_for_rules(RULES)
    scraper = Scraper(store, [Target(url, "llama-0")])
    exp.status = 503
    assert scraper.scrape_once(now=1.0)[0].reason == "http_status"
    exp.status, exp.body = (
        200,
        b'vllm_runbook_kv_cache_usage_peak_ratio{engine="0",model_name="m"} not-a-number\n',
    )
    assert scraper.scrape_once(now=2.0)[0].reason == "parse"


def test_series_missing_from_a_scrape_go_stale(server: tuple[str, Exposition]) -> None:
    url, exp = server
    store = store_for_rules(RULES)
    scraper = Scraper(store, [Target(url, "llama-0")])
    exp.usage.labels(model_name="tiny", engine="0").set(0.5)
    scraper.scrape_once(now=1.0)
    [series] = store.engines[("llama-0", "tiny", "0")].by_name[M.KV_CACHE_USAGE_PEAK.series_name]
    assert store.latest(series, 2.0) == 0.5
    exp.usage.remove("tiny", "0")
    scraper.scrape_once(now=3.0)
    assert store.latest(series, 4.0) is None


@pytest.fixture
def keep_alive() -> Iterator[tuple[str, list[int], threading.Event]]:
    """An HTTP/1.1 target that keeps connections open: the client ports it was
    asked from, one per request; it answers once `go` is set."""
    ports: list[int] = []
    go = threading.Event()
    go.set()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ports.append(self.client_address[1])
            go.wait(30)
            body = b"# nothing the rules read\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics", ports, go
    finally:
        go.set()
        httpd.shutdown()
        httpd.server_close()


def in_a_thread(work: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_cycles_on_any_thread_reuse_the_connection_and_start_no_thread(
    keep_alive: tuple[str, list[int], threading.Event],
) -> None:
    """The scraper's loop runs in the thread that calls scrape_once (the
    scheduler's pool threads take turns): no thread of its own, and the
    connection kept alive between cycles is the next cycle's."""
    url, ports, _go = keep_alive
    before = set(threading.enumerate())
    with Scraper(store_for_rules(RULES), [Target(url, "llama-0")]) as scraper:
        for now in (1.0, 2.0, 3.0):
            in_a_thread(lambda now=now: scraper.scrape_once(now=now)).join(30)
            assert scraper.up == {url: True}
        new = set(threading.enumerate()) - before
        # The target's own handler threads only (one per connection it serves).
        assert all("process_request_thread" in t.name for t in new), new
    # one connection, three cycles (+ the whole page read once, at the first answer,
    # to check the name[]= filter against it)
    assert len(ports) == 3 + 1 and len(set(ports)) == 1


def test_a_close_during_a_cycle_is_done_when_the_cycle_ends(
    keep_alive: tuple[str, list[int], threading.Event],
) -> None:
    url, ports, go = keep_alive
    scraper = Scraper(store_for_rules(RULES), [Target(url, "llama-0")])
    go.clear()  # the target holds the first request
    cycle = in_a_thread(lambda: scraper.scrape_once(now=1.0))
    deadline = time.monotonic() + 30
    while not ports and time.monotonic() < deadline:
        time.sleep(0.01)
    scraper.close()  # returns at once: the cycle still runs the loop
    assert cycle.is_alive()
    go.set()
    cycle.join(30)
    assert scraper.up == {url: True} and scraper._loop is None  # closed by the cycle
    [result] = scraper.scrape_once(now=2.0)  # a scrape after close opens a new loop
    assert result.ok and len(set(ports)) == 2
    scraper.close()
