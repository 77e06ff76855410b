"""Running the dashboards' queries against a real Prometheus, the way Grafana would.

Two live tests share this. tests/service/test_service_e2e.py runs every query
of every dashboard over the time range of the end-to-end run, where a real
alert makes the real `runbook serve` act on a real engine (graphs as range
queries, tables at the end). tests/dashboards/test_dash_live.py runs the
queries on the engine's series at the end of a steady load, when every rate
and ratio has recent samples; it scrapes no service (`uses_service`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_runbook.collector import metrics as M
from vllm_runbook.dashboards import catalog, lint
from vllm_runbook.dashboards.definitions import DASHBOARDS
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR
from vllm_runbook.runbooks.service.metric_specs import SERVICE_METRICS

from tests.engines import PrometheusServer

MODEL = "tiny-llama"
# What Grafana would put in for a 1 s scrape interval and a short time range.
GRAFANA_VARIABLES = {
    "model_name": MODEL,
    "engine": "0",
    "__rate_interval": "10s",
    "__interval": "5s",
    "__range": "60s",
}
_VARIABLE = re.compile(r"\$(\w+)")
SERVICE_SERIES = frozenset(catalog.known_series(SERVICE_METRICS))
VLLM_OPTIONAL_SERIES = frozenset(catalog.known_series(catalog.VLLM_OPTIONAL))


def substitute(expr: str, values: Mapping[str, str] = GRAFANA_VARIABLES) -> str:
    return _VARIABLE.sub(lambda m: values[m.group(1)], expr)


def finite(result: list[dict[str, Any]]) -> bool:
    """Some series has a finite value (instant vector or matrix)."""
    for series in result:
        points = series.get("values") or [series.get("value")]
        if any(p and math.isfinite(float(p[1])) for p in points):
            return True
    return False


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((DASHBOARDS_DIR / name).read_text()))


def uses_service(expr: str) -> bool:
    """The query reads a series of `runbook serve` (runbooks/service/metric_specs.py)."""
    return bool(lint.metric_names(expr) & SERVICE_SERIES)


def needs_vllm_option(expr: str) -> bool:
    """The query reads only vLLM series that an option of vLLM turns on
    (catalog.VLLM_OPTIONAL: --kv-cache-metrics, speculative decoding), which the
    test engines run without."""
    names = lint.metric_names(expr)
    return bool(names) and names <= VLLM_OPTIONAL_SERIES


def gpu_only(panel: Mapping[str, Any] | None) -> bool:
    return bool(panel) and str(panel.get("description", "")).startswith("GPU-only")  # type: ignore[union-attr]


SLO_SERIES = frozenset(catalog.known_series(catalog.SLO_SERIES))


def uses_slo_rules(expr: str) -> bool:
    """The query reads what an SLO rule file records (test_dash_live loads one)."""
    return bool(lint.metric_names(expr) & SLO_SERIES)


def advisory_only(expr: str) -> bool:
    """The query reads only what an autopilot in advisory mode exports, which
    the test engines run without (tests/engine/test_autopilot_engine.py reads it)."""
    names = lint.metric_names(expr)
    return bool(names) and names <= {M.AUTOPILOT_ADVISED_MAX_NUM_SEQS.name}


def only_while_stalled(expr: str) -> bool:
    """The query reads only the stall reason, filtered to the one that holds
    (`> 0`): no data while the engine steps (tests/engine/test_router_served.py
    stalls one and reads it)."""
    names = lint.metric_names(expr)
    return bool(names) and names <= {M.ENGINE_STALL_REASON.name}


def is_finding(q: lint.Query) -> bool:
    """A finding annotation: it marks where a queue-health rule's condition
    holds, so a healthy run has no data for it (Prometheus still parses and
    runs the query); so are the firing alerts (ALERTS)."""
    if catalog.ALERTS.name in lint.metric_names(q.expr):
        return True
    return q.kind == "annotation" and q.where.startswith("annotation 'Finding ")


def every_query(select: Callable[[str, lint.Query], bool]) -> list[tuple[str, lint.Query]]:
    """(dashboard file, query) for every query of every dashboard that `select` takes."""
    return [(name, q) for name in DASHBOARDS for q in lint.queries(load(name)) if select(name, q)]


@dataclass
class TimeRangeResults:
    """Each query as a Grafana panel over [start, end] would run it."""

    start: float
    end: float
    values: dict[str, str]
    series: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # variables
    instant: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # at `end`
    # Every panel target and annotation over the range (instant targets too: to draw them).
    ranges: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def expr(self, q: lint.Query | str) -> str:
        return substitute(q if isinstance(q, str) else q.expr, self.values)

    def has_data(self, q: lint.Query) -> bool:
        expr = self.expr(q)
        if q.kind == "variable":
            return bool(self.series[expr])
        return finite(self.instant[expr] if q.instant else self.ranges[expr])


def run_over_time_range(
    prom: PrometheusServer,
    queries: list[tuple[str, lint.Query]],
    start: float,
    end: float,
) -> TimeRangeResults:
    """Range queries for graph targets and annotations, instant ones at `end` for
    instant targets (tables, stats), series lookups for variables; `$__range`
    is the whole time range, as in Grafana."""
    values = {**GRAFANA_VARIABLES, "__range": f"{math.ceil(end - start)}s"}
    run = TimeRangeResults(start, end, values)
    for _, q in queries:
        expr = run.expr(q)
        if q.kind == "variable":
            run.series[expr] = list(prom.api("series", **{"match[]": expr}))
            continue
        if q.instant:
            run.instant[expr] = prom.query(expr, time=end)
        run.ranges[expr] = prom.query_range(expr, start, end, 1)
    return run
