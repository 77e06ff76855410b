"""End to end, all real processes on loopback: a vLLM CPU engine with the plugin,
Debian's Prometheus (the generated rules, short `for` and window) and
Alertmanager (the checked-in config, short timers) routing to `runbook serve`.

A workload fills the small KV cache: VllmOOMPressure fires, oom-pressure runs
(the budget halves, then max_num_seqs is capped because preemptions go on),
preemptions fall; once the fix is judged the burst ends (its requests are
aborted), the alert resolves and the revert restores the knobs of an engine at
rest (under the burst its first stage would bring the storm back and the
stepwise revert would halt, as it should).
Twice, on the same engine, with a fresh journal each time (the cooldown is
per journal):
  (a) Prometheus -> Alertmanager -> webhook (`runbook serve --no-rules`);
  (b) the embedded evaluator of `runbook serve` (Alertmanager not involved).
The test prints, for both, the time from the first preemption to the knob change.

The same Prometheus scrapes the engine and the service through both paths;
at the end, while (b) still runs, every query of every dashboard is run
against it over the test's time range and must have data: this is what an
operator's Grafana would show of the two remediations. For the
rejected-webhook and scrape-error panels to show real events, (a) also
receives two bad deliveries and (b)'s inventory holds an engine that is down.
The runbook-activity panels are drawn into artifacts/runbook-activity/.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.tiny_model import prompt_token_ids
from vllm_runbook.dashboards import lint
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.promql import export
from vllm_runbook.runbooks.store.models import STEP_APPLIED, ExecutionStatus

from tests.dashboards.live import (
    MODEL,
    TimeRangeResults,
    advisory_only,
    every_query,
    gpu_only,
    is_finding,
    needs_vllm_option,
    only_while_stalled,
    run_over_time_range,
    uses_service,
    uses_slo_rules,
)
from tests.dashboards.live import load as load_dashboard
from tests.engines import (
    REPO_ROOT,
    PrometheusServer,
    ServedEngine,
    free_port,
    http_get,
    require_tool,
)
from tests.service.processes import AlertmanagerServer, RunbookServe, alertmanager_config

pytestmark = [pytest.mark.engine, pytest.mark.served, pytest.mark.service]

TOKEN = "e2e-webhook-token"
OVERRIDES = {"VllmOOMPressure": {"for": "2s", "window": "30s"}}
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 64, 300, 300
STARTUP = {"max_num_batched_tokens": 512, "max_num_seqs": 32}
FINAL = (ExecutionStatus.SUCCEEDED, "failed", "rolled_back", ExecutionStatus.REFUSED)
ARTIFACTS = REPO_ROOT / "artifacts" / "runbook-activity"
DEAD_ENGINE = "gone-0"
ACTIVITY = "runbook-activity.json"
HAVE_GPU = shutil.which("nvidia-smi") is not None


def checked_here(name: str, q: lint.Query) -> bool:
    """Every query of every dashboard, except: GPU-only panels without a GPU (NVML
    series exist only there), and the hit-ratio table evaluated at the end, when
    this engine has been idle for longer than its 5 s window: a ratio of no
    lookups is NaN. tests/dashboards/test_dash_live.py checks that one at the
    end of a steady load."""
    if gpu_only(q.panel) and not HAVE_GPU:
        return False
    if needs_vllm_option(q.expr):
        return False  # vLLM runs here without --kv-cache-metrics and speculative decoding
    if advisory_only(q.expr):
        return False  # its autopilot is not in advisory mode (test_autopilot_engine.py)
    if only_while_stalled(q.expr):
        return False  # no engine stalls here (tests/engine/test_router_served.py)
    if "detection_to_action_unmeasured" in q.expr:
        return False  # no alert here has a clock out of range (test_service_clocks.py)
    if is_finding(q):
        return False  # a queue-health condition: no data while healthy (test_dash_live)
    if uses_slo_rules(q.expr):
        return False  # this Prometheus loads no SLO (test_dash_live does)
    if "breaker_trips_total" in q.expr:
        return False  # no change here trips the breaker (tests/executor/test_breaker_engine.py)
    if "reverts_premature_total" in q.expr:
        return False  # no revert here is premature (tests/service/test_service_worker.py)
    return not (q.instant and lint.metric_names(q.expr) == {M.KV_HIT_RATIO.name})


@dataclass
class Sample:
    at: float
    preemptions: float
    knobs: dict[str, Any]


class AgentWatch:
    """Polls the agent's /v1/state every 0.1 s: preemptions and knobs over time."""

    def __init__(self, agent_url: str) -> None:
        self.url = agent_url + "/v1/state"
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AgentWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            status, body = http_get(self.url, timeout=5)
            if status == 200:
                state = json.loads(body)
                self.samples.append(
                    Sample(time.time(), state["stats"]["preemptions_total"], state["knobs"])
                )

    def first_preemption(self, since: float) -> float:
        """Time of the first sample after `since` with more preemptions than before it."""
        base = [s.preemptions for s in self.samples if s.at <= since][-1]
        return next(s.at for s in self.samples if s.at > since and s.preemptions > base)

    def preemptions_between(self, start: float, end: float) -> float:
        inside = [s.preemptions for s in self.samples if start <= s.at <= end]
        return inside[-1] - inside[0] if inside else 0.0

    def budgets_since(self, since: float) -> set[int]:
        return {s.knobs["max_num_batched_tokens"] for s in self.samples if s.at >= since}


@dataclass
class PathResult:
    name: str
    first_preemption: float
    execution: dict[str, Any]
    reverted_by: dict[str, Any]
    others: list[dict[str, Any]]
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def ts(self, text: str) -> float:
        return datetime.fromisoformat(text).timestamp()

    @property
    def knob_change(self) -> float:
        step = next(s for s in self.execution["steps"] if s["status"] != "skipped")
        return self.ts(step["finished_at"])

    def line(self) -> str:
        e = self.execution
        t0 = self.first_preemption
        return (
            f"{self.name}: first preemption -> knob change {self.knob_change - t0:.2f} s "
            f"(alert startsAt {self.ts(e['alert_starts_at']) - t0:+.2f} s, execution recorded "
            f"{self.ts(e['created_at']) - t0:+.2f} s, budget halved "
            f"{self.knob_change - t0:+.2f} s; verification {e['verification']['before']:g} -> "
            f"{e['verification']['after']:g} preemptions/min)"
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get((name, tuple(sorted(labels.items()))), 0.0)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """`name`'s samples summed by one label."""
        out: dict[str, float] = {}
        for (n, labels), value in self.metrics.items():
            if n == name:
                key = dict(labels)[label]
                out[key] = out.get(key, 0.0) + value
        return out


class Burst:
    """The workload: `n` completions at once, each on a connection of its own, so
    that stop() can end the burst; vLLM aborts a request whose client went away."""

    def __init__(self, served: ServedEngine, n: int, prompt: int, output: int) -> None:
        self.url = urllib.parse.urlsplit(served.api_url)
        self.model = served.model_id()
        self.requests = [(prompt, output, 17 * i) for i in range(n)]
        self.connections: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.pool = ThreadPoolExecutor(n)
        self.futures: list[Future[bool]] = []

    def __enter__(self) -> Burst:
        self.futures = [self.pool.submit(self._one, *r) for r in self.requests]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        done = [f.result(timeout=120) for f in self.futures]
        self.pool.shutdown()
        assert any(done), "no request of the burst completed"

    def _one(self, prompt: int, output: int, offset: int) -> bool:
        """True when the completion came back, False when stop() ended it."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt_token_ids(prompt, offset),
                "max_tokens": output,
                "ignore_eos": True,
                "temperature": 0,
            }
        )
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=300)
        with self.lock:
            if self.stopped:
                return False
            self.connections.append(conn)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200, data[:300]
            return True
        except (OSError, http.client.HTTPException):
            if self.stopped:
                return False
            raise
        finally:
            conn.close()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for conn in self.connections:
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)


def idle(watch: AgentWatch) -> bool:
    status, body = http_get(result_agent(watch) + "/v1/state", timeout=5)
    if status != 200:
        return False
    stats = json.loads(body)["stats"]
    return stats["requests_running"] == 0 and stats["requests_waiting"] == 0


def wait_until(what: str, probe: Callable[[], Any], limit: float) -> Any:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        found = probe()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {limit:g} s")


def service_config(tmp: Path, name: str, served: ServedEngine, rules: bool) -> Path:
    engines: list[dict[str, Any]] = [
        {
            "name": "cpu-0",
            "agent": served.agent_url,
            # The alert's `instance` (Prometheus relabels both targets to vLLM's address).
            "labels": {"instance": served.api_url.removeprefix("http://")},
        }
    ]
    if rules:
        # Down for good: the embedded evaluator counts its failed scrapes.
        engines.append({"name": DEAD_ENGINE, "agent": f"http://127.0.0.1:{free_port()}"})
    doc: dict[str, Any] = {
        "database": f"sqlite:///{tmp / f'{name}.db'}",
        "engines": engines,
        "automation": {"oom-pressure": "auto"},
        "webhook": {"token_file": str(tmp / "webhook.token")},
        # A receiver that is down: every execution event is a failed delivery,
        # so the notification panels show real events.
        "notifications": {
            "receivers": [
                {"name": "down", "type": "webhook", "url": f"http://127.0.0.1:{free_port()}/"}
            ],
            "retries": 0,
            "timeout": "1s",
        },
        "executor": {
            "verify_seconds": "20s",
            "condition_seconds": "3s",
            "healthy_period_seconds": "1s",
            # The hold itself is tested in test_exec_hold.py and the matrix.
            "hold_seconds": "2s",
        },
    }
    if rules:
        doc["rules"] = {"evaluation_interval": "1s", "overrides": OVERRIDES}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def prometheus_config(served: ServedEngine, rule_file: Path, am: str, service: str) -> str:
    """The checked-in prometheus.yml: the test's targets, 1 s intervals, the test's rules."""
    doc = yaml.safe_load((DASHBOARDS_DIR / "prometheus.yml").read_text())
    doc["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    doc["rule_files"] = [str(rule_file)]
    doc["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am]
    api = served.api_url.removeprefix("http://")
    targets = {
        "vllm": api,
        "vllm-runbook-agent": served.agent_url.removeprefix("http://"),
        "runbook-serve": service,
    }
    for job in doc["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [targets[job["job_name"]]]
            if "labels" in static:
                static["labels"]["__engine_instance"] = api
    return str(yaml.safe_dump(doc, sort_keys=False))


def one_path(
    name: str,
    served: ServedEngine,
    watch: AgentWatch,
    config: Path,
    tmp: Path,
    *args: str,
    port: int | None = None,
    at_start: Callable[[RunbookServe], None] = lambda svc: None,
    at_end: Callable[[RunbookServe], None] = lambda svc: None,
) -> PathResult:
    with RunbookServe.run(config, tmp / f"serve-{name}.log", *args, port=port) as svc:
        at_start(svc)
        time.sleep(2)  # quiet scrapes first: the counters' baselines
        start = time.time()
        with Burst(served, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS) as burst:

            def acted() -> dict[str, Any] | None:
                rows = svc.get("/api/executions")
                first = [r for r in rows if r["runbook"] == "oom-pressure" and not r["reverts_id"]]
                return first[-1] if first and first[-1]["status"] in FINAL else None

            execution = wait_until(f"{name}: oom-pressure finished", acted, 150)
            # The burst ends once the fix is judged. Under the burst, the revert's
            # first stage brings the storm back, and the stepwise revert rightly
            # halts ("got worse"); the window (OVERRIDES) keeps the alert firing
            # 30 s past the last preemption, which outlasts the verification.
            burst.stop()
        wait_until(f"{name}: the engine idle", lambda: idle(watch), 60)
        first_preemption = watch.first_preemption(start)

        def reverted() -> list[dict[str, Any]] | None:
            rows = svc.get("/api/executions")
            done = next(r for r in rows if r["id"] == execution["id"])
            revert = next((r for r in rows if r["reverts_id"] == execution["id"]), None)
            # The original says reverted before the revert execution finishes.
            finished = revert is not None and revert["status"] in FINAL
            if done["status"] != ExecutionStatus.REVERTED or not finished:
                return None
            # The worker counts the revert once the revert has returned, just
            # after the journal says so: read the counts once they include it.
            return rows if reverted_counted(svc) else None

        rows = wait_until(f"{name}: revert after the alert resolved", reverted, 90)
        result = PathResult(
            name,
            first_preemption,
            execution,
            next(r for r in rows if r["reverts_id"] == execution["id"]),
            [r for r in rows if r["id"] != execution["id"] and r["reverts_id"] is None],
        )
        for family in text_string_to_metric_families(svc.metrics()):
            for s in family.samples:
                result.metrics[(s.name, tuple(sorted(s.labels.items())))] = s.value
        at_end(svc)
    return result


def reverted_counted(svc: RunbookServe) -> bool:
    for family in text_string_to_metric_families(svc.metrics()):
        for s in family.samples:
            if (
                s.name == "vllm_runbook_service_executions_total"
                and s.labels == {"runbook": "oom-pressure", "status": ExecutionStatus.REVERTED}
                and s.value >= 1
            ):
                return True
    return False


def check_remediation(result: PathResult, watch: AgentWatch) -> None:
    e = result.execution
    assert e["status"] == ExecutionStatus.SUCCEEDED, e
    applied = [s for s in e["steps"] if s["status"] == STEP_APPLIED]
    budget = next(s for s in applied if s["action"] == "scale_max_num_batched_tokens")
    assert (budget["before"], budget["after"]) == (
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 256},
    )
    # The engine said so too: its budget was 256 while the runbook held it.
    assert 256 in watch.budgets_since(result.first_preemption)
    # Preemptions fell (the verification read the agent before and after acting).
    v = e["verification"]
    assert v["outcome"] == "improved" and v["after"] < v["before"], v
    # Resolved -> reverted: every knob back at its startup value.
    assert result.reverted_by["status"] == ExecutionStatus.SUCCEEDED
    state = json.loads(http_get(result_agent(watch) + "/v1/state")[1])
    assert {k: state["knobs"][k] for k in STARTUP} == STARTUP
    # A repeat firing after the revert (the workload may still run) is inside the
    # cooldown: recorded as refused, nothing changed.
    for other in result.others:
        assert other["status"] in (ExecutionStatus.REFUSED, "pending"), other
        assert other["steps"] == []
    runs = "vllm_runbook_service_executions_total"
    assert result.metric(runs, runbook="oom-pressure", status=ExecutionStatus.SUCCEEDED) == 1
    assert result.metric(runs, runbook="oom-pressure", status=ExecutionStatus.REVERTED) == 1
    delay = "vllm_runbook_service_detection_to_action_seconds"
    assert result.metric(delay + "_count", runbook="oom-pressure") == 1
    knobs = "vllm_runbook_service_knob_changes_total"
    assert result.metric(knobs, engine="cpu-0", knob="max_num_batched_tokens") >= 2


def result_agent(watch: AgentWatch) -> str:
    return watch.url.removesuffix("/v1/state")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEngine]:
    tmp = tmp_path_factory.mktemp("e2e-engine")
    # A 5 s window for the agent's preemptions_per_minute: the verification sees
    # preemptions stop within seconds (the default 60 s outlasts the test).
    with ServedEngine.run(
        tiny_model,
        tmp / "engine.log",
        env={"VLLM_RUNBOOK_WINDOW_SECONDS": "5"},
        # The name the dashboards' $model_name is set to (tests/dashboards/live.py).
        extra_args=["--served-model-name", MODEL],
    ) as served:
        yield served


def post_bad_deliveries(prom: PrometheusServer) -> Callable[[RunbookServe], None]:
    """One delivery without the token, one that is not JSON: both refused, nothing stored.

    Sent once Prometheus has scraped the service's zeros: a counter whose first
    sample is already 1 shows no increase (the dashboards would miss them)."""
    rejected = 'vllm_runbook_service_webhooks_rejected_total{reason="auth"}'

    def post(svc: RunbookServe) -> None:
        wait_until("the service's first scrape", lambda: prom.query(rejected), 15)
        _post_bad_deliveries(svc)

    return post


def _post_bad_deliveries(svc: RunbookServe) -> None:
    url = svc.url + "/webhooks/alertmanager"
    bad = [
        ({"Content-Type": "application/json"}, b'{"version": "4"}', 401),
        (
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
            b"{not json",
            400,
        ),
    ]
    for headers, body, expected in bad:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == expected, (headers, body, status)


def test_alert_to_remediation_to_revert_both_paths(
    engine: ServedEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prometheus = require_tool("prometheus")
    alertmanager = require_tool("prometheus-alertmanager")
    (tmp_path / "webhook.token").write_text(TOKEN + "\n")
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(export(load_catalog(), OVERRIDES))
    port, am_port = free_port(), free_port()
    service = f"127.0.0.1:{port}"
    results = []
    dashboards: list[TimeRangeResults] = []
    start = time.time()
    # Service queries of every dashboard and the whole runbook-activity dashboard,
    # the way Grafana would run them over the test's time range.
    queries = every_query(checked_here)

    def scraped(prom: PrometheusServer) -> Callable[[RunbookServe], None]:
        """Before a service stops: Prometheus has scraped its final counts."""
        reverted = 'sum(vllm_runbook_service_executions_total{status="reverted"}) >= 1'
        return lambda svc: wait_until("the revert scraped", lambda: prom.query(reverted), 15)

    def query_dashboards(prom: PrometheusServer) -> Callable[[RunbookServe], None]:
        def run(svc: RunbookServe) -> None:
            scraped(prom)(svc)
            time.sleep(2)  # a second sample of it, for rate() and changes()
            dashboards.append(run_over_time_range(prom, queries, start, time.time()))

        return run

    with AgentWatch(engine.agent_url) as watch:
        # Prometheus outlives both paths: it scrapes both services (same port).
        prom_config = prometheus_config(engine, rule_file, f"127.0.0.1:{am_port}", service)
        with PrometheusServer.run(prom_config, tmp_path / "prom", prometheus) as prom:
            am_config = alertmanager_config(
                f"http://{service}/webhooks/alertmanager", tmp_path / "webhook.token"
            )
            with AlertmanagerServer.run(am_config, tmp_path / "am", alertmanager, port=am_port):
                config = service_config(tmp_path, "a", engine, rules=False)
                results.append(
                    one_path(
                        "(a) Prometheus -> Alertmanager -> webhook",
                        engine,
                        watch,
                        config,
                        tmp_path,
                        "--no-rules",
                        port=port,
                        at_start=post_bad_deliveries(prom),
                        at_end=scraped(prom),
                    )
                )
            # Alertmanager is gone: in (b) Prometheus's alerts reach nobody.
            config = service_config(tmp_path, "b", engine, rules=True)
            results.append(
                one_path(
                    "(b) embedded evaluator",
                    engine,
                    watch,
                    config,
                    tmp_path,
                    port=port,
                    at_end=query_dashboards(prom),
                )
            )
            seen = seen_by_prometheus(prom, time.time() - start)
    with capsys.disabled():
        print()
        for r in results:
            print(r.line())
    a, b = results
    for r in results:
        check_remediation(r, watch)
    assert a.execution["trigger"] == "alert"
    assert a.execution["who"] == "alertmanager:VllmOOMPressure"
    webhooks = "vllm_runbook_service_webhooks_received_total"
    assert a.metric(webhooks, status="firing") >= 1
    assert a.metric(webhooks, status="resolved") >= 1
    rejected = "vllm_runbook_service_webhooks_rejected_total"
    assert a.metric(rejected, reason="auth") == 1
    assert a.metric(rejected, reason="malformed") == 1
    assert (b.execution["trigger"], b.execution["who"]) == ("alert", "rules:VllmOOMPressure")
    assert b.metric("vllm_runbook_service_rule_evaluation_seconds_count") > 0
    assert b.metric(webhooks, status="firing") == 0  # Alertmanager not involved
    assert b.metric("vllm_runbook_service_incidents_firing", alert="VllmOOMPressure") == 0
    scrape_errors = b.by_label("vllm_runbook_service_scrape_errors_total", "target")
    assert scrape_errors[engine.agent_url + "/metrics"] == 0
    assert sum(scrape_errors.values()) > 0, "no failed scrape of the engine that is down"
    # What Prometheus saw of the service over both paths, as the dashboards read it.
    assert seen == {
        "executions succeeded": 2,
        "executions reverted": 2,
        "rejected auth": 1,
        "rejected malformed": 1,
        "dead engine scrape errors": True,
    }, seen
    check_dashboards(dashboards)


def seen_by_prometheus(prom: PrometheusServer, span: float) -> dict[str, Any]:
    window = f"{int(span) + 5}s"
    executions = "vllm_runbook_service_executions_total"
    rejected = "vllm_runbook_service_webhooks_rejected_total"

    def value(expr: str) -> float:
        result = prom.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    return {
        # Two service processes, one after the other: the counters restart at 0,
        # which increase() handles; round() undoes its extrapolation.
        "executions succeeded": round(
            value(
                f'sum(increase({executions}{{runbook="oom-pressure",status="succeeded"}}[{window}]))'
            )
        ),
        "executions reverted": round(
            value(
                f'sum(increase({executions}{{runbook="oom-pressure",status="reverted"}}[{window}]))'
            )
        ),
        "rejected auth": round(value(f'sum(increase({rejected}{{reason="auth"}}[{window}]))')),
        "rejected malformed": round(
            value(f'sum(increase({rejected}{{reason="malformed"}}[{window}]))')
        ),
        "dead engine scrape errors": value(
            f"sum(increase(vllm_runbook_service_scrape_errors_total[{window}]))"
        )
        > 0,
    }


def check_dashboards(dashboards: list[TimeRangeResults]) -> None:
    """Every query of every dashboard (see checked_here) had data over the test's time range."""
    [run] = dashboards
    queries = every_query(checked_here)
    missing = [f"{name}: {q.where}: {run.expr(q)}" for name, q in queries if not run.has_data(q)]
    assert not missing, "no data:\n" + "\n".join(missing)
    service = [q for _, q in queries if uses_service(q.expr)]
    assert len(service) >= 12 and len(queries) > 90
    try:
        import matplotlib
    except ImportError:
        if os.environ.get("CI"):
            raise AssertionError("matplotlib missing: install the `plots` extra") from None
        return
    matplotlib.use("Agg")
    from tests.dashboards.draw import draw_dashboard

    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    composite, _ = draw_dashboard(
        load_dashboard(ACTIVITY), run.ranges, run.expr, ARTIFACTS, run.start, run.end
    )
    assert composite.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("VLLM_RUNBOOK_WRITE_DOCS_PNG"):
        shutil.copy(composite, REPO_ROOT / "docs" / "runbook-activity.png")
