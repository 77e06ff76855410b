"""PromQL backend: the condition tree as PromQL, and the catalog as a rule file.

Every leaf is aggregated ``by`` the engine labels (plus `gpu` while a value is
still per GPU), so binary operators match one engine to itself whatever
extra labels (job, pod) a deployment's scrape config adds. The in-service
evaluator (vllm_runbook.rules.compiler) implements exactly these semantics.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import yaml
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.rules.model import Catalog, Rule
from vllm_runbook.rules.signals import ENGINE_LABELS

DEFAULT_RUNBOOK_URL_BASE = "runbooks/catalog"


class PromQLRenderer:
    def __init__(self, engine_labels: Sequence[str] = ENGINE_LABELS) -> None:
        self.engine_labels = tuple(engine_labels)

    def by(self, per: str | None, *extra: str) -> str:
        labels = self.engine_labels + ((per,) if per else ()) + extra
        return f"by ({', '.join(labels)})"

    @staticmethod
    def selector(sel: C.Selector, suffix: str = "") -> str:
        name = sel.metric + suffix
        if not sel.matchers:
            return name
        # json.dumps escapes quotes and backslashes the way PromQL strings expect
        return name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sel.matchers) + "}"

    @staticmethod
    def offset(seconds: float) -> str:
        return f" offset {format_duration(seconds)}" if seconds else ""

    def range(self, sel: C.Selector, window: float, off: float, suffix: str = "") -> str:
        return f"{self.selector(sel, suffix)}[{format_duration(window)}]{self.offset(off)}"

    def expr(self, e: C.Expr, off: float = 0.0) -> str:
        match e:
            case C.Instant(sel):
                return f"max {self.by(sel.signal.per)} ({self.selector(sel)}{self.offset(off)})"
            case C.Rate(sel, w):
                return f"sum {self.by(sel.signal.per)} (rate({self.range(sel, w, off)}))"
            case C.OverTime(fn, sel, w):
                inner = f"{fn}_over_time({self.range(sel, w, off)})"
                return f"max {self.by(sel.signal.per)} ({inner})"
            case C.Quantile(q, sel, w):
                rates = f"rate({self.range(sel, w, off, '_bucket')})"
                buckets = f"sum {self.by(sel.signal.per, 'le')} ({rates})"
                return f"histogram_quantile({number(q)}, {buckets})"
            case C.TimeSince(sel):
                return f"(time() - max {self.by(sel.signal.per)} ({self.selector(sel)}))"
            case C.Ratio(num, den):
                return f"({self.expr(num, off)} / {self.expr(den, off)})"
            case C.Difference(left, right):
                return f"({self.expr(left, off)} - {self.expr(right, off)})"
            case C.Reduce("spread", _, of):
                inner = self.expr(of, off)
                return f"(max {self.by(None)} ({inner}) - min {self.by(None)} ({inner}))"
            case C.Reduce(fn, _, of):
                return f"{fn} {self.by(None)} ({self.expr(of, off)})"
            case C.Offset(of, by):
                return self.expr(of, off + by)
            case C.Fallback(first, second):
                # both sides are aggregated by the engine labels: `or` matches on them
                return f"({self.expr(first, off)} or {self.expr(second, off)})"
        raise TypeError(e)

    def condition(self, c: C.Condition) -> str:
        match c:
            case C.Compare(expr, op, value):
                return f"{self.expr(expr)} {op} {number(value)}"
            case C.AllOf(terms):
                return " and ".join(f"({self.condition(t)})" for t in terms)
            case C.AnyOf(terms):
                return " or ".join(f"({self.condition(t)})" for t in terms)
            case C.Unless(kept, excluded):
                # both sides are aggregated by the engine labels: `unless` matches on them
                return f"({self.condition(kept)}) unless ({self.condition(excluded)})"
        raise TypeError(c)


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def to_promql(cond: C.Condition, engine_labels: Sequence[str] = ENGINE_LABELS) -> str:
    return PromQLRenderer(engine_labels).condition(cond)


def rule_to_prometheus(
    rule: Rule,
    *,
    runbook_url_base: str = DEFAULT_RUNBOOK_URL_BASE,
    annotations: bool = True,
    engine_labels: Sequence[str] = ENGINE_LABELS,
) -> dict[str, object]:
    out: dict[str, object] = {
        "alert": rule.alert,
        "expr": to_promql(rule.condition, engine_labels),
        "for": format_duration(rule.for_seconds),
        "labels": rule.alert_labels,
    }
    if annotations:
        notes = {"summary": rule.summary, "description": rule.description}
        if rule.runbook:
            notes["runbook_url"] = f"{runbook_url_base.rstrip('/')}/{rule.runbook}"
        out["annotations"] = notes
    return out


def rule_groups(
    catalog: Catalog | Iterable[Rule],
    overrides: Mapping[str, Mapping[str, object]] | None = None,
    *,
    runbook_url_base: str = DEFAULT_RUNBOOK_URL_BASE,
    annotations: bool = True,
    engine_labels: Sequence[str] = ENGINE_LABELS,
) -> list[dict[str, object]]:
    """The catalog's rule groups as Prometheus writes them (``groups:`` of a rule file)."""
    rules = catalog.bind(overrides) if isinstance(catalog, Catalog) else list(catalog)
    groups: dict[str, list[dict[str, object]]] = {}
    for rule in rules:
        groups.setdefault(rule.group, []).append(
            rule_to_prometheus(
                rule,
                runbook_url_base=runbook_url_base,
                annotations=annotations,
                engine_labels=engine_labels,
            )
        )
    return [{"name": f"vllm-runbook-{name}", "rules": r} for name, r in groups.items()]


GENERATED_HEADER = (
    "# Generated by vllm-runbook from rules/catalog: edit the catalog, not this file.\n"
)


def export(
    catalog: Catalog | Iterable[Rule],
    overrides: Mapping[str, Mapping[str, object]] | None = None,
    *,
    runbook_url_base: str = DEFAULT_RUNBOOK_URL_BASE,
    annotations: bool = True,
    engine_labels: Sequence[str] = ENGINE_LABELS,
) -> str:
    """A Prometheus rule file (YAML text) for the catalog with `overrides` applied.

    ``annotations=False`` leaves out summary/description/runbook_url: the
    promtool unit tests use it, since promtool compares rendered annotations
    exactly and the value formatting is not what those tests are about.
    """
    groups = rule_groups(
        catalog,
        overrides,
        runbook_url_base=runbook_url_base,
        annotations=annotations,
        engine_labels=engine_labels,
    )
    return GENERATED_HEADER + dump_yaml({"groups": groups})


def dump_yaml(doc: object) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=1000, allow_unicode=True)
