"""SLO burn-rate alerts through both backends on series that burn the budget at known rates.

A constant burn at rate b (bad requests = b x the budget's share) makes every
window's error ratio b x budget, so exactly the pairs whose factor is below b
fire: each pair is tried at 1.1x its factor (it fires, with every slower pair)
and at 0.9x (it does not; the slower ones do). A burn that starts after three
days of clean traffic is caught by each pair when its long window's error
ratio crosses the line: after long window x factor / burn rate.
The embedded evaluator and `promtool test rules` (the exported recording rules
and alerts) read the same series and must agree on every alert at every time
checked.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import yaml
from rule_harness import (
    ENGINE,
    expand,
    parse_selector,
    promtool_required,
    promtool_version,
    series,
)
from vllm_runbook.rules.compiler import Compiler
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.promql import GENERATED_HEADER, dump_yaml
from vllm_runbook.rules.slo import (
    BUDGET_LEFT,
    BURN_RATE,
    PERIODS,
    VLLM_BUCKETS,
    SloSpec,
    alert_name,
    error_ratio,
    le_label,
    series_of,
    slo_rule_groups,
    slo_rules,
    span,
    windows,
)

PROMTOOL = promtool_version()
SCRAPE = 60.0
PER_SCRAPE = 1000  # requests finished per scrape interval

TTFT = SloSpec(name="ttft", objective="ttft", threshold=1.0, target=0.99)
AVAILABILITY = SloSpec(name="avail", objective="availability", target=0.99)
# End-to-end latency: 99.9 % of requests done within 5 s (a bucket bound of vLLM's).
E2E = SloSpec(name="e2e", objective="e2e_latency", threshold=5.0, target=0.999)
# TTFT over every other supported SLO window (the pairs' windows scaled to it).
OTHER_PERIODS = [
    SloSpec(name=f"ttft_{span(p)}", objective="ttft", threshold=1.0, target=0.99, window=p)
    for p in PERIODS
    if p != TTFT.window
]


def burning(slo: SloSpec, burn: float, samples: int) -> list[tuple[str, str]]:
    """Series on which `slo` burns its budget at `burn` x the sustainable rate from t=0."""
    bad = burn * slo.budget * PER_SCRAPE
    good = PER_SCRAPE - bad
    if slo.objective == "availability":
        name = "vllm:request_success_total"
        return [
            series(name, f"0+{good:g}x{samples}", finished_reason="stop"),
            series(name, f"0+{bad:g}x{samples}", finished_reason="error"),
            series(name, f"0+0x{samples}", finished_reason="abort"),
        ]
    name = series_of(slo.objective)
    bounds = VLLM_BUCKETS[slo.objective]
    below = bounds[bounds.index(slo.threshold) - 1]  # not the SLO's bucket
    return [
        series(name + "_count", f"0+{PER_SCRAPE}x{samples}"),
        series(name + "_bucket", f"0+{good / 2:g}x{samples}", le=le_label(below)),
        series(name + "_bucket", f"0+{good:g}x{samples}", le=slo.le),
        series(name + "_bucket", f"0+{PER_SCRAPE}x{samples}", le="+Inf"),
    ]


def run_evaluator(
    slo: SloSpec, data: list[tuple[str, str]], times: list[float], ratios: dict | None = None
) -> dict:
    """{time: set of firing alerts} as the embedded evaluator decides at each time;
    `ratios` gets its error ratio per window at the last time."""
    rules = slo_rules([slo])
    store = store_for_rules(rules, left_open=(PROMTOOL or 2) >= 3)
    evaluator = Evaluator(rules, store, MemoryIncidentSink())
    compiler = Compiler(store)
    samples = sorted(
        (
            (i * SCRAPE, *parse_selector(sel), v)
            for sel, values in data
            for i, v in enumerate(expand(values))
            if v is not None
        ),
        key=lambda s: s[0],
    )
    out, pos = {}, 0
    for t in sorted(times):
        while pos < len(samples) and samples[pos][0] <= t:
            ts, name, labels, v = samples[pos]
            store.add(labels["instance"], name, labels, ts, v)
            pos += 1
        evaluator.evaluate(t)
        out[t] = {rule.alert for rule, _engine, _value in evaluator.firing()}
    if ratios is not None:
        (engine,) = list(store)
        for window in (*windows(slo.window), slo.window):
            ratios[window] = compiler.expr(error_ratio(slo, window))(engine, max(times), {})
    return out


def run_promtool(
    slo: SloSpec,
    data: list[tuple[str, str]],
    expected: dict,
    workdir: Path,
    ratios: dict | None = None,
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules`: at each time, exactly the `expected` alerts fire; with
    the evaluator's error `ratios`, the recorded burn rates and budget left at the last
    time are exactly those the same arithmetic gives."""
    groups = slo_rule_groups([slo], annotations=False)
    (workdir / "slo.yml").write_text(GENERATED_HEADER + dump_yaml({"groups": groups}))
    checks = []
    for t, firing in expected.items():
        for rule in slo_rules([slo]):
            exp = [{"exp_labels": {**ENGINE, **rule.alert_labels}}] if rule.alert in firing else []
            checks.append(
                {"eval_time": format_duration(t), "alertname": rule.alert, "exp_alerts": exp}
            )
    records = []
    if ratios is not None:
        labels = {**ENGINE, "slo": slo.name}
        at = format_duration(max(expected))

        # The two backends' extrapolated rates may differ in the last bits (Go and
        # Python order the float operations differently): compared to the
        # billionth, rounded as PromQL's round() does.
        def rounded(value: float) -> float:
            inverse = 1.0 / 1e-9
            return math.floor(value * inverse + 0.5) / inverse

        burns = [
            {
                "labels": _labels("", {**labels, "window": span(p.long)}),
                "value": rounded(ratios[p.long] / slo.budget),
            }
            for p in slo.pairs
        ]
        left = rounded(1 - ratios[slo.window] / slo.budget)
        records = [
            {"expr": f"round({BURN_RATE}, 1e-9)", "eval_time": at, "exp_samples": burns},
            {
                "expr": f"round({BUDGET_LEFT}, 1e-9)",
                "eval_time": at,
                "exp_samples": [{"labels": _labels("", labels), "value": left}],
            },
        ]
    doc = {
        "rule_files": ["slo.yml"],
        "evaluation_interval": format_duration(SCRAPE),
        "tests": [
            {
                "interval": format_duration(SCRAPE),
                "input_series": [{"series": s, "values": v} for s, v in data],
                "alert_rule_test": checks,
                "promql_expr_test": records,
            }
        ],
    }
    (workdir / "test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run(
        ["promtool", "test", "rules", "test.yml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def _labels(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def need_promtool() -> None:
    if PROMTOOL is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        pytest.skip("promtool not installed (apt-get install prometheus); CI fails instead")


# Each pair at 1.1x and 0.9x its factor: the pairs expected to fire (every
# objective over 30 days, TTFT over each other supported window).
CONSTANT = [
    (slo, pair.factor * scale)
    for slo in (TTFT, E2E, AVAILABILITY, *OTHER_PERIODS)
    for pair in slo.pairs
    for scale in (1.1, 0.9)
]


def _expected(slo: SloSpec, burn: float) -> set[str]:
    return {alert_name(slo, p) for p in slo.pairs if p.factor < burn}


def _id(case: tuple[SloSpec, float]) -> str:
    return f"{case[0].name}-burn{case[1]:g}"


@pytest.mark.parametrize("case", CONSTANT, ids=_id)
def test_evaluator_fires_each_pair_above_its_rate_only(case) -> None:
    slo, burn = case
    data = burning(slo, burn, 20)
    got = run_evaluator(slo, data, [600.0])
    assert got == {600.0: _expected(slo, burn)}


def test_evaluator_is_quiet_below_the_slowest_pair() -> None:
    for slo in (TTFT, E2E, AVAILABILITY, *OTHER_PERIODS):
        assert run_evaluator(slo, burning(slo, 0.9, 20), [600.0]) == {600.0: set()}


@pytest.mark.parametrize(
    "case",
    [*CONSTANT, *((slo, 0.9) for slo in (TTFT, E2E, AVAILABILITY, *OTHER_PERIODS))],
    ids=_id,
)
def test_prometheus_agrees_on_a_constant_burn(case, tmp_path: Path) -> None:
    need_promtool()
    slo, burn = case
    data = burning(slo, burn, 20)
    ratios: dict = {}
    expected = run_evaluator(slo, data, [300.0, 600.0], ratios)
    assert expected[600.0] == _expected(slo, burn)
    for ratio in ratios.values():
        assert ratio / slo.budget == pytest.approx(burn, rel=1e-12)
    result = run_promtool(slo, data, expected, tmp_path, ratios)
    assert result.returncode == 0, result.stdout + result.stderr


# -- a burn that starts after three days of clean traffic -------------------------------

CLEAN = 3 * 86400 // int(SCRAPE)  # samples of clean traffic
BURN_MINUTES = 60


def _late_burn() -> list[tuple[str, str]]:
    """Every request good for 3 days, then every request slow (burn rate 1 / budget = 100)."""
    name = "vllm:time_to_first_token_seconds"
    good_total = CLEAN * PER_SCRAPE
    return [
        series(name + "_count", f"0+{PER_SCRAPE}x{CLEAN + BURN_MINUTES}"),
        series(
            name + "_bucket", f"0+{PER_SCRAPE}x{CLEAN} {good_total}x{BURN_MINUTES - 1}", le="1.0"
        ),
    ]


def _first_firing(timeline: dict, alert: str) -> float | None:
    return next((t for t in sorted(timeline) if alert in timeline[t]), None)


def test_evaluator_catches_a_late_burn_after_long_window_x_factor_over_burn() -> None:
    start = CLEAN * SCRAPE
    times = [start + m * SCRAPE for m in range(BURN_MINUTES + 1)]
    timeline = run_evaluator(TTFT, _late_burn(), times)
    burn = 1 / TTFT.budget  # every request bad: 100x
    for pair in TTFT.pairs:
        fired = _first_firing(timeline, alert_name(TTFT, pair))
        assert fired is not None, pair
        ideal = start + pair.long * pair.factor / burn  # 8.64 min, 21.6, 43.2, 43.2
        # the first scrape at or after the ideal moment, within one scrape's rounding
        assert ideal <= fired <= ideal + 2 * SCRAPE, (pair, (fired - start) / 60)
    assert timeline[start] == set()


def test_prometheus_agrees_on_a_late_burn(tmp_path: Path) -> None:
    need_promtool()
    start = CLEAN * SCRAPE
    data = _late_burn()
    times = [start + m * SCRAPE for m in range(BURN_MINUTES + 1)]
    timeline = run_evaluator(TTFT, data, times)
    checked = {start: timeline[start]}
    for pair in TTFT.pairs:  # the minute each pair starts firing, and the minute before
        fired = _first_firing(timeline, alert_name(TTFT, pair))
        assert fired is not None
        checked[fired] = timeline[fired]
        checked[fired - SCRAPE] = timeline[fired - SCRAPE]
    result = run_promtool(TTFT, data, checked, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# -- one model's engines ----------------------------------------------------------------

SCOPED = [
    SloSpec(name="mine", objective="ttft", threshold=1.0, target=0.99, model="m"),
    SloSpec(name="theirs", objective="ttft", threshold=1.0, target=0.99, model="other"),
    SloSpec(name="mine_ok", objective="availability", target=0.99, model="m"),
]


@pytest.mark.parametrize("slo", SCOPED, ids=lambda s: s.name)
def test_a_model_scoped_slo_reads_only_that_models_engines(slo: SloSpec, tmp_path: Path) -> None:
    data = burning(slo, 20.0, 20)  # the engine serves model "m"
    expected = _expected(slo, 20.0) if slo.model == "m" else set()
    timeline = run_evaluator(slo, data, [300.0, 600.0])
    assert timeline[600.0] == expected
    if PROMTOOL is not None:
        result = run_promtool(slo, data, timeline, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_evaluator_keeps_only_the_bucket_the_slo_reads() -> None:
    """3 days of one bucket and the count, not of all 23 buckets of the histogram."""
    store = store_for_rules(slo_rules([TTFT]))
    for selector, _values in burning(TTFT, 1.0, 1):
        name, labels = parse_selector(selector)
        store.add(labels["instance"], name, labels, 0.0, 1.0)
    (engine,) = list(store)
    kept = {(name, s.labels.get("le")) for name, ss in engine.by_name.items() for s in ss}
    assert kept == {
        ("vllm:time_to_first_token_seconds_count", None),
        ("vllm:time_to_first_token_seconds_bucket", "1.0"),
    }
    assert store.retention["vllm:time_to_first_token_seconds_bucket"] == 3 * 86400 + 60


# -- the SLO window's error ratio, from the 5-minute records ------------------------------


def _steps(base: float, increments: list[float]) -> str:
    """A counter from `base`, one value per minute, growing by each increment."""
    values = [base]
    for step in increments:
        values.append(values[-1] + step)
    return " ".join(f"{v:g}" for v in values)


def test_prometheus_reads_the_windows_ratio_from_the_records(tmp_path: Path) -> None:
    """20 minutes at 1 % errors (1000 requests a minute), 15 idle minutes, 10 minutes at
    25 % (200 a minute): over the SLO's window, 700 bad of 22000 requests. The budget
    group's ratio (sums of the 5-minute rates) is exactly that, idle minutes and all
    (a mean of 5-minute ratios, as Sloth records, would be NaN after an idle 5 minutes);
    so is the budget left."""
    need_promtool()
    slo = SloSpec(name="avail", objective="availability", target=0.99, window=7 * 86400.0)
    quiet = [0.0] * 5
    errors = quiet + [10.0] * 20 + [0.0] * 15 + [50.0] * 10 + quiet
    served = quiet + [990.0] * 20 + [0.0] * 15 + [150.0] * 10 + quiet
    name = "vllm:request_success_total"
    data = [
        series(name, _steps(100000, served), finished_reason="stop"),
        series(name, _steps(1000, errors), finished_reason="error"),
        series(name, _steps(0, [0.0] * len(served)), finished_reason="abort"),
    ]
    ratio = sum(errors) / (sum(errors) + sum(served))
    assert ratio == 700 / 22000
    groups = slo_rule_groups([slo], annotations=False)
    (tmp_path / "slo.yml").write_text(GENERATED_HEADER + dump_yaml({"groups": groups}))
    labels = {**ENGINE, "slo": slo.name}
    at = format_duration(len(served) * SCRAPE)

    def expect(expr: str, value: float) -> dict:
        inverse = 1e9
        exact = math.floor(value * inverse + 0.5) / inverse
        sample = {"labels": _labels("", labels), "value": exact}
        return {"expr": f"round({expr}, 1e-9)", "eval_time": at, "exp_samples": [sample]}

    doc = {
        "rule_files": ["slo.yml"],
        "evaluation_interval": format_duration(SCRAPE),
        "tests": [
            {
                "interval": format_duration(SCRAPE),
                "input_series": [{"series": s, "values": v} for s, v in data],
                "promql_expr_test": [
                    expect("vllm_runbook:slo_error_ratio:rate7d", ratio),
                    expect(BUDGET_LEFT, 1 - ratio / slo.budget),
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = subprocess.run(
        ["promtool", "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # the budget group reads two recorded series, not the raw ones
    (budget,) = [g for g in groups if str(g["name"]).endswith("-budget")]
    assert budget["interval"] == "1m"
    window_rule = next(r for r in budget["rules"] if r["record"].endswith("rate7d"))
    assert "vllm:" not in window_rule["expr"] and "sum_over_time" in window_rule["expr"]
