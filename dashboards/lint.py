"""What a dashboard must satisfy to load in Grafana and to query real series.

`queries` lists every PromQL expression of a dashboard (panel targets,
annotations, variables); `parse` reads one with a real PromQL parser
(promql-parser), from whose tree `metric_names` and `labels_used` take the
series and labels it names; `problems` returns everything wrong with a
dashboard as sentences, `rule_problems` with a rule file's groups.
The generator refuses to write a dashboard with problems and the tests
assert there are none.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import promql_parser
from vllm_runbook.dashboards import catalog

GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

_BUILTIN = re.compile(r"\$(?:\{(?:%s)\}|(?:%s)\b)" % (("|".join(GRAFANA_BUILTINS),) * 2))
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)[^}]*\}")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")


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


class PromQLSyntaxError(ValueError):
    """An expression that is not PromQL (the parser's message)."""


def parseable(expr: str) -> str:
    """The expression as Prometheus gets it from Grafana: its interval variables
    (``$__rate_interval``, ``$__interval``, ``$__range``) as a duration. Dashboard
    variables stay: they are only used inside label matchers' strings."""
    return _BUILTIN.sub("5m", expr)


@functools.lru_cache(maxsize=4096)
def parse(expr: str) -> Any:
    """The expression's syntax tree (promql-parser: Prometheus' grammar, in Rust);
    PromQLSyntaxError when it is not PromQL."""
    try:
        return promql_parser.parse(parseable(expr))
    except ValueError as exc:
        raise PromQLSyntaxError(str(exc)) from None


def _nodes(expr: str) -> list[Any]:
    nodes: list[Any] = []
    promql_parser.walk(parse(expr), nodes.append)
    return nodes


def _name(node: Any) -> str | None:
    """A selector's metric name, written before the braces or as ``__name__="..."``."""
    if node.name:
        return str(node.name)
    for m in node.matchers.matchers:
        if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal:
            return str(m.value)
    return None


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects, from its syntax tree (none when it
    is not PromQL: `problems` says so)."""
    try:
        nodes = _nodes(expr)
    except PromQLSyntaxError:
        return set()
    return {
        name
        for node in nodes
        if isinstance(node, promql_parser.VectorSelector) and (name := _name(node))
    }


def labels_used(expr: str) -> set[str]:
    """Labels named in matchers and in by/without/on/ignoring/group_x lists, from the
    syntax tree."""
    try:
        nodes = _nodes(expr)
    except PromQLSyntaxError:
        return set()
    used: set[str] = set()
    for node in nodes:
        if isinstance(node, promql_parser.VectorSelector):
            used |= {m.name for m in node.matchers.matchers if m.name != "__name__"}
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            used |= set(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                used |= set(node.modifier.matching.labels)
            used |= set(node.modifier.group_labels or ())
    return used


def rule_problems(groups: Iterable[Mapping[str, Any]], known: Iterable[str]) -> list[str]:
    """Every expression of a rule file's groups that is not PromQL, or that selects a
    series neither `known` nor recorded by one of the groups."""
    groups = list(groups)
    rules = [r for g in groups for r in g.get("rules", [])]
    names = set(known) | {r["record"] for r in rules if "record" in r} | {"ALERTS"}
    out: list[str] = []
    for group in groups:
        for rule in group.get("rules", []):
            where = f"group {group.get('name')} {rule.get('alert') or rule.get('record')}"
            try:
                parse(str(rule["expr"]))
            except PromQLSyntaxError as exc:
                out.append(f"{where}: not PromQL ({exc}): {rule['expr']}")
                continue
            for name in sorted(metric_names(str(rule["expr"])) - names):
                out.append(f"{where}: {name} is neither exported nor recorded")
    return out


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
        try:
            parse(q.expr)
        except PromQLSyntaxError as exc:
            out.append(f"{q.where}: not PromQL ({exc}): {q.expr}")
            continue
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
