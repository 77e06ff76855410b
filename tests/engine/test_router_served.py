"""A stuck engine behind a real vllm-router: detected with its /health still 200,
drained at the router, its traffic served by the other engine, put back after
it recovers.

Two served CPU engines (the plugin loaded, VLLM_SERVER_DEV_MODE for vLLM's
`/pause`) behind `vllm-router` (round robin) on loopback, clients sending
completions through the router all along. Engine A is frozen with vLLM's
`POST /pause?mode=keep` (its requests stay queued, no step runs, `/health`
answers 200): the stand-in for a hung engine. The embedded evaluator scrapes
both; VllmEngineStuck must fire for A (only) within the collector's stall
threshold + the rule's `for` + two evaluation intervals. The engine-stuck
runbook then runs on A: drain at the router, the restart hook (here vLLM's
`POST /resume`: no process is killed), wait for its steps, undrain.

Oracles: every request the clients sent got an HTTP status (none hangs) and
the engines' own success counters add up to the 200s exactly (none lost); A
finished nothing while frozen; the router did not list A between drain and
undrain and lists it at the end; a request sent while it listed B alone was
answered; A serves again after.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.rules.remediation import Handoff
from vllm_runbook.runbooks.demo.servers import free_port, logged_process
from vllm_runbook.runbooks.engine.client import EngineClient
from vllm_runbook.runbooks.engine.operations import ActionContext
from vllm_runbook.runbooks.engine.router import (
    Drain,
    RouterError,
    VllmRouter,
    drain,
    router_bindings,
)
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.service.rules_service import RulesService
from vllm_runbook.runbooks.store import Journal, upgrade
from vllm_runbook.runbooks.store.models import STEP_APPLIED, ExecutionStatus

from tests.catalogs import catalog_with
from tests.engines import ServedEngine, http_get

pytestmark = [pytest.mark.engine, pytest.mark.served]

STALL_SECONDS = 3.0  # VLLM_RUNBOOK_STALL_SECONDS of the engines
INTERVAL = 1.0  # the evaluator's
RULE_FOR = 15.0  # VllmEngineStuck's shipped `for`
CLIENTS = 4
SUCCESS = "vllm:request_success_total"


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> int:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def served_total(engine: ServedEngine) -> float:
    text = http_get(engine.api_url + "/metrics", timeout=30)[1]
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == SUCCESS
    )


def agent_value(engine: ServedEngine, spec: M.MetricSpec) -> float | None:
    text = http_get(engine.agent_url + "/metrics", timeout=30)[1]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == spec.series_name:
                return float(s.value)
    return None


@dataclass
class Fleet:
    a: ServedEngine
    b: ServedEngine
    router_url: str
    model: str


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("router-fleet")
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_RUNBOOK_STALL_SECONDS": f"{STALL_SECONDS:g}"}
    started: dict[str, Any] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def start(name: str) -> None:
        # Both engines start at once: the start-up is most of this module's time.
        try:
            with ServedEngine.run(tiny_model, tmp / f"{name}.log", env=env) as engine:
                started[name] = engine
                stop.wait()
        except BaseException as exc:
            errors.append(exc)
            started[name] = None

    threads = [threading.Thread(target=start, args=(n,), daemon=True) for n in "ab"]
    for t in threads:
        t.start()
    try:
        while len(started) < 2 and not errors:
            time.sleep(0.2)
        if errors:
            raise errors[0]
        a, b = started["a"], started["b"]
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        cmd = [
            str(Path(sys.executable).with_name("vllm-router")),
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--worker-urls", a.api_url, b.api_url, "--log-level", "warning",
        ]  # fmt: skip
        with logged_process(cmd, tmp / "router.log", router_url + "/list_workers", 60):
            yield Fleet(a, b, router_url, a.model_id())
    finally:
        stop.set()
        for t in threads:
            t.join(60)


@dataclass
class Clients:
    """Completions through the router until stopped; every answer's status kept."""

    fleet: Fleet
    statuses: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sent: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, index: int) -> None:
        body = {
            "model": self.fleet.model,
            "prompt": [1 + index] * 16,
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0,
        }
        while not self.stop.is_set():
            with self.lock:
                self.sent += 1
            try:
                status = post(self.fleet.router_url + "/v1/completions", body, timeout=150)
            except Exception as exc:  # a hang (timeout) or a broken connection: lost
                with self.lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with self.lock:
                self.statuses.append(status)
            time.sleep(0.05)

    def probe(self) -> int:
        """One completion through the router, outside the clients' counts."""
        body = {"model": self.fleet.model, "prompt": [9] * 16, "max_tokens": 1, "temperature": 0}
        return post(self.fleet.router_url + "/v1/completions", body, timeout=150)


class Fired:
    def __init__(self) -> None:
        self.calls: list[tuple[float, Handoff]] = []
        self.event = threading.Event()

    def on_firing(self, handoff: Handoff) -> None:
        self.calls.append((time.time(), handoff))
        self.event.set()

    def on_resolved(self, handoff: Handoff) -> None:
        pass


def test_stuck_engine_is_drained_and_returns(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = fleet.a, fleet.b
    resume = (
        "import os, urllib.request; urllib.request.urlopen(urllib.request.Request("
        "os.environ['VLLM_RUNBOOK_WORKER_URL'] + '/resume', b'', method='POST'), timeout=30)"
    )
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    config_path = tmp_path / "runbook.yaml"
    engines = [
        {"name": "cpu-a", "agent": a.agent_url, "vllm": a.api_url},
        {"name": "cpu-b", "agent": b.agent_url, "vllm": b.api_url},
    ]
    engines[0]["router"] = {"url": fleet.router_url, "restart": [sys.executable, "-c", resume]}
    engines[1]["router"] = {"url": fleet.router_url}
    config_path.write_text(
        yaml.safe_dump(
            {
                "database": db,
                "engines": engines,
                "rules": {"evaluation_interval": f"{int(INTERVAL * 1000)}ms"},
                # The hook is handed the incident (it runs nothing: the test runs the runbook).
                "automation": {"engine-stuck": "auto"},
            }
        ),
        encoding="utf-8",
    )
    config = load_config(config_path)
    store = Journal(config.database)
    hook = Fired()
    service = RulesService.from_config(config, store=store, hook=hook)
    evaluating = threading.Event()

    def evaluate() -> None:  # the service's cycle, every INTERVAL (as its scheduler runs it)
        while not evaluating.wait(INTERVAL):
            service.run_cycle()

    evaluator = threading.Thread(target=evaluate, daemon=True)
    catalog = catalog_with(
        tmp_path,
        "engine-stuck",
        steps=[
            {"action": "capture_diagnostics"},
            {"action": "drain", "params": {"wait_seconds": 2}},
            {
                "action": "restart_engine",
                "when": {"signal": "engine_stalled", "above": 0, "after_seconds": 2},
            },
            {"action": "wait_for_progress", "params": {"timeout_seconds": 60}},
            {"action": "undrain"},
        ],
    )
    executor = Executor(
        store,
        load_catalog([catalog]),
        routers=router_bindings(config.engines),
        poll_seconds=0.2,
    )

    clients = Clients(fleet)
    probed: list[int] = []
    probe = threading.Thread(target=lambda: probed.append(clients.probe()))
    threads = [threading.Thread(target=clients.run, args=(i,)) for i in range(CLIENTS)]
    served_before = {"a": served_total(a), "b": served_total(b)}
    router = VllmRouter(fleet.router_url)
    evaluator.start()
    try:
        for t in threads:
            t.start()
        time.sleep(3)  # both engines serve
        assert served_total(a) > served_before["a"] and served_total(b) > served_before["b"]

        pause_sent = time.time()
        assert post(a.api_url + "/pause?mode=keep", timeout=30) == 200
        stalled_at = time.time()
        frozen = served_total(a)
        assert http_get(a.api_url + "/health")[0] == 200  # the router keeps routing to it

        limit = STALL_SECONDS + RULE_FOR + 2 * INTERVAL
        assert hook.event.wait(limit + 30), "VllmEngineStuck did not fire"
        _, handoff = hook.calls[0]
        detect = handoff.incident.at - stalled_at
        assert (handoff.incident.alert, handoff.engine_name) == ("VllmEngineStuck", "cpu-a")
        # No timing bound above (a loaded CI machine delays the evaluator): the
        # wait above is the deadline; below, the rule held its `for:` (the
        # engine stepped until the pause was sent, so the heartbeat's age
        # passed STALL_SECONDS after that, and `for:` ran from there).
        assert handoff.incident.at - pause_sent >= RULE_FOR
        assert agent_value(a, M.ENGINE_STALLED) == 1.0
        assert agent_value(b, M.ENGINE_STALLED) == 0.0
        assert http_get(a.api_url + "/health")[0] == 200
        assert served_total(a) == frozen  # stuck: nothing finished since the pause

        # The runbook, in a thread: this one watches the router meanwhile.
        results: list[Any] = []
        run = threading.Thread(
            target=lambda: results.append(executor.execute("engine-stuck", a.agent_url))
        )
        started = time.time()
        run.start()
        routed_while: list[list[str]] = []
        drained_at: float | None = None
        counts_at_drain: dict[str, float] = {}
        while run.is_alive():
            workers = router.workers()
            routed_while.append(workers)
            if drained_at is None and a.api_url not in workers:
                drained_at = time.time()
                counts_at_drain = {"a": served_total(a), "b": served_total(b)}
                # Routed now, while the router lists B alone (the undrain is seconds
                # away: the drain's wait and the restart's after_seconds): B serves it.
                probe.start()
            time.sleep(0.1)
        run.join()
        undrained_at = time.time()
        counts_at_undrain = {"a": served_total(a), "b": served_total(b)}
        # Traffic on both again: until each engine finished a request after the undrain
        # (by the counters, not a fixed sleep: a loaded machine serves slower).
        back_by = time.monotonic() + 120
        while time.monotonic() < back_by and not (
            served_total(a) > counts_at_undrain["a"] and served_total(b) > counts_at_undrain["b"]
        ):
            time.sleep(0.2)
    finally:
        clients.stop.set()
        post(a.api_url + "/resume", timeout=30)  # whatever failed: no client waits on A
        for t in [*threads, *([probe] if probe.ident is not None else [])]:
            t.join(180)
        evaluating.set()
        evaluator.join(30)
        service.close()
    hung = [t for t in threads if t.is_alive()]
    served_after = {"a": served_total(a), "b": served_total(b)}

    [result] = results
    record = result.record
    steps = {s.action: s for s in record.steps}
    summary = (
        f"\nVllmEngineStuck: pause -> firing {detect:.1f} s (limit {limit:g} s); "
        f"runbook {undrained_at - started:.1f} s; drain step "
        f"{json.dumps(steps['drain'].after) if 'drain' in steps else '-'}; "
        f"served a/b during the drain: "
        f"{counts_at_undrain['a'] - counts_at_drain.get('a', 0):g}/"
        f"{counts_at_undrain['b'] - counts_at_drain.get('b', 0):g}; "
        f"requests {clients.sent}, statuses {sorted(set(clients.statuses))}, "
        f"failures {len(clients.failures)}"
    )
    with capsys.disabled():
        print(summary)
    assert record.status == ExecutionStatus.SUCCEEDED, (result.message, summary)
    assert [s.action for s in record.steps] == [
        "capture_diagnostics",
        "drain",
        "restart_engine",
        "wait_for_progress",
        "undrain",
    ]
    assert all(s.status == STEP_APPLIED for s in record.steps), record.steps
    assert steps["drain"].before == {"routed": True} and steps["drain"].after is not None
    assert steps["drain"].after["routed"] is False
    # The drain's bound passed with A's requests still in it: it was stuck.
    assert steps["drain"].after["in_flight_left"] >= 1
    # Between drain and undrain the router never listed A; it does at the end.
    assert drained_at is not None
    assert any(a.api_url not in w for w in routed_while)
    assert router.workers().count(a.api_url) == 1
    # Nothing lost, nothing hung: every request answered with a status, and the
    # engines' own counters add up to the 200s exactly.
    assert not hung and not clients.failures, clients.failures[:3]
    assert len(clients.statuses) == clients.sent
    ok = clients.statuses.count(200)
    assert ok == clients.sent  # none refused either, here
    # Traffic moved: a request sent while the router listed B alone was answered.
    assert probed == [200]
    assert (served_after["a"] - served_before["a"]) + (
        served_after["b"] - served_before["b"]
    ) == ok + 1  # the probe
    assert served_after["b"] > counts_at_drain["b"]
    # A serves again after the undrain (and B still does).
    assert served_after["a"] > counts_at_undrain["a"]
    assert served_after["b"] > counts_at_undrain["b"]
    assert agent_value(a, M.ENGINE_STALLED) == 0.0


def test_the_last_healthy_engine_is_never_drained(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    router = VllmRouter(fleet.router_url)
    client = EngineClient(a.agent_url)
    engines = [
        {"name": "cpu-a", "agent": a.agent_url, "vllm": a.api_url,
         "router": {"url": fleet.router_url}},
        {"name": "cpu-b", "agent": b.agent_url, "vllm": b.api_url,
         "router": {"url": fleet.router_url}},
    ]  # fmt: skip
    bindings = router_bindings([EngineConfig.model_validate(e) for e in engines])
    began: list[dict[str, Any]] = []
    ctx = ActionContext(
        client,
        client.state(),
        False,
        lambda before, details: began.append(before),
        a.api_url,
        router=bindings[a.agent_url],
    )
    router.remove(b.api_url)
    try:
        with pytest.raises(RouterError, match="last healthy engine"):
            drain(Drain(), ctx)
    finally:
        router.add(b.api_url)
    assert began == []  # refused before anything was journaled or changed
    assert sorted(router.workers()) == sorted([a.api_url, b.api_url])


def test_a_revert_routes_to_a_drained_engine_again(fleet: Fleet, tmp_path: Path) -> None:
    a, b = fleet.a, fleet.b
    db = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(db)
    store = Journal(db)
    routed = {"url": fleet.router_url}
    engines = [
        EngineConfig.model_validate(
            {"name": n, "agent": e.agent_url, "vllm": e.api_url, "router": routed}
        )
        for n, e in (("cpu-a", a), ("cpu-b", b))
    ]
    catalog = catalog_with(
        tmp_path, "engine-stuck", steps=[{"action": "drain", "params": {"wait_seconds": 0}}]
    )
    executor = Executor(store, load_catalog([catalog]), routers=router_bindings(engines))
    router = VllmRouter(fleet.router_url)
    result = executor.execute("engine-stuck", a.agent_url)
    assert result.record.status == ExecutionStatus.SUCCEEDED, result.message
    assert router.workers() == [b.api_url]
    reverted = executor.revert(result.record.id)
    assert reverted.record.status == ExecutionStatus.SUCCEEDED, reverted.message
    assert [(s.action, s.status, s.after) for s in reverted.record.steps] == [
        ("revert_drain", STEP_APPLIED, {"routed": True})
    ]
    assert sorted(router.workers()) == sorted([a.api_url, b.api_url])
    assert store.get_execution(result.record.id).status == ExecutionStatus.REVERTED
