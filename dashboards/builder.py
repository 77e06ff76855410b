"""Our house style on Grafana's own types (the Grafana Foundation SDK).

The panels are built with the SDK's builders, which are generated from
Grafana's dashboard schema (the release pinned in pyproject's `dashboards`
extra), and serialised by the SDK. This module only adds what every panel of
ours shares: the `${datasource}` variable on every query (the same file works
with any Prometheus data source, no `__inputs`), legends and tooltips, rule
thresholds drawn as dashed lines, and one pass over the built dashboard that
numbers panels and queries and marks GPU-only panels. The one thing the
schema cannot say (a Prometheus annotation's options) is `PromAnnotation`.

Only the generator imports this module (through definitions.py): the
checked-in JSON is what users consume, so the SDK is needed to regenerate it,
never at run time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Self, TypeVar

from grafana_foundation_sdk.builders import bargauge, common, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as c
from grafana_foundation_sdk.models import dashboard as d
from grafana_foundation_sdk.models import prometheus as p
from vllm_runbook.dashboards import catalog, lint
from vllm_runbook.dashboards.queries import ENGINE_LEGEND, Threshold

DATASOURCE = d.DataSourceRef(type_val="prometheus", uid="${datasource}")
GPU_ONLY_NOTE = "GPU-only: NVML series exist only where the agent finds an NVIDIA GPU."

# A row of the dashboard: its title and its panels, flowed on the 24-column grid.
Row = tuple[str, Sequence[Builder[d.Panel]]]


def prom(expr: str, legend: str = ENGINE_LEGEND, *, instant: bool = False) -> prometheus.Dataquery:
    """A PromQL query on `${datasource}`; `instant`: one value per series, at the end."""
    query = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)
    query = query.editor_mode(p.QueryEditorMode.CODE)
    return query.instant() if instant else query.range()


def thresholds(*lines: Threshold) -> dash.ThresholdsConfig:
    """Grafana's thresholds: a base colour, then a colour from each value up."""
    ordered = sorted(lines, key=lambda t: t.value)
    steps = [d.Threshold(None, "green")] + [d.Threshold(t.value, t.color) for t in ordered]
    if ordered and ordered[0].direction == "below":
        # Bad below the first value, good above it.
        steps[:2] = [d.Threshold(None, ordered[0].color), d.Threshold(ordered[0].value, "green")]
    return dash.ThresholdsConfig().mode(d.ThresholdsMode.ABSOLUTE).steps(steps)


def bands(base: str, *steps: tuple[float, str]) -> dash.ThresholdsConfig:
    """Colours by value: `base` below the first step, then each step's colour from its value."""
    levels = [d.Threshold(None, base)] + [d.Threshold(value, color) for value, color in steps]
    return dash.ThresholdsConfig().mode(d.ThresholdsMode.ABSOLUTE).steps(levels)


Chart = TypeVar("Chart", timeseries.Panel, bargauge.Panel, stat.Panel, table.Panel)


def placed(panel: Chart, title: str, description: str, width: int, height: int = 8) -> Chart:
    """What every panel of ours has: a title, a description, `${datasource}`, its size."""
    panel.title(title).description(description).datasource(DATASOURCE)
    return panel.span(width).height(height).unit("short").thresholds(thresholds())


class Graph(timeseries.Panel):
    """A time series panel: lines, a shared multi-series tooltip, the legend below."""

    def __init__(self, title: str, description: str, width: int = 12, height: int = 8) -> None:
        super().__init__()
        placed(self, title, description, width, height)
        self.color_scheme(dash.FieldColor().mode(d.FieldColorModeId.PALETTE_CLASSIC))
        self.legend(
            common.VizLegendOptions()
            .display_mode(c.LegendDisplayMode.LIST)
            .placement(c.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        self.tooltip(
            common.VizTooltipOptions().mode(c.TooltipDisplayMode.MULTI).sort(c.SortOrder.DESCENDING)
        )
        self.draw_style(c.GraphDrawStyle.LINE).line_interpolation(c.LineInterpolation.LINEAR)
        self.line_width(1).fill_opacity(10).show_points(c.VisibilityMode.NEVER).axis_soft_min(0)

    def rule_lines(self, *lines: Threshold) -> Self:
        """A rule's thresholds, drawn as dashed lines across the panel."""
        style = common.GraphThresholdsStyleConfig().mode(c.GraphThresholdsStyleMode.DASHED)
        return self.thresholds(thresholds(*lines)).thresholds_style(style)

    def stepped(self) -> Self:
        """Knobs: a change shows as a step, not a slope."""
        return self.line_interpolation(c.LineInterpolation.STEP_AFTER).line_width(2)

    def bars(self, *, stacked: bool = False) -> Self:
        if stacked:
            self.stacking(common.StackingConfig().mode(c.StackingMode.NORMAL).group("A"))
        return self.draw_style(c.GraphDrawStyle.BARS).fill_opacity(60)


def last_value() -> common.ReduceDataOptions:
    return common.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def bar_gauge(title: str, description: str, width: int, height: int = 8) -> bargauge.Panel:
    """Horizontal bars, one per series, coloured by the thresholds."""
    return (
        placed(bargauge.Panel(), title, description, width, height)
        .color_scheme(dash.FieldColor().mode(d.FieldColorModeId.THRESHOLDS))
        .display_mode(c.BarGaugeDisplayMode.GRADIENT)
        .orientation(c.VizOrientation.HORIZONTAL)
        .value_mode(c.BarGaugeValueMode.COLOR)
        .name_placement(c.BarGaugeNamePlacement.AUTO)
        .sizing(c.BarGaugeSizing.AUTO)
        .reduce_options(last_value())
        .legend(common.VizLegendOptions().show_legend(False))
    )


def stat_panel(title: str, description: str, width: int, height: int = 8) -> stat.Panel:
    """Big numbers with a sparkline, the last value of each query."""
    return (
        placed(stat.Panel(), title, description, width, height)
        .color_scheme(dash.FieldColor().mode(d.FieldColorModeId.THRESHOLDS))
        .color_mode(c.BigValueColorMode.VALUE)
        .graph_mode(c.BigValueGraphMode.AREA)
        .justify_mode(c.BigValueJustifyMode.AUTO)
        .orientation(c.VizOrientation.AUTO)
        .text_mode(c.BigValueTextMode.AUTO)
        .reduce_options(last_value())
    )


def table_panel(title: str, description: str, width: int, height: int = 8) -> table.Panel:
    """One row per series: its last value."""
    reduce = d.DataTransformerConfig(
        id_val="reduce", options={"reducers": ["lastNotNull"], "mode": "seriesToRows"}
    )
    return (
        placed(table.Panel(), title, description, width, height)
        .cell_height(c.TableCellHeight.SM)
        .show_header(True)
        .footer(common.TableFooterOptions().show(False))
        .with_transformation(reduce)
    )


class PromAnnotation(d.AnnotationQuery, Builder[d.AnnotationQuery]):
    """Marks on every time series panel where `expr` has a value.

    Grafana's schema types an annotation's target as the built-in Grafana
    source's (limit, tags); the Prometheus data source's options (title and
    text templates, labels as tags, step) have no field in the SDK's
    AnnotationQuery, so this subclass adds them to its JSON. Grafana moves the
    top-level `expr` and `step` into the query target when it loads the file.
    """

    def __init__(
        self,
        name: str,
        expr: str,
        title: str,
        text: str = "",
        tags: Sequence[str] = (),
        color: str = "orange",
    ) -> None:
        super().__init__(name=name, datasource=DATASOURCE, icon_color=color, expr=expr)
        self.prometheus_options: dict[str, object] = {
            "step": "15s",
            "titleFormat": title,
            "textFormat": text,
            "tagKeys": ",".join(tags),
            "useValueForTime": False,
        }

    def build(self) -> Self:
        return self

    def to_json(self) -> dict[str, object]:
        return super().to_json() | self.prometheus_options


def query_variable(name: str, label: str, query: str) -> dash.QueryVariable:
    """A multi-value variable from `label_values(...)`, `All` matching everything."""
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor"})
        .refresh(d.VariableRefresh.ON_TIME_RANGE_CHANGED)  # engines come and go
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .sort(d.VariableSort.ALPHABETICAL_ASC)
    )


def dashboard(
    *,
    uid: str,
    title: str,
    description: str,
    rows: Sequence[Row],
    variables: Sequence[dash.QueryVariable],
    annotations: Sequence[PromAnnotation] = (),
    refresh: str = "30s",
    time_from: str = "now-1h",
) -> dict[str, Any]:
    """The dashboard as Grafana stores it: the SDK lays the rows out on the grid."""
    builtin = (
        dash.AnnotationQuery()
        .name("Annotations & Alerts")
        .datasource(d.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .built_in(1)
        .type("dashboard")
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
    )
    board = (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["vllm", "vllm-runbook"])
        .editable()
        .tooltip(d.DashboardCursorSync.CROSSHAIR)  # line a knob step up with the latency it moved
        .refresh(refresh)
        .time(time_from, "now")
        .link(
            dash.DashboardLink("vllm-runbook")
            .type(d.DashboardLinkType.DASHBOARDS)
            .tags(["vllm-runbook"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
            .icon("external link")
        )
        .annotations([builtin, *annotations])
        .with_variable(dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for variable in variables:
        board.with_variable(variable)
    for row_title, panels in rows:
        board.with_row(dash.Row(row_title))
        for panel in panels:
            board.with_panel(panel)
    model = board.build()
    _number_and_mark(model)
    return dict(json.loads(json.dumps(model, cls=JSONEncoder)))


def _number_and_mark(model: d.Dashboard) -> None:
    """Unique panel ids in reading order, refIds A, B, ... per panel, and the
    GPU-only note on panels whose every series exists only with a GPU."""
    known = catalog.all_known_series()
    panel_id = 0
    for panel in model.panels or []:
        for inner in [panel, *(panel.panels if isinstance(panel, d.RowPanel) else [])]:
            panel_id += 1
            inner.id_val = panel_id
            if isinstance(inner, d.RowPanel):
                continue
            names: set[str] = set()
            for i, target in enumerate(inner.targets or []):
                assert isinstance(target, p.Dataquery), target
                target.ref_id = chr(ord("A") + i)
                names |= lint.metric_names(target.expr)
            if names and all(known[n].gpu_only for n in names if n in known):
                inner.description = f"{GPU_ONLY_NOTE} {inner.description}"
