"""The condition language: a small tree that both backends compile.

Expressions give one number per engine (or per engine and GPU where the
signal has a `per` label, until a Reduce folds that label away). Conditions
compare an expression with a constant and combine comparisons with all/any,
and drop an engine where another condition holds (unless).
The YAML sugar (``change``, ``rising``/``falling``, ``vs_baseline``) is
rewritten by the parser into these nodes, so the backends know only this
short list — which is what keeps PromQL and the in-service evaluator equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from vllm_runbook.rules.signals import Signal

OverTimeFn = Literal["avg", "max", "min"]
ReduceFn = Literal["max", "min", "sum", "spread"]
CompareOp = Literal[">", ">=", "<", "<="]


@dataclass(frozen=True)
class Selector:
    """A signal with optional exact label filters (``finished_reason="error"``)."""

    signal: Signal
    matchers: tuple[tuple[str, str], ...] = ()

    @property
    def metric(self) -> str:
        """The series queried (the parser selects only signals that are series)."""
        assert self.signal.metric is not None, self.signal.name
        return self.signal.metric


@dataclass(frozen=True)
class Instant:
    """Latest value of a gauge (5 min look-back, like Prometheus)."""

    sel: Selector


@dataclass(frozen=True)
class Rate:
    """Per-second rate of a counter over `window`, Prometheus-extrapolated."""

    sel: Selector
    window: float


@dataclass(frozen=True)
class OverTime:
    """avg/max/min of a gauge's samples within `window`."""

    fn: OverTimeFn
    sel: Selector
    window: float


@dataclass(frozen=True)
class Quantile:
    """histogram_quantile(q) of a histogram's bucket rates over `window`."""

    q: float
    sel: Selector
    window: float


@dataclass(frozen=True)
class TimeSince:
    """Evaluation time minus a timestamp gauge (engine uptime)."""

    sel: Selector


@dataclass(frozen=True)
class Ratio:
    num: Expr
    den: Expr


@dataclass(frozen=True)
class Difference:
    """`left - right`, engine by engine (an SLO's bad events: all minus good)."""

    left: Expr
    right: Expr


@dataclass(frozen=True)
class Reduce:
    """Fold the per-GPU series of one engine: max, min, sum or spread (max - min)."""

    fn: ReduceFn
    over: str
    of: Expr


@dataclass(frozen=True)
class Offset:
    """`of` as it was `by` seconds earlier."""

    of: Expr
    by: float


@dataclass(frozen=True)
class Fallback:
    """`first` where the engine has it, else `second` (PromQL's `or`): a plugin
    series, and vLLM's own series for the same quantity (rules.needs)."""

    first: Expr
    second: Expr


Expr = (
    Instant
    | Rate
    | OverTime
    | Quantile
    | TimeSince
    | Ratio
    | Difference
    | Reduce
    | Offset
    | Fallback
)


@dataclass(frozen=True)
class Compare:
    expr: Expr
    op: CompareOp
    value: float


@dataclass(frozen=True)
class AllOf:
    terms: tuple[Condition, ...]


@dataclass(frozen=True)
class AnyOf:
    terms: tuple[Condition, ...]


@dataclass(frozen=True)
class Unless:
    """`kept` where `excluded` does not hold (PromQL's `unless`): two findings that
    must not both fire for one engine (a latency rise with the queue growing, and
    one without)."""

    kept: Condition
    excluded: Condition


Condition = Compare | AllOf | AnyOf | Unless

Leaf = Instant | Rate | OverTime | Quantile | TimeSince


def per_label(expr: Expr) -> str | None:
    """The label still splitting `expr`'s values within one engine (None: one value)."""
    match expr:
        case Instant(sel) | Rate(sel, _) | OverTime(_, sel, _) | TimeSince(sel):
            return sel.signal.per
        case Quantile():
            return expr.sel.signal.per
        case Ratio(num, den) | Difference(num, den) | Fallback(num, den):
            return per_label(num) or per_label(den)
        case Reduce():
            return None
        case Offset(of, _):
            return per_label(of)
    raise TypeError(expr)


def leaves(node: Expr | Condition, offset: float = 0.0) -> Iterator[tuple[Leaf, float]]:
    """Every leaf with the total offset it is read at (for sizing windows)."""
    match node:
        case Compare(expr, _, _):
            yield from leaves(expr, offset)
        case AllOf(terms) | AnyOf(terms):
            for t in terms:
                yield from leaves(t, offset)
        case Unless(kept, excluded):
            yield from leaves(kept, offset)
            yield from leaves(excluded, offset)
        case Ratio(num, den) | Difference(num, den) | Fallback(num, den):
            yield from leaves(num, offset)
            yield from leaves(den, offset)
        case Reduce(_, _, of):
            yield from leaves(of, offset)
        case Offset(of, by):
            yield from leaves(of, offset + by)
        case _:
            yield node, offset


def reach(expr: Expr) -> float:
    """How far back `expr` reads: the largest offset + window among its leaves."""
    return max(
        (offset + getattr(leaf, "window", 0.0) for leaf, offset in leaves(expr)), default=0.0
    )


def baseline(expr: Expr, span: float, for_seconds: float) -> Offset:
    """`expr` over a `span` window that ends where `expr`'s own windows and the
    rule's `for` period begin: a change must not be in the baseline it is
    compared with, for as long as the rule needs it to hold."""
    return Offset(with_window(expr, span), reach(expr) + for_seconds)


def with_window(expr: Expr, window: float) -> Expr:
    """`expr` with every window replaced: the same measure over a baseline window."""
    match expr:
        case Rate(sel, _):
            return Rate(sel, window)
        case OverTime(fn, sel, _):
            return OverTime(fn, sel, window)
        case Quantile(q, sel, _):
            return Quantile(q, sel, window)
        case Ratio(num, den):
            return Ratio(with_window(num, window), with_window(den, window))
        case Difference(left, right):
            return Difference(with_window(left, window), with_window(right, window))
        case Fallback(first, second):
            return Fallback(with_window(first, window), with_window(second, window))
        case Reduce(fn, over, of):
            return Reduce(fn, over, with_window(of, window))
        case Offset(of, by):
            return Offset(with_window(of, window), by)
    raise ValueError("a baseline needs windowed measures (rate, quantile, *_over_time)")
