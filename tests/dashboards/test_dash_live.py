"""Every query of every dashboard against a real Prometheus scraping a real engine.

The setup is the end-to-end one: vLLM's OpenAI server (its own `vllm:*`
series) with the vllm-runbook agent in its EngineCore, scraped by Debian's
Prometheus with the checked-in prometheus.yml (targets swapped for the test's
ports, 1 s intervals) and the checked-in rule file. A few clients keep the
engine busy while `runbook set` / `runbook restore` move the knobs, so the
knob panels and the annotations have a step to show.

The queries that read `runbook serve`'s own series (runbook activity, the
firing incidents, the executions annotation) are left to the end-to-end test
(tests/service/test_service_e2e.py), which runs every query of every
dashboard over its run, where a real alert makes the real service act on the
engine; this Prometheus scrapes no service.

The engine-overview panels are also drawn from the real data into PNGs under
artifacts/dashboards/ (there is no Grafana here). Set
VLLM_RUNBOOK_WRITE_DOCS_PNG=1 to refresh docs/engine-overview.png too.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_runbook.collector import metrics as M
from vllm_runbook.dashboards import lint
from vllm_runbook.dashboards.definitions import DASHBOARDS
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR
from vllm_runbook.rules.promql import dump_yaml
from vllm_runbook.rules.slo import SloSpec, slo_rule_groups

from tests.dashboards.live import (
    MODEL,
    advisory_only,
    finite,
    gpu_only,
    is_finding,
    needs_vllm_option,
    only_while_stalled,
    substitute,
    uses_service,
)
from tests.dashboards.live import load as lint_load
from tests.engines import PrometheusServer, ServedEngine, require_tool, runbook_cli

pytestmark = [pytest.mark.engine, pytest.mark.served, pytest.mark.service]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "dashboards"
LOAD_SECONDS = 20.0
SERVICE_JOB = "runbook-serve"


@dataclass
class LiveRun:
    start: float
    end: float
    gpu: bool
    instant: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # expr -> result
    ranges: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # expr -> matrix
    series: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # variable expr
    rules: list[dict[str, Any]] = field(default_factory=list)
    instances: dict[str, set[str]] = field(default_factory=dict)  # job -> instance labels
    failed_scrapes: dict[str, int] = field(default_factory=dict)  # job -> failed scrapes


# The SLO row reads the records of a configuration's slos: the live Prometheus
# loads them beside the checked-in rule file.
SLOS = [
    SloSpec(name="ttft", objective="ttft", threshold=1.0, target=0.99),
    SloSpec(name="available", objective="availability", target=0.999),
]


def prometheus_config(addresses: dict[str, str], slo_rules: Path | None = None) -> str:
    """The checked-in prometheus.yml with the test's targets and 1 s intervals,
    without the service's job (see the docstring); `slo_rules` loaded too."""
    doc = yaml.safe_load((DASHBOARDS_DIR / "prometheus.yml").read_text())
    doc["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    doc["rule_files"] = [str(DASHBOARDS_DIR / f) for f in doc["rule_files"]]
    if slo_rules is not None:
        doc["rule_files"].append(str(slo_rules))
    doc.pop("alerting")
    assert {job["job_name"] for job in doc["scrape_configs"]} == {*addresses, SERVICE_JOB}
    doc["scrape_configs"] = [j for j in doc["scrape_configs"] if j["job_name"] != SERVICE_JOB]
    for job in doc["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [addresses[job["job_name"]]]
    return str(yaml.safe_dump(doc, sort_keys=False))


def _load(served: ServedEngine, stop: threading.Event, worker: int) -> int:
    n = 0
    while not stop.is_set():
        # Three prompt families: later requests of a family hit the prefix cache.
        served.complete(64 + 32 * (n % 4), max_tokens=16, offset=(worker + n) % 3)
        n += 1
    return n


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("dash-live")
    multiproc = tmp / "multiproc"
    multiproc.mkdir()
    stop = threading.Event()
    try:
        with ServedEngine.run(
            tiny_model,
            tmp / "serve.log",
            # vLLM then mirrors the agent's series on its /metrics too: the
            # checked-in config must drop them there (else the rules' sums double).
            env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc)},
            extra_args=["--served-model-name", MODEL],
        ) as served:
            addresses = {
                "vllm": served.api_url.removeprefix("http://"),
                "vllm-runbook-agent": served.agent_url.removeprefix("http://"),
            }
            slo_file = tmp / "slo-rules.yml"
            # the budget group at the test's 1 s interval too (1 m in an export)
            groups = slo_rule_groups(SLOS, budget_interval=1.0)
            slo_file.write_text(dump_yaml({"groups": groups}))
            config = prometheus_config(addresses, slo_file)
            with PrometheusServer.run(config, tmp / "prometheus", prometheus) as prom:
                run = _drive_and_collect(served, prom, stop)
    finally:
        stop.set()
    # Everything started above is stopped: the tests only read what was collected.
    yield run


def _drive_and_collect(
    served: ServedEngine, prom: PrometheusServer, stop: threading.Event
) -> LiveRun:
    start = time.time()
    with ThreadPoolExecutor(3) as pool:
        workers: list[Future[int]] = [pool.submit(_load, served, stop, i) for i in range(3)]
        try:
            run = _collect(served, prom, start)
        finally:
            stop.set()  # the workers end, or the pool would wait for them forever
        requests = sum(w.result(timeout=120) for w in workers)
    assert requests > 10, f"only {requests} requests finished under load"
    return run


def _last_complete_scrape(prom: PrometheusServer, start: float) -> tuple[float, dict[str, int]]:
    """The latest time at which every job's latest scrape had succeeded, and
    each job's failed scrapes so far.

    One failed scrape (a 1 s timeout on a loaded 2-core machine) writes
    staleness markers for every series of its target: until the next scrape,
    an instant query sees none of them, as Grafana would show a gap. The
    instant queries are asked at this time instead of "now". Scrapes that
    started up to `scrape_timeout` ago are still being written, so the
    search ends 2 s back."""
    now = time.time()
    frame = prom.query_range("min(up)", start, now - 2.0, 0.1)
    ok = [float(t) for t, v in frame[0]["values"] if float(v) == 1.0] if frame else []
    since = f"{now - start:.0f}s"  # `up` is 1 or 0: its samples less its sum are the failures
    failed = {
        s["metric"]["job"]: int(float(s["value"][1]))
        for s in prom.query(
            f"sum by (job) (count_over_time(up[{since}]) - sum_over_time(up[{since}]))", time=now
        )
    }
    assert ok, f"no time since the start with every scrape up; failed scrapes: {failed}"
    return ok[-1], failed


def _collect(served: ServedEngine, prom: PrometheusServer, start: float) -> LiveRun:
    # A `runbook` command takes seconds on a busy machine: time the phases
    # from when each command returned, so every phase is long enough to see.
    time.sleep(6)
    cli = runbook_cli("set", "--engine", served.agent_url, "max_num_batched_tokens=x0.5",
                      "max_num_seqs=16", "policy=priority")  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    time.sleep(6)
    cli = runbook_cli("restore", "--engine", served.agent_url)
    assert cli.returncode == 0, cli.stderr
    time.sleep(max(6.0, LOAD_SECONDS - (time.time() - start)))
    # Queried while the load goes on: rates over the last seconds have data.
    end, failed = _last_complete_scrape(prom, start)
    nvml = prom.query("max(vllm_runbook_nvml_up)", time=end)
    run = LiveRun(start, end, gpu=bool(nvml and float(nvml[0]["value"][1]) == 1))
    run.failed_scrapes = failed
    for name in DASHBOARDS:
        dashboard = lint_load(name)
        for q in lint.queries(dashboard):
            if uses_service(q.expr):
                continue
            expr = substitute(q.expr)
            if q.kind == "variable":
                run.series[expr] = list(prom.api("series", **{"match[]": expr}))
            elif q.kind == "annotation":
                run.ranges[expr] = prom.query_range(expr, start, run.end, 1)
            else:
                run.instant[expr] = prom.query(expr, time=run.end)
                if name == "engine-overview.json":
                    run.ranges[expr] = prom.query_range(expr, start - 2, run.end, 1)
    run.rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    for job in ("vllm", "vllm-runbook-agent"):
        found = prom.query(f'count by (instance) ({{job="{job}"}})', time=run.end)
        run.instances[job] = {s["metric"]["instance"] for s in found}
    doubled = prom.query(f'{M.COLLECTOR_UP.name}{{job="vllm"}}', time=run.end)
    run.instances["agent series on the vllm job"] = {s["metric"]["instance"] for s in doubled}
    return run


def test_every_dashboard_query_returns_data(live: LiveRun) -> None:
    missing = []
    checked = 0
    for name in DASHBOARDS:
        for q in lint.queries(lint_load(name)):
            if uses_service(q.expr):
                continue  # checked by the end-to-end test
            expr = substitute(q.expr)
            if q.kind == "variable":
                ok = bool(live.series[expr])
            elif (
                is_finding(q)
                or needs_vllm_option(q.expr)
                or advisory_only(q.expr)
                or only_while_stalled(q.expr)
            ):
                # ran without an error; empty while healthy, or without the vLLM option
                ok = expr in (live.ranges if q.kind == "annotation" else live.instant)
            elif q.kind == "annotation":
                ok = finite(live.ranges[expr])
            else:
                if gpu_only(q.panel) and not live.gpu:
                    continue  # NVML series exist only with an NVIDIA GPU
                ok = finite(live.instant[expr])
            checked += 1
            if not ok:
                missing.append(f"{name}: {q.where}: {expr}")
    assert not missing, f"no data (failed scrapes: {live.failed_scrapes}):\n" + "\n".join(missing)
    assert checked > 80


def test_variables_offer_the_engine(live: LiveRun) -> None:
    labels = [s for result in live.series.values() for s in result]
    assert {s["model_name"] for s in labels} == {MODEL}
    assert {s["engine"] for s in labels} == {"0"}


def test_both_targets_of_the_engine_share_instance_and_agent_series_are_not_doubled(
    live: LiveRun,
) -> None:
    assert live.instances["vllm"] == live.instances["vllm-runbook-agent"] == {"127.0.0.1:8000"}
    assert live.instances["agent series on the vllm job"] == set()


def test_prometheus_evaluates_every_exported_rule_without_error(live: LiveRun) -> None:
    assert len(live.rules) >= 17
    bad = [(r["name"], r.get("lastError")) for r in live.rules if r["health"] != "ok"]
    assert not bad


def test_knob_change_shows_as_a_step_and_an_annotation(live: LiveRun) -> None:
    dashboard = lint_load("engine-overview.json")
    budget = next(p for p in lint.panels(dashboard) if p["title"].startswith("Token budget ("))
    (series,) = live.ranges[substitute(budget["targets"][0]["expr"])]
    values = [float(v) for _, v in series["values"]]
    assert max(values) == 512 and min(values) == 256  # halved, then restored
    knob_annotation = dashboard["annotations"]["list"][1]
    assert knob_annotation["name"] == "Knob changes"
    assert finite(live.ranges[substitute(knob_annotation["expr"])])


def test_engine_overview_panels_drawn_from_real_data(live: LiveRun) -> None:
    try:
        import matplotlib
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("matplotlib missing: install the `plots` extra")
        pytest.skip("matplotlib missing (pip install -e '.[plots]')")
    matplotlib.use("Agg")
    from tests.dashboards.draw import draw_dashboard

    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    dashboard = lint_load("engine-overview.json")
    composite, singles = draw_dashboard(
        dashboard, live.ranges, substitute, ARTIFACTS, live.start - 2, live.end
    )
    panels = [p for p in lint.panels(dashboard) if p["type"] != "row"]
    assert len(singles) == len(panels)
    for path in [composite, *singles]:
        # A PNG with axes and a line; a flat one-value panel (uptime) draws
        # under 5 kB, an empty figure under 1 kB.
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert path.stat().st_size > 2_000, path
    if os.environ.get("VLLM_RUNBOOK_WRITE_DOCS_PNG"):
        shutil.copy(composite, REPO / "docs" / "engine-overview.png")
