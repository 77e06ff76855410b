"""YAML condition -> condition tree (vllm_runbook.rules.condition), with ``$param`` substitution.

Forms (a bare string is a gauge's latest value):

    expressions   kv_hit_ratio | {signal: NAME, labels: {k: v}}
                  {rate: SEL, window: 5m}            counters
                  {avg_over_time|max_over_time|min_over_time: SEL, window: 5m}   gauges
                  {quantile: SEL, q: 0.99, window: 5m}                          histograms
                  {time_since: SEL}                  now - a timestamp gauge
                  {ratio: [EXPR, EXPR]}
                  {max|min|sum|spread: EXPR, over: gpu}
                  {offset: EXPR, by: 30m}
                  {change: EXPR, vs_earlier: 30m}    EXPR now / EXPR 30m ago
                  {change: EXPR, vs_baseline: 1h}    EXPR now / EXPR over the 1h that
                                                     ends before EXPR's window and `for`
    conditions    {expr: EXPR, above|at_least|below|at_most: NUMBER}
                  {rising|falling: EXPR, vs_earlier|vs_baseline: D, by_at_least: X}
                  {all: [COND, ...]} | {any: [COND, ...]}
                  any of these with `unless: COND` beside its keys: not where
                  COND holds (PromQL `unless`; an absent or NaN COND excludes nothing)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from vllm_runbook.rules import condition as C
from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.rules.errors import (
    DurationError,
    Problem,
    SyntaxProblem,
    UnknownParameterError,
    UnknownSignalError,
)
from vllm_runbook.rules.signals import SIGNALS, unknown_signal
from vllm_runbook.rules.yamlmarks import MarkedDict, line_of

_COMPARE = {"above": ">", "at_least": ">=", "below": "<", "at_most": "<="}
_OVER_TIME = {"avg_over_time": "avg", "max_over_time": "max", "min_over_time": "min"}
_REDUCE = ("max", "min", "sum", "spread")
_EXPR_KINDS = (
    "signal",
    "rate",
    "quantile",
    "time_since",
    "ratio",
    "offset",
    "change",
    *_OVER_TIME,
    *_REDUCE,
)


class ConditionParser:
    """Parses one rule's condition; `params` are the bound parameter values."""

    def __init__(
        self, params: Mapping[str, object], line: int | None = None, for_seconds: float = 0.0
    ) -> None:
        self.params = params
        self.line = line
        self.for_seconds = for_seconds  # the rule's `for`: baselines end before it

    # -- helpers ---------------------------------------------------------------
    def fail(self, msg: str, node: object = None, cls: type[Problem] = SyntaxProblem) -> NoReturn:
        raise cls(msg, line=line_of(node, self.line))

    def value(self, raw: object, node: object = None) -> object:
        """Resolve ``$name`` to the parameter's value."""
        if isinstance(raw, str) and raw.startswith("$"):
            name = raw[1:]
            if name not in self.params:
                self.fail(f"unknown parameter {raw!r}", node, UnknownParameterError)
            return self.params[name]
        return raw

    def number(self, raw: object, node: object, what: str) -> float:
        """A number; a duration string counts as its seconds (``below: 10m`` on an uptime)."""
        val = self.value(raw, node)
        if isinstance(val, str):
            return self.duration(val, node)
        if isinstance(val, bool) or not isinstance(val, int | float):
            self.fail(f"{what} must be a number, got {val!r}", node)
        return float(val)

    def duration(self, raw: object, node: object) -> float:
        try:
            return parse_duration(self.value(raw, node))
        except DurationError as exc:
            raise exc.located(line=line_of(node, self.line)) from None

    def mapping(self, raw: object, what: str) -> MarkedDict:
        if not isinstance(raw, MarkedDict):
            self.fail(f"{what} must be a mapping, got {raw!r}", raw)
        return raw

    def kind(self, raw: MarkedDict, kinds: tuple[str, ...], what: str) -> str:
        found = [k for k in raw if k in kinds]
        if len(found) != 1:
            self.fail(
                f"{what} needs exactly one of {', '.join(kinds)}; got keys {sorted(raw)}", raw
            )
        return found[0]

    def only(self, raw: MarkedDict, allowed: set[str]) -> None:
        extra = sorted(set(raw) - allowed)
        if extra:
            self.fail(f"unexpected key(s) {extra}; allowed: {sorted(allowed)}", raw)

    # -- selectors -------------------------------------------------------------
    def selector(self, raw: object, node: object, *types: str) -> C.Selector:
        labels: dict[str, str] = {}
        if isinstance(raw, MarkedDict):
            self.only(raw, {"signal", "labels"})
            node = raw
            labels_raw = raw.get("labels") or {}
            if not isinstance(labels_raw, Mapping):
                self.fail("labels must be a mapping", raw)
            labels = {str(k): str(self.value(v, raw)) for k, v in labels_raw.items()}
            raw = raw.get("signal")
        name = self.value(raw, node)
        if not isinstance(name, str):
            self.fail(f"expected a signal name, got {name!r}", node)
        why = unknown_signal(name)
        if why is not None:
            self.fail(why, node, UnknownSignalError)
        signal = SIGNALS[name]
        if types and signal.type not in types:
            self.fail(
                f"signal {name!r} is a {signal.type}; here a {' or '.join(types)} is needed", node
            )
        return C.Selector(signal, tuple(sorted(labels.items())))

    # -- expressions -----------------------------------------------------------
    def expr(self, raw: object, at: int | None = None) -> C.Expr:
        """`at`: the line to blame when `raw` is a bare string (scalars carry no line)."""
        if isinstance(raw, str):
            return C.Instant(self.selector(raw, _Line(at), "gauge"))
        node = self.mapping(raw, "an expression")
        kind = self.kind(node, _EXPR_KINDS, "an expression")
        arg = node[kind]
        if kind == "signal":
            return C.Instant(self.selector(node, node, "gauge"))
        if kind == "rate":
            self.only(node, {"rate", "window"})
            return C.Rate(self.selector(arg, node, "counter"), self.window(node))
        if kind in _OVER_TIME:
            self.only(node, {kind, "window"})
            sel = self.selector(arg, node, "gauge")
            return C.OverTime(_OVER_TIME[kind], sel, self.window(node))  # type: ignore[arg-type]
        if kind == "quantile":
            self.only(node, {"quantile", "q", "window"})
            q = self.number(node.get("q"), node, "q")
            if not 0 <= q <= 1:
                self.fail(f"q must be within 0..1, got {q}", node)
            return C.Quantile(q, self.selector(arg, node, "histogram"), self.window(node))
        if kind == "time_since":
            self.only(node, {"time_since"})
            return C.TimeSince(self.selector(arg, node, "gauge"))
        if kind == "ratio":
            self.only(node, {"ratio"})
            if not isinstance(arg, list) or len(arg) != 2:
                self.fail("ratio takes a list of two expressions [numerator, denominator]", node)
            num, den = self.expr(arg[0], line_of(arg)), self.expr(arg[1], line_of(arg))
            pn, pd = C.per_label(num), C.per_label(den)
            if pn and pd and pn != pd:
                self.fail(f"ratio of series split by different labels ({pn}, {pd})", node)
            if bool(pn) != bool(pd):
                self.fail(
                    "ratio of a per-GPU and a per-engine value: reduce the per-GPU side first", node
                )
            return C.Ratio(num, den)
        if kind in _REDUCE:
            self.only(node, {kind, "over"})
            of = self.expr(arg, node.line_of(kind))
            over = node.get("over")
            per = C.per_label(of)
            if per is None or over != per:
                self.fail(f"{kind} over {over!r}: the expression is split by {per!r}", node)
            return C.Reduce(kind, over, of)  # type: ignore[arg-type]
        if kind == "offset":
            self.only(node, {"offset", "by"})
            of = self.expr(arg, node.line_of(kind))
            self.no_time_since(of, node)
            return C.Offset(of, self.duration(node.get("by"), node))
        assert kind == "change"
        self.only(node, {"change", "vs_earlier", "vs_baseline"})
        return self.change(arg, node)

    def window(self, node: MarkedDict) -> float:
        if "window" not in node:
            self.fail("missing window (e.g. window: 5m)", node)
        return self.duration(node["window"], node)

    def no_time_since(self, expr: C.Expr, node: object) -> None:
        if any(isinstance(leaf, C.TimeSince) for leaf, _ in C.leaves(expr)):
            self.fail("time_since cannot be shifted or baselined", node)

    def change(self, arg: object, node: MarkedDict) -> C.Ratio:
        now = self.expr(arg, node.line)
        self.no_time_since(now, node)
        vs = [k for k in ("vs_earlier", "vs_baseline") if k in node]
        if len(vs) != 1:
            self.fail("a change needs exactly one of vs_earlier, vs_baseline", node)
        span = self.duration(node[vs[0]], node)
        if vs[0] == "vs_earlier":
            return C.Ratio(now, C.Offset(now, span))
        try:
            return C.Ratio(now, C.baseline(now, span, self.for_seconds))
        except ValueError as exc:
            self.fail(str(exc), node)

    # -- conditions ------------------------------------------------------------
    def condition(self, raw: object) -> C.Condition:
        node = self.mapping(raw, "a condition")
        if "unless" in node:
            kept = self.condition_kind(node, frozenset({"unless"}))
            return C.Unless(kept, self.condition(node["unless"]))
        return self.condition_kind(node)

    def condition_kind(self, node: MarkedDict, beside: frozenset[str] = frozenset()) -> C.Condition:
        """The condition `node` states (`beside`: keys it may carry for its caller)."""
        kinds = ("all", "any", "expr", "rising", "falling")
        kind = self.kind(node, kinds, "a condition")
        if kind in ("all", "any"):
            self.only(node, {kind} | beside)
            terms = node[kind]
            if not isinstance(terms, list) or not terms:
                self.fail(f"{kind} takes a non-empty list of conditions", node)
            parsed = tuple(self.condition(t) for t in terms)
            return C.AllOf(parsed) if kind == "all" else C.AnyOf(parsed)
        if kind == "expr":
            ops = [k for k in _COMPARE if k in node]
            if len(ops) != 1:
                self.fail(f"a comparison needs exactly one of {', '.join(_COMPARE)}", node)
            self.only(node, {"expr", ops[0]} | beside)
            expr = self.expr(node["expr"], node.line_of("expr"))
            value = self.number(node[ops[0]], node, ops[0])
            return self.compare(expr, _COMPARE[ops[0]], value, node)
        self.only(node, {kind, "vs_earlier", "vs_baseline", "by_at_least"} | beside)
        ratio = self.change(node[kind], node)
        by = self.number(node.get("by_at_least"), node, "by_at_least")
        if by < 0 or (kind == "falling" and by > 1):
            self.fail(f"by_at_least out of range: {by}", node)
        if kind == "rising":
            return self.compare(ratio, ">=", 1 + by, node)
        return self.compare(ratio, "<=", 1 - by, node)

    def compare(self, expr: C.Expr, op: Any, value: float, node: object) -> C.Compare:
        per = C.per_label(expr)
        if per is not None:
            self.fail(
                f"compare one value per engine: reduce over {per!r} first (max/min/sum/spread)",
                node,
            )
        return C.Compare(expr, op, value)


class _Line:
    """Stands in for a node when only a line number is known."""

    def __init__(self, line: int | None) -> None:
        self.line = line
