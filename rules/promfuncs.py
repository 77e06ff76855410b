"""Prometheus' arithmetic, reproduced so the in-service evaluator agrees with it.

rate() extrapolation, histogram_quantile's bucket interpolation, IEEE division
(x/0 = ±Inf, 0/0 = NaN, where Python raises) and the NaN rules of max/min.
Follows Prometheus 2.x/3.x `promql/functions.go` and `quantile.go`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NAN = math.nan
INF = math.inf


def div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return NAN
        return math.copysign(INF, a) * (math.copysign(1.0, b))
    return a / b


def agg_max(acc: float | None, x: float) -> float:
    # Prometheus: `if group < x || isNaN(group) { group = x }` — NaN loses to any number.
    return x if acc is None or acc < x or acc != acc else acc


def agg_min(acc: float | None, x: float) -> float:
    return x if acc is None or acc > x or acc != acc else acc


def extrapolated_rate(
    ts: Sequence[float],
    raw: Sequence[float],
    adjusted: Sequence[float],
    lo: int,
    hi: int,
    range_start: float,
    range_end: float,
) -> float | None:
    """rate() over samples [lo, hi) of a counter; `adjusted` has resets folded in.

    Returns None (no output) with fewer than two samples, like Prometheus.
    """
    if hi - lo < 2:
        return None
    first_t, last_t = ts[lo], ts[hi - 1]
    result = adjusted[hi - 1] - adjusted[lo]
    duration_to_start = first_t - range_start
    duration_to_end = range_end - last_t
    sampled = last_t - first_t
    average_between = sampled / (hi - lo - 1)
    first_value = raw[lo]
    if result > 0 and first_value >= 0:
        # Counters start at zero: do not extrapolate below it.
        duration_to_zero = sampled * (first_value / result)
        if duration_to_zero < duration_to_start:
            duration_to_start = duration_to_zero
    threshold = average_between * 1.1
    interval = sampled
    interval += duration_to_start if duration_to_start < threshold else average_between / 2
    interval += duration_to_end if duration_to_end < threshold else average_between / 2
    return result * (interval / sampled) / (range_end - range_start)


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """histogram_quantile over (upper bound, cumulative rate) pairs of one histogram."""
    if math.isnan(q):
        return NAN
    if q < 0:
        return -INF
    if q > 1:
        return INF
    buckets = sorted(buckets)
    if not buckets or not math.isinf(buckets[-1][0]):
        return NAN
    merged: list[list[float]] = []
    for upper, count in buckets:  # coalesce equal bounds ("1" and "1.0")
        if merged and merged[-1][0] == upper:
            merged[-1][1] += count
        else:
            merged.append([upper, count])
    top = -INF
    for bucket in merged:  # extrapolated bucket rates can be slightly non-monotonic
        if bucket[1] > top:
            top = bucket[1]
        elif bucket[1] < top:
            bucket[1] = top
    if len(merged) < 2:
        return NAN
    observations = merged[-1][1]
    if observations == 0:
        return NAN
    rank = q * observations
    b = len(merged) - 1
    for i in range(len(merged) - 1):
        if merged[i][1] >= rank:
            b = i
            break
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, end, count = 0.0, merged[b][0], merged[b][1]
    if b > 0:
        start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    return start + (end - start) * (rank / count)
