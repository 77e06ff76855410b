"""A small builder for Grafana dashboard JSON (schema 39, Grafana 10.4+/11).

Panels are described with plain dataclasses and laid out in rows; `dashboard`
numbers the panels, flows them on the 24-column grid and returns the dict
Grafana stores. Every query goes to the `${datasource}` variable, so the same
file works with any Prometheus data source (no `__inputs` to fill in).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_runbook.collector.metrics import MetricSpec
from vllm_runbook.rules.signals import ENGINE_LABELS

SCHEMA_VERSION = 39
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24
# Grafana multi-value variables become a regex alternation with `=~`.
ENGINE_MATCHERS: tuple[tuple[str, str], ...] = (
    ("model_name", "$model_name"),
    ("engine", "$engine"),
)
BY_ENGINE = f"by ({', '.join(ENGINE_LABELS)})"
ENGINE_LEGEND = "{{instance}} {{model_name}}/{{engine}}"
RATE = "$__rate_interval"
GPU_ONLY_NOTE = "GPU-only: NVML series exist only where the agent finds an NVIDIA GPU."

Color = str


def selector(
    spec: MetricSpec,
    part: str = "",
    *,
    engine: bool = True,
    matchers: Sequence[tuple[str, str]] = (),
) -> str:
    """`name{model_name=~"$model_name", engine=~"$engine", ...}` for `spec`.

    `part` is a histogram's `_bucket`/`_sum`/`_count`; counters gain `_total`.
    `engine=False` leaves out the engine filter (the service's own metrics).
    """
    name = spec.name + part if part else spec.series_name
    pairs = [f'{k}=~"{v}"' for k, v in (ENGINE_MATCHERS if engine else ())]
    pairs += [f'{k}=~"{v}"' for k, v in matchers]
    return f"{name}{{{', '.join(pairs)}}}" if pairs else name


def rate(spec: MetricSpec, part: str = "", window: str = RATE, **kw: Any) -> str:
    return f"rate({selector(spec, part, **kw)}[{window}])"


def quantile(
    q: float,
    spec: MetricSpec,
    by: Sequence[str] = ENGINE_LABELS,
    window: str = RATE,
    **kw: Any,
) -> str:
    """The q-quantile of a histogram over `window`, per `by` (default: per engine)."""
    labels = ", ".join((*by, "le"))
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(spec, '_bucket', window, **kw)}))"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ENGINE_LEGEND
    instant: bool = False  # tables and bar gauges: one value per series, at the end

    def to_json(self, ref_id: str) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "instant": self.instant,
            "legendFormat": self.legend,
            "range": not self.instant,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Threshold:
    """A value a rule compares against, drawn as a line across the panel."""

    value: float
    color: Color = "red"
    # "above": the rule fires above the value (green below it); "below": the reverse.
    direction: Literal["above", "below"] = "above"


@dataclass
class Panel:
    title: str
    description: str
    targets: Sequence[Target]
    unit: str = "short"
    kind: Literal["timeseries", "bargauge", "table", "stat"] = "timeseries"
    width: int = 12
    height: int = 8
    stepped: bool = False  # knobs: a change shows as a step, not a slope
    thresholds: Sequence[Threshold] = ()
    min: float | None = None
    max: float | None = None
    stack: bool = False
    bars: bool = False
    gpu_only: bool = False
    decimals: int | None = None

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        description = self.description
        if self.gpu_only:
            description = f"{GPU_ONLY_NOTE} {description}"
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "color": {"mode": "palette-classic"},
            "thresholds": _thresholds(self.thresholds),
        }
        if self.min is not None:
            defaults["min"] = self.min
        if self.max is not None:
            defaults["max"] = self.max
        if self.decimals is not None:
            defaults["decimals"] = self.decimals
        options: dict[str, Any]
        if self.kind == "timeseries":
            defaults["custom"] = _timeseries_style(self)
            options = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        elif self.kind == "bargauge":
            defaults["color"] = {"mode": "thresholds"}
            options = {
                "displayMode": "gradient",
                "orientation": "horizontal",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "showUnfilled": True,
                "valueMode": "color",
                "namePlacement": "auto",
                "sizing": "auto",
                "minVizHeight": 16,
                "minVizWidth": 8,
                "maxVizHeight": 300,
            }
        elif self.kind == "stat":
            defaults["color"] = {"mode": "thresholds"}
            options = {
                "colorMode": "value",
                "graphMode": "area",
                "justifyMode": "auto",
                "orientation": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "textMode": "auto",
                "showPercentChange": False,
                "wideLayout": True,
            }
        else:  # table
            options = {"cellHeight": "sm", "showHeader": True, "footer": {"show": False}}
        panel: dict[str, Any] = {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
        }
        if self.kind == "table":
            panel["transformations"] = [
                {"id": "reduce", "options": {"reducers": ["lastNotNull"], "mode": "seriesToRows"}}
            ]
        return panel


def _timeseries_style(p: Panel) -> dict[str, Any]:
    return {
        "drawStyle": "bars" if p.bars else "line",
        "lineInterpolation": "stepAfter" if p.stepped else "linear",
        "lineWidth": 2 if p.stepped else 1,
        "fillOpacity": 60 if p.bars else 10,
        "gradientMode": "none",
        "showPoints": "never",
        "pointSize": 4,
        "spanNulls": False,
        "axisPlacement": "auto",
        "axisLabel": "",
        "axisSoftMin": 0,
        "scaleDistribution": {"type": "linear"},
        "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if p.thresholds else "off"},
        "hideFrom": {"legend": False, "tooltip": False, "viz": False},
    }


def _thresholds(thresholds: Sequence[Threshold]) -> dict[str, Any]:
    """Grafana's thresholds: a base colour, then a colour from each value up."""
    ordered = sorted(thresholds, key=lambda t: t.value)
    steps: list[dict[str, Any]]
    if ordered and ordered[0].direction == "below":
        # Bad below the value, good above it.
        steps = [{"color": ordered[0].color, "value": None}]
        steps += [{"color": "green", "value": t.value} for t in ordered[:1]]
        steps += [{"color": t.color, "value": t.value} for t in ordered[1:]]
    else:
        steps = [{"color": "green", "value": None}]
        steps += [{"color": t.color, "value": t.value} for t in ordered]
    return {"mode": "absolute", "steps": steps}


@dataclass
class Row:
    title: str
    panels: Sequence[Panel]
    collapsed: bool = False


@dataclass(frozen=True)
class Annotation:
    """Marks on every time series panel of the dashboard where `expr` has a value."""

    name: str
    expr: str
    title: str
    text: str = ""
    tags: Sequence[str] = ()
    color: Color = "orange"
    step: str = "15s"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "datasource": DATASOURCE,
            "enable": True,
            "hide": False,
            "iconColor": self.color,
            "step": self.step,
            "titleFormat": self.title,
            "textFormat": self.text,
            "tagKeys": ",".join(self.tags),
            "useValueForTime": False,
            "target": {"expr": self.expr, "interval": "", "refId": "Anno"},
        }


BUILTIN_ANNOTATION: dict[str, Any] = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


@dataclass(frozen=True)
class QueryVariable:
    name: str
    label: str
    query: str  # e.g. label_values(metric{...}, label)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": self.query,
            "query": {"qryType": 1, "query": self.query, "refId": "PrometheusVariableQueryEditor"},
            "refresh": 2,  # on time range change: engines come and go
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {},
            "options": [],
            "regex": "",
            "sort": 1,
            "hide": 0,
        }


DATASOURCE_VARIABLE: dict[str, Any] = {
    "name": "datasource",
    "label": "Prometheus",
    "type": "datasource",
    "query": "prometheus",
    "current": {},
    "options": [],
    "refresh": 1,
    "regex": "",
    "includeAll": False,
    "multi": False,
    "hide": 0,
}


def dashboard(
    *,
    uid: str,
    title: str,
    description: str,
    rows: Iterable[Row],
    variables: Sequence[QueryVariable],
    annotations: Sequence[Annotation] = (),
    tags: Sequence[str] = ("vllm", "vllm-runbook"),
    refresh: str = "30s",
    time_from: str = "now-1h",
) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row in rows:
        row_json: dict[str, Any] = {
            "id": next_id,
            "type": "row",
            "title": row.title,
            "collapsed": row.collapsed,
            "gridPos": {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": y},
            "panels": [],
        }
        next_id += 1
        y += 1
        children: list[dict[str, Any]] = []
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_COLUMNS:
                x, y, line_height = 0, y + line_height, 0
            children.append(panel.to_json(next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
        panels.append(row_json)
        # A collapsed row keeps its panels inside it; an open row is followed by them.
        if row.collapsed:
            row_json["panels"] = children
        else:
            panels.extend(children)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": list(tags),
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: line a knob step up with the latency it moved
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": refresh,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "weekStart": "",
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "links": [
            {
                "title": "vllm-runbook",
                "type": "dashboards",
                "tags": ["vllm-runbook"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {"list": [BUILTIN_ANNOTATION, *(a.to_json() for a in annotations)]},
        "templating": {"list": [DATASOURCE_VARIABLE, *(v.to_json() for v in variables)]},
        "panels": panels,
    }
