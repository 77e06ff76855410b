"""Every PromQL expression of the dashboards and of the exported rules, read by a real
PromQL parser (promql-parser: Prometheus' grammar), without promtool or a Prometheus.

The lint takes metric and label names from the syntax tree; a syntax error in a
dashboard or a rule is a problem the generator refuses to write.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import yaml
from vllm_runbook.dashboards import lint
from vllm_runbook.dashboards.catalog import all_known_series
from vllm_runbook.rules import export, load_catalog
from vllm_runbook.rules.slo import PERIODS, SloSpec, slo_rule_groups, span

DASHBOARDS = Path(lint.__file__).resolve().parent

SLOS = [
    SloSpec(name="ttft", objective="ttft", threshold=1.0, target=0.99),
    SloSpec(name="e2e", objective="e2e_latency", threshold=5.0, target=0.999, model="m"),
    SloSpec(name="ok", objective="availability", target=0.9995),
    *(
        SloSpec(name=f"ttft_{span(p)}", objective="ttft", threshold=1.0, target=0.99, window=p)
        for p in PERIODS
    ),
]


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def exported_groups() -> list[dict]:
    groups: list[dict] = yaml.safe_load(export(load_catalog()))["groups"]
    return groups + slo_rule_groups(SLOS)


def test_every_expression_parses_and_names_known_series() -> None:
    exprs = [q.expr for d in dashboards().values() for q in lint.queries(d)]
    exprs += [str(r["expr"]) for g in exported_groups() for r in g["rules"]]
    assert len(exprs) > 150
    lint.parse.cache_clear()
    start = time.perf_counter()
    for expr in exprs:
        lint.parse(expr)
    elapsed = time.perf_counter() - start
    # docs/dashboards.md gives the figure; printed with -s
    print(f"parsed {len(exprs)} expressions in {elapsed * 1000:.1f} ms")
    for name, d in dashboards().items():
        assert lint.problems(d) == [], name
    assert lint.rule_problems(exported_groups(), all_known_series()) == []


@pytest.mark.parametrize(
    "broken",
    [
        "sum(rate(vllm:generation_tokens_total[$__rate_interval])",  # a parenthesis short
        "rate(vllm:generation_tokens_total[5x])",  # not a duration
        "sum by instance (vllm:num_requests_running)",  # by without parentheses
        'vllm:num_requests_running{engine="0"} >',  # nothing to compare to
        "histogram_quantile(0.9, sum by (le) (vllm:e2e_request_latency_seconds_bucket[5m]) or)",
    ],
)
def test_a_syntax_error_is_a_problem_of_the_dashboard_and_of_a_rule(broken: str) -> None:
    d = copy.deepcopy(dashboards()["engine-overview.json"])
    panel = next(p for p in lint.panels(d) if p.get("targets"))
    panel["targets"][0]["expr"] = broken
    found = [p for p in lint.problems(d) if "not PromQL" in p]
    assert len(found) == 1 and broken in found[0], found
    groups = [{"name": "g", "rules": [{"alert": "A", "expr": broken}]}]
    (problem,) = lint.rule_problems(groups, all_known_series())
    assert problem.startswith("group g A: not PromQL (") and problem.endswith(broken)


def test_names_come_from_the_tree() -> None:
    """What a regex over the text gets wrong: names inside strings, label lists of
    vector matching, ``__name__`` matchers, keywords and functions."""
    expr = (
        'sum by (model_name, le) (rate({__name__="vllm:e2e_request_latency_seconds_bucket",'
        'engine=~"$engine"}[$__rate_interval] offset 5m))'
        " / on (model_name) group_left (instance)"
        ' label_replace(vllm:num_requests_running{reason="rate(x[5m]) and y"},'
        ' "dst", "$1", "src", "(.*)")'
        " unless bool_metric > bool 0"
    )
    assert lint.metric_names(expr) == {
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "bool_metric",
    }
    assert lint.labels_used(expr) == {"model_name", "le", "engine", "instance", "reason"}
    assert lint.metric_names("sum(rate(x[5m])") == set()  # not PromQL: `problems` says so


def test_an_unknown_series_in_a_rule_is_a_problem() -> None:
    groups = [
        {
            "name": "g",
            "rules": [
                {"record": "r:x", "expr": "sum(rate(vllm:generation_tokens_total[5m]))"},
                {"alert": "A", "expr": "r:x > 0 and vllm:no_such_series > 0"},
            ],
        }
    ]
    assert lint.rule_problems(groups, all_known_series()) == [
        "group g A: vllm:no_such_series is neither exported nor recorded"
    ]
