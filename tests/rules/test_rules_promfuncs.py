"""Prometheus arithmetic reproduced exactly (values worked out by hand from functions.go)."""

from __future__ import annotations

import math
from array import array

from vllm_runbook.rules.promfuncs import agg_max, agg_min, bucket_quantile, div, extrapolated_rate


def rate(ts: list[float], vs: list[float], start: float, end: float) -> float | None:
    adjusted, offset = [], 0.0
    for i, v in enumerate(vs):
        if i and v < vs[i - 1]:
            offset += vs[i - 1]
        adjusted.append(v + offset)
    return extrapolated_rate(
        array("d", ts), array("d", vs), array("d", adjusted), 0, len(ts), start, end
    )


def test_rate_needs_two_samples() -> None:
    assert rate([10.0], [5.0], 0.0, 60.0) is None


def test_rate_exact_cover_no_extrapolation() -> None:
    # samples at both window edges: 60 increments over 60 s
    assert rate([0.0, 30.0, 60.0], [100.0, 130.0, 160.0], 0.0, 60.0) == 1.0


def test_rate_extrapolates_half_an_interval_past_a_far_edge() -> None:
    # first sample 40 s after the start (> 1.1 * 10 s): extrapolate by 5 s only
    # (100 / 10 per s * 35 s) / 60 s; the zero point (100 s back) is further away
    assert rate([40.0, 50.0, 60.0], [100.0, 110.0, 120.0], 0.0, 60.0) == 20 * (25 / 20) / 60


def test_rate_stops_at_counter_zero() -> None:
    # zero point 10 s before the first sample, nearer than the window start
    assert rate([30.0, 60.0], [10.0, 40.0], 0.0, 60.0) == 30 * (40 / 30) / 60


def test_rate_counter_reset_adds_the_value_before_it() -> None:
    # 100 -> 130, reset to 5 -> 35: increase 30 + 130 - 100 ... = 130 - 100 + 130 + 35 - 130
    assert rate([0.0, 20.0, 40.0, 60.0], [100.0, 130.0, 5.0, 35.0], 0.0, 60.0) == 65 / 60


def test_bucket_quantile_interpolates_within_the_bucket() -> None:
    buckets = [(0.5, 90.0), (1.0, 90.0), (2.5, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(0.99, buckets) == 1.0 + 1.5 * 0.9


def test_bucket_quantile_edge_cases() -> None:
    assert math.isnan(bucket_quantile(0.5, [(1.0, 1.0)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))  # no observations
    assert bucket_quantile(0.99, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # in +Inf: last finite
    assert bucket_quantile(1.5, [(1.0, 1.0), (math.inf, 1.0)]) == math.inf
    # non-monotonic rates (extrapolation) are flattened; "1" and "1.0" merge
    # (without the merge the rank 5 would fall into +Inf and give 2.0)
    assert bucket_quantile(0.5, [(1.0, 4.0), (1.0, 1.0), (2.0, 4.0), (math.inf, 10.0)]) == 1.0


def test_division_is_ieee() -> None:
    assert div(1.0, 0.0) == math.inf
    assert div(-1.0, 0.0) == -math.inf
    assert math.isnan(div(0.0, 0.0))
    assert div(3.0, 2.0) == 1.5


def test_nan_loses_in_max_and_min() -> None:
    assert agg_max(math.nan, 1.0) == 1.0
    assert agg_max(2.0, math.nan) == 2.0
    assert agg_min(math.nan, 3.0) == 3.0
    assert math.isnan(agg_max(None, math.nan))


def test_a_bucket_whose_le_is_no_number_is_left_out_of_the_quantile() -> None:
    """As Prometheus' histogram_quantile: a malformed `le` skips that bucket (the
    evaluator reads each bound once, when the series is first stored)."""
    from vllm_runbook.rules import condition as C
    from vllm_runbook.rules.compiler import Compiler
    from vllm_runbook.rules.signals import SIGNALS
    from vllm_runbook.rules.window import WindowStore

    name = "vllm:e2e_request_latency_seconds_bucket"
    store = WindowStore({name: 600.0}, counters={name})
    labels = {"model_name": "m", "engine": "0"}
    # per second over the window: 90 under 0.5 s, 0 more under 1 s, 10 more under 2.5
    for le, per_s in (("0.5", 90.0), ("1.0", 90.0), ("2.5", 100.0), ("+Inf", 100.0), ("x", 1e6)):
        for t in (0.0, 30.0, 60.0):
            store.add("i", name, {**labels, "le": le}, t, per_s * t)
    quantile = Compiler(store).expr(C.Quantile(0.99, C.Selector(SIGNALS["e2e_latency"]), 60.0))
    [engine] = store
    assert quantile(engine, 60.0, {}) == 1.0 + 1.5 * 0.9
