"""Draw a dashboard's panels from Prometheus range results with matplotlib.

There is no Grafana server here, so this shows what the panels would show:
lines per series (stepped where the panel is stepped), the rules' thresholds
as dashed lines, the knob-change annotation as vertical marks, stat panels
as their last value, laid out on the dashboard's own grid. Not a Grafana
replica; enough for a person to judge the queries on real data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import EngFormatter, PercentFormatter

Matrix = list[dict[str, Any]]
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
ENGINE_SUFFIX = " {instance} {model_name}/{engine}"
KNOB_ANNOTATION = "Knob changes"


def _legend(fmt: str, labels: Mapping[str, str]) -> str:
    return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), fmt)


def _short_legend(fmt: str, labels: Mapping[str, str]) -> str:
    """The legend without the engine's name: one engine is drawn."""
    text = _legend(fmt, labels)
    suffix = ENGINE_SUFFIX.format(
        **{k: labels.get(k, "") for k in ("instance", "model_name", "engine")}
    )
    return text.removesuffix(suffix).strip().removesuffix(suffix.strip()).strip() or "value"


def _points(series: Mapping[str, Any], start: float) -> tuple[list[float], list[float]]:
    """The series' points; a gap (no sample for over 1.5 steps of 1 s) stays a gap,
    as Grafana draws it, instead of a line across it."""
    xs: list[float] = []
    ys: list[float] = []
    for t, v in series["values"]:
        x = float(t) - start
        if xs and x - xs[-1] > 1.5:
            xs.append(xs[-1] + 1.0)
            ys.append(math.nan)
        xs.append(x)
        ys.append(float(v))
    return xs, ys


def _format_axis(ax: Axes, unit: str) -> None:
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif unit == "s":
        ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
    elif unit == "bytes":
        ax.yaxis.set_major_formatter(EngFormatter(unit="B"))


def _format_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "no data"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return EngFormatter(unit="s", places=1)(value)
    return f"{value:.4g}"


def draw_panel(
    ax: Axes,
    panel: Mapping[str, Any],
    ranges: Mapping[str, Matrix],
    substitute: Callable[[str], str],
    start: float,
    end: float,
    marks: Sequence[float] = (),
) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    ax.set_title(panel["title"], fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    if panel["type"] == "stat":
        values = [
            float(s["values"][-1][1])
            for t in panel["targets"]
            for s in ranges.get(substitute(t["expr"]), [])
        ]
        text = ", ".join(_format_value(v, unit) for v in values) or "no data"
        ax.text(0.5, 0.45, text, ha="center", va="center", fontsize=18, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if panel["type"] in ("table", "bargauge"):
        # One value per series, at the range's end.
        rows = [
            f"{_short_legend(t.get('legendFormat', ''), s['metric'])}: "
            f"{_format_value(float(s['values'][-1][1]), unit)}"
            for t in panel["targets"]
            for s in ranges.get(substitute(t["expr"]), [])
        ]
        text = "\n".join(rows) or "no data"
        ax.text(0.03, 0.95, text, ha="left", va="top", fontsize=8, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    custom = defaults.get("custom", {})
    stepped = custom.get("lineInterpolation") == "stepAfter"
    bars = custom.get("drawStyle") == "bars"
    drawn = 0
    for target in panel["targets"]:
        for series in ranges.get(substitute(target["expr"]), []):
            xs, ys = _points(series, start)
            label = _short_legend(target.get("legendFormat", ""), series["metric"])
            if bars:
                ax.bar(xs, ys, width=0.9, label=label, alpha=0.8)
                ax.set_ylim(bottom=0)
            elif stepped:
                ax.step(xs, ys, where="post", label=label, linewidth=1.6)
            else:
                ax.plot(xs, ys, label=label, linewidth=1.2)
            drawn += 1
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step["value"] is not None:
            ax.axhline(step["value"], color=step["color"], linestyle="--", linewidth=0.9)
    for mark in marks:
        ax.axvline(mark, color="orange", linewidth=0.8, alpha=0.8)
    if "min" in defaults or "max" in defaults:
        lo, hi = ax.get_ylim()
        ax.set_ylim(
            defaults.get("min", lo), defaults.get("max", hi) * 1.05 if "max" in defaults else hi
        )
    ax.set_xlim(0, end - start)
    _format_axis(ax, unit)
    ax.grid(alpha=0.25)
    if drawn:
        ax.legend(fontsize=6, loc="upper left", framealpha=0.5)
    else:
        gpu_only = panel["description"].startswith("GPU-only")
        text = "no data (GPU-only)" if gpu_only else "no data"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9)


def annotation_marks(
    dashboard: Mapping[str, Any],
    ranges: Mapping[str, Matrix],
    substitute: Callable[[str], str],
    start: float,
) -> list[float]:
    """Seconds after `start` where a knob changed, from the knob-change annotation.

    Its value counts the changes within its window: a rise is a new change
    (Grafana would draw the region that starts there).
    """
    marks: list[float] = []
    for annotation in dashboard["annotations"]["list"]:
        if annotation.get("name") != KNOB_ANNOTATION:
            continue
        for series in ranges.get(substitute(annotation["expr"]), []):
            previous_t: float | None = None
            previous_v = 0.0
            for t_text, v_text in series["values"]:
                t, v = float(t_text), float(v_text)
                if previous_t is None or t - previous_t > 1.5 or v > previous_v:
                    marks.append(t - start)
                previous_t, previous_v = t, v
    return sorted(set(marks))


def draw_dashboard(
    dashboard: Mapping[str, Any],
    ranges: Mapping[str, Matrix],
    substitute: Callable[[str], str],
    out_dir: Path,
    start: float,
    end: float,
) -> tuple[Path, list[Path]]:
    """One PNG per panel and one of the whole dashboard on its grid; returns their paths."""
    plt.style.use("dark_background")
    marks = annotation_marks(dashboard, ranges, substitute, start)
    every = [q for p in dashboard["panels"] for q in (p, *p.get("panels", []))]
    singles = []
    for panel in every:
        if panel["type"] == "row":
            continue
        fig, ax = plt.subplots(figsize=(7, 3.2), dpi=90)
        draw_panel(ax, panel, ranges, substitute, start, end, marks)
        ax.set_xlabel("seconds", fontsize=7)
        fig.tight_layout()
        slug = re.sub(r"[^a-z0-9]+", "-", panel["title"].lower()).strip("-")
        path = out_dir / f"{panel['id']:02d}-{slug}.png"
        fig.savefig(path)
        plt.close(fig)
        singles.append(path)

    height_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in every)
    inches = height_units * 0.2
    fig = plt.figure(figsize=(16, inches), dpi=72)
    # The room for a panel's title and tick labels is fixed in inches: as a share of
    # the figure it shrinks as the dashboard grows (a fixed share would leave a short
    # panel of a tall dashboard a negative height).
    below, around = 0.42 / inches, 1.04 / inches
    fig.suptitle(f"{dashboard['title']} — drawn from a real Prometheus", fontsize=12, y=0.999)
    for panel in every:
        g = panel["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        bottom, height = 1 - (g["y"] + g["h"]) / height_units, g["h"] / height_units
        if panel["type"] == "row":
            fig.text(0.01, bottom + height * 0.3, panel["title"], fontsize=11, weight="bold")
            continue
        ax = fig.add_axes(
            (left + 0.03, bottom + below, width - 0.045, max(height - around, height * 0.25))
        )
        draw_panel(ax, panel, ranges, substitute, start, end, marks)
    composite = out_dir / f"{dashboard['uid']}.png"
    fig.savefig(composite)
    plt.close(fig)
    return composite, singles
