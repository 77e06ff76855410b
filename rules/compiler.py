"""In-service backend: the condition tree compiled to Python closures over a WindowStore.

A compiled expression maps (engine, time, cycle cache) to None (no value,
as an empty PromQL result), a float, or {gpu: float} while still per GPU.
Identical subtrees of different rules compile to one closure with one cache
slot, so a quantile that three rules read is computed once per engine and
cycle. Semantics mirror vllm_runbook.rules.promql line for line.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Union

from vllm_runbook.rules import condition as C
from vllm_runbook.rules.promfuncs import agg_max, agg_min, bucket_quantile, div, extrapolated_rate
from vllm_runbook.rules.window import EngineSeries, Series, WindowStore

Value = Union[float, dict[str, float], None]  # noqa: UP007 (runtime alias)
Cache = dict[tuple[int, float], Value]
Fn = Callable[[EngineSeries, float, Cache], Value]

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


class Compiler:
    """Compiles nodes against one store; shares closures between equal subtrees."""

    def __init__(self, store: WindowStore) -> None:
        self.store = store
        self._compiled: dict[object, Fn] = {}

    def condition(self, cond: C.Condition) -> Fn:
        return self._memo(cond, self._condition)

    def _memo(self, node: object, build: Callable[[object], Fn]) -> Fn:
        fn = self._compiled.get(node)
        if fn is None:
            inner = build(node)
            slot = len(self._compiled)

            def fn(
                eng: EngineSeries, t: float, cache: Cache, inner: Fn = inner, slot: int = slot
            ) -> Value:
                key = (slot, t)
                if key in cache:
                    return cache[key]
                value = cache[key] = inner(eng, t, cache)
                return value

            self._compiled[node] = fn
        return fn

    # -- conditions ------------------------------------------------------------
    def _condition(self, node: object) -> Fn:
        match node:
            case C.Compare(expr, op, threshold):
                value_fn, cmp = self.expr(expr), _OPS[op]

                def compare(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    v = value_fn(eng, t, cache)
                    return v if v is not None and cmp(v, threshold) else None  # type: ignore[arg-type]

                return compare
            case C.AllOf(terms):
                fns = [self.condition(x) for x in terms]
                # The cheapest terms first (an engine fails most conditions on a
                # gauge before a quantile is needed); the value is the first term's
                # (`and` keeps the left-hand value), from the cycle's cache.
                ordered = [fns[i] for i in sorted(range(len(terms)), key=lambda i: cost(terms[i]))]
                left = fns[0]

                def all_of(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    for f in ordered:
                        if f(eng, t, cache) is None:
                            return None
                    return left(eng, t, cache)

                return all_of
            case C.AnyOf(terms):
                fns = [self.condition(x) for x in terms]

                def any_of(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    for f in fns:  # `or` keeps the first side that has the engine
                        v = f(eng, t, cache)
                        if v is not None:
                            return v
                    return None

                return any_of
            case C.Unless(kept, excluded):
                kept_fn, excluded_fn = self.condition(kept), self.condition(excluded)

                if cost(excluded) < cost(kept):  # the cheaper side first; the same answer

                    def unless(eng: EngineSeries, t: float, cache: Cache) -> Value:
                        if excluded_fn(eng, t, cache) is not None:
                            return None
                        return kept_fn(eng, t, cache)  # `unless` keeps the left-hand value

                    return unless

                def unless_(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    value = kept_fn(eng, t, cache)  # `unless` keeps the left-hand value
                    if value is None or excluded_fn(eng, t, cache) is not None:
                        return None
                    return value

                return unless_
        raise TypeError(node)

    # -- expressions -----------------------------------------------------------
    def expr(self, node: C.Expr) -> Fn:
        return self._memo(node, self._expr)  # type: ignore[arg-type]

    def _expr(self, node: C.Expr) -> Fn:
        store = self.store
        match node:
            case C.Instant(sel):
                name, matchers, per = sel.metric, sel.matchers, sel.signal.per

                def instant(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    return _group(
                        eng.matching(name, matchers), per, lambda s: store.latest(s, t), agg_max
                    )

                return instant
            case C.TimeSince(sel):
                latest = self.expr(C.Instant(sel))

                def time_since(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    v = latest(eng, t, cache)  # time() - max by (...) (timestamp gauge)
                    if v is None:
                        return None
                    if isinstance(v, dict):
                        return {k: t - x for k, x in v.items()}
                    return t - v

                return time_since
            case C.Rate(sel, window):
                name, matchers, per = sel.metric, sel.matchers, sel.signal.per
                if per is None:  # one value per engine: the sum of the series' rates

                    def rate_sum(eng: EngineSeries, t: float, cache: Cache) -> Value:
                        acc: float | None = None
                        for s in eng.matching(name, matchers):
                            r = _rate(store, s, t, window)
                            if r is not None:
                                acc = r if acc is None else acc + r
                        return acc

                    return rate_sum

                def rate(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    return _group(
                        eng.matching(name, matchers),
                        per,
                        lambda s: _rate(store, s, t, window),
                        _sum,
                    )

                return rate
            case C.OverTime(fn_name, sel, window):
                name, matchers, per = sel.metric, sel.matchers, sel.signal.per
                reduce = _OVER_TIME[fn_name]

                def over_time(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    def read(s: Series) -> float | None:
                        lo, hi = store.bounds(s, t, window)
                        return reduce(s.values[lo:hi]) if hi > lo else None

                    return _group(eng.matching(name, matchers), per, read, agg_max)

                return over_time
            case C.Quantile(q, sel, window):
                name, matchers = sel.metric + "_bucket", sel.matchers
                per = sel.signal.per

                def quantile(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    # a rate per bucket: _rate inlined (a histogram has tens of them)
                    groups: dict[str, dict[float, float]] = {}
                    start, left_open = t - window, store.left_open
                    for s in eng.matching(name, matchers):
                        upper = s.le
                        if upper is None:
                            continue
                        ts, first = s.ts, s.start
                        hi = len(ts) if ts and ts[-1] <= t else bisect_right(ts, t, first)
                        if left_open:
                            lo = bisect_right(ts, start, first, hi)
                        else:
                            lo = bisect_left(ts, start, first, hi)
                        if hi - lo < 2:
                            continue
                        r = extrapolated_rate(ts, s.values, s.adjusted, lo, hi, start, t)  # type: ignore[arg-type]
                        if r is None:
                            continue
                        g = groups.setdefault(s.labels.get(per, "") if per else "", {})
                        g[upper] = g.get(upper, 0.0) + r
                    if not groups:
                        return None
                    out = {k: bucket_quantile(q, list(b.items())) for k, b in groups.items()}
                    return out if per else out[""]

                return quantile
            case C.Ratio(num, den):
                nf, df = self.expr(num), self.expr(den)

                def ratio(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    a = nf(eng, t, cache)
                    if a is None:
                        return None
                    b = df(eng, t, cache)
                    if b is None:
                        return None
                    if isinstance(a, dict) and isinstance(b, dict):
                        return {k: div(a[k], b[k]) for k in a if k in b} or None
                    return div(a, b)  # type: ignore[arg-type]

                return ratio
            case C.Difference(left, right):
                lf, rf = self.expr(left), self.expr(right)

                def difference(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    a = lf(eng, t, cache)
                    if a is None:
                        return None
                    b = rf(eng, t, cache)
                    if b is None:
                        return None
                    if isinstance(a, dict) and isinstance(b, dict):
                        return {k: a[k] - b[k] for k in a if k in b} or None
                    return a - b  # type: ignore[operator]

                return difference
            case C.Reduce(fn_name, _, of):
                of_fn = self.expr(of)
                fold = _REDUCE[fn_name]

                def reduce_(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    values = of_fn(eng, t, cache)
                    if not values:
                        return None
                    return fold(list(values.values()))  # type: ignore[union-attr]

                return reduce_
            case C.Offset(of, by):
                of_fn = self.expr(of)

                def offset(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    return of_fn(eng, t - by, cache)

                return offset
            case C.Fallback(first, second):
                first_fn, second_fn = self.expr(first), self.expr(second)

                def fallback(eng: EngineSeries, t: float, cache: Cache) -> Value:
                    a = first_fn(eng, t, cache)
                    if a is not None and not isinstance(a, dict):
                        return a
                    b = second_fn(eng, t, cache)
                    if a is None:
                        return b
                    # per label: `or` adds the second side's label values the first lacks
                    return {**b, **a} if isinstance(b, dict) else a

                return fallback
        raise TypeError(node)


# What reading a leaf costs on one engine, relative (a quantile: a rate per bucket).
_LEAF_COST: dict[type, int] = {
    C.Instant: 1,
    C.TimeSince: 1,
    C.OverTime: 3,
    C.Rate: 3,
    C.Quantile: 30,
}


def cost(node: C.Expr | C.Condition) -> int:
    """The relative cost of evaluating `node` on one engine (the order of an `all`)."""
    return sum(_LEAF_COST[type(leaf)] for leaf, _ in C.leaves(node))


def _rate(store: WindowStore, s: Series, t: float, window: float) -> float | None:
    lo, hi = store.bounds(s, t, window)
    assert s.adjusted is not None, "rate() of a series stored as a gauge"
    return extrapolated_rate(s.ts, s.values, s.adjusted, lo, hi, t - window, t)


def _sum(acc: float | None, x: float) -> float:
    return x if acc is None else acc + x


def _group(
    series: list[Series],
    per: str | None,
    read: Callable[[Series], float | None],
    combine: Callable[[float | None, float], float],
) -> Value:
    """Aggregate the series' values by engine (or by engine and `per`): PromQL's `by`."""
    if per is None:
        acc: float | None = None
        for s in series:
            v = read(s)
            if v is not None:
                acc = combine(acc, v)
        return acc
    out: dict[str, float] = {}
    for s in series:
        v = read(s)
        if v is not None:
            k = s.labels.get(per, "")
            out[k] = combine(out.get(k), v)
    return out or None


def _fold(combine: Callable[[float | None, float], float]) -> Callable[[list[float]], float]:
    def fold(values: list[float]) -> float:
        acc: float | None = None
        for v in values:
            acc = combine(acc, v)
        assert acc is not None
        return acc

    return fold


def _spread(values: list[float]) -> float:
    return _fold(agg_max)(values) - _fold(agg_min)(values)


def _avg(values: object) -> float:
    vals = list(values)  # type: ignore[call-overload]
    # fsum unless a value is infinite (then sum: Prometheus' plain addition). A finite
    # fsum had no infinite value to add; an infinite one had (or raised ValueError for
    # inf + -inf), and then the plain sum is infinite (or NaN) as well: one pass over
    # the window instead of a scan for infinities before it.
    try:
        total = math.fsum(vals)
    except ValueError:  # inf + -inf
        return sum(vals) / len(vals)
    return total / len(vals) if math.isfinite(total) else sum(vals) / len(vals)


def _max_over_time(values: object) -> float:
    # Prometheus: start with the first sample; `if v > max || isNaN(max) { max = v }`
    it = iter(values)  # type: ignore[call-overload]
    acc = next(it)
    for v in it:
        if v > acc or acc != acc:
            acc = v
    return acc


def _min_over_time(values: object) -> float:
    it = iter(values)  # type: ignore[call-overload]
    acc = next(it)
    for v in it:
        if v < acc or acc != acc:
            acc = v
    return acc


_OVER_TIME: dict[str, Callable[[object], float]] = {
    "avg": _avg,
    "max": _max_over_time,
    "min": _min_over_time,
}
_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "max": _fold(agg_max),
    "min": _fold(agg_min),
    "sum": _fold(_sum),
    "spread": _spread,
}
