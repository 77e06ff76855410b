"""What a dashboard must satisfy to load in Grafana and to query real series.

`queries` lists every PromQL expression of a dashboard (panel targets,
annotations, variables); `metric_names` finds the series an expression
names; `problems` returns everything wrong with a dashboard as sentences.
The generator refuses to write a dashboard with problems and the tests
assert there are none.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_runbook.dashboards import catalog

GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)[^}]*\}")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan"}


@dataclass(frozen=True)
class Query:
    where: str  # e.g. "panel 3 'Throughput' target B"
    expr: str
    panel: Mapping[str, Any] | None = None  # None for annotations and variables
    kind: str = "panel"  # panel | annotation | variable
    instant: bool = False  # a panel target Grafana evaluates once, at the range's end


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: Mapping[str, Any]) -> list[Query]:
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel.get('id')} {panel.get('title')!r} target {target.get('refId')}"
            out.append(
                Query(where, target.get("expr", ""), panel, instant=bool(target.get("instant")))
            )
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:  # Prometheus' (the built-in one has none)
            out.append(Query(f"annotation {annotation['name']!r}", annotation["expr"],
                             kind="annotation"))  # fmt: skip
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            match = _LABEL_VALUES.match(variable["query"]["query"])
            expr = match.group(1) if match else variable["query"]["query"]
            out.append(Query(f"variable {variable['name']!r}", expr, kind="variable"))
    return out


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (functions, keywords, labels left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _GROUPING.sub("", text)
    text = _RANGE.sub("", text)
    return {
        name for name, call in _IDENT.findall(text) if not call and name.lower() not in _KEYWORDS
    }


def labels_used(expr: str) -> set[str]:
    """Labels named in matchers and in by/without/on/ignoring/group_x lists."""
    text = _STRING.sub('""', expr)
    used: set[str] = set()
    for body in _MATCHERS.findall(text):
        used |= {m.split("=")[0].split("!")[0].strip() for m in body.split(",") if m.strip()}
    for body in _GROUPING.findall(text):
        used |= {label.strip() for label in body.split(",") if label.strip()}
    return used


def variables_used(expr: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(expr)}


def problems(dashboard: Mapping[str, Any]) -> list[str]:
    """Everything that stops Grafana loading the dashboard or its queries finding series."""
    out: list[str] = []
    uid = dashboard.get("uid")
    if not isinstance(uid, str) or not 0 < len(uid) <= 40:
        out.append(f"uid {uid!r}: Grafana needs 1..40 characters")
    if not dashboard.get("title"):
        out.append("no title")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 39:
        out.append(f"schemaVersion {dashboard.get('schemaVersion')!r} < 39")
    if "__inputs" in dashboard:
        out.append("__inputs: provisioning style uses the ${datasource} variable instead")
    out += _variable_problems(dashboard)
    out += _panel_problems(dashboard)
    known = catalog.all_known_series()
    defined = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    for q in queries(dashboard):
        names = metric_names(q.expr)
        if not names:
            out.append(f"{q.where}: names no metric: {q.expr}")
        for name in sorted(names - set(known)):
            out.append(f"{q.where}: {name} is exported by neither the collector, vLLM nor the "
                       "service")  # fmt: skip
        allowed = {"instance", "job"}
        for name in names & set(known):
            allowed |= set(catalog.labels_of(name))
        for label in sorted(labels_used(q.expr) - allowed):
            out.append(f"{q.where}: label {label!r} is on none of {sorted(names)}")
        for var in sorted(variables_used(q.expr) - defined - set(GRAFANA_BUILTINS)):
            out.append(f"{q.where}: undefined variable ${var}")
    return out


def _variable_problems(dashboard: Mapping[str, Any]) -> list[str]:
    out = []
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        out.append("no `datasource` variable of type datasource (prometheus)")
    for name in ("model_name", "engine"):
        var = variables.get(name)
        if not var or var.get("type") != "query" or var.get("datasource") != DATASOURCE:
            out.append(f"no query variable {name!r} on ${{datasource}}")
        elif not var["query"]["query"].startswith("label_values("):
            out.append(f"variable {name!r} is not a label_values() query")
    return out


def _panel_problems(dashboard: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    seen_ids: set[int] = set()
    boxes: list[tuple[str, int, int, int, int]] = []
    for panel in panels(dashboard):
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        pid = panel.get("id")
        if not isinstance(pid, int) or pid in seen_ids:
            out.append(f"{name}: id missing or not unique")
        seen_ids.add(pid if isinstance(pid, int) else -1)
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in "hwxy"):
            out.append(f"{name}: gridPos needs integer h, w, x, y")
            continue
        if grid["x"] < 0 or grid["x"] + grid["w"] > 24 or grid["w"] < 1 or grid["h"] < 1:
            out.append(f"{name}: gridPos {grid} outside the 24 columns")
        if not panel.get("title"):
            out.append(f"{name}: no title")
        boxes.append((name, grid["x"], grid["y"], grid["w"], grid["h"]))
        if panel.get("type") == "row":
            continue
        if not panel.get("description"):
            out.append(f"{name}: no description")
        if panel.get("datasource") != DATASOURCE:
            out.append(f"{name}: datasource is not ${{datasource}}")
        targets = panel.get("targets") or []
        if not targets:
            out.append(f"{name}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            out.append(f"{name}: refIds missing or repeated")
        for t in targets:
            if t.get("datasource") != DATASOURCE or not t.get("expr"):
                out.append(f"{name}: target {t.get('refId')} lacks datasource or expr")
    for i, (a, ax, ay, aw, ah) in enumerate(boxes):
        for b, bx, by, bw, bh in boxes[i + 1 :]:
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                out.append(f"{a} overlaps {b}")
    return out
