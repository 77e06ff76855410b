"""The `slos:` section: defaults, located errors, vLLM's bucket bounds; the export and the hooks."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from vllm.v1.metrics import buckets as vllm_buckets
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.config import Automation, RulesConfig, load_file
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.slo import (
    BURN_PAIRS,
    DEFAULT_WINDOW,
    PERIODS,
    VLLM_BUCKETS,
    SloSpec,
    burn_pairs,
    slo_rules,
    span,
)
from vllm_runbook.runbooks.model.catalogs import load_deployment
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.operate.cli.entry import main


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_config(path, runbooks=["latency-spike", "hot-path-backlog"])
    return [str(p) for p in info.value.problems]


def test_the_default_buckets_are_vllms() -> None:
    assert VLLM_BUCKETS["ttft"] == vllm_buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    assert VLLM_BUCKETS["e2e_latency"] == vllm_buckets.REQUEST_LATENCY_BUCKETS


def test_defaults_and_durations(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - {name: ttft, objective: ttft, threshold: 250ms, target: 0.99}
          - {name: e2e, objective: e2e_latency, threshold: 2.5s, target: 0.95, window: 7d,
             model: llama}
          - {name: ok, objective: availability, target: 0.999, runbook: latency-spike}
        """,
    )
    config = load_config(path, runbooks=["latency-spike"])
    ttft, e2e, ok = config.slos
    assert (ttft.threshold, ttft.window, ttft.le) == (0.25, DEFAULT_WINDOW, "0.25")
    assert (e2e.threshold, e2e.window, e2e.model, e2e.le) == (2.5, 7 * 86400.0, "llama", "2.5")
    assert ok.threshold is None and ok.runbook == "latency-spike"
    assert ttft.describe() == "99% of first tokens within 250ms over 30d"
    assert e2e.describe() == "95% of requests done within 2s500ms over 7d (llama)"
    # the rules layer's own view of the file reads the same section
    assert load_file(RulesConfig, path).slos == config.slos


def test_errors_name_the_file_the_line_and_the_nearest_bounds(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - name: ttft
            objective: ttft
            threshold: 0.3s
            target: 0.99
          - name: e2e
            objective: e2e_latency
            target: 1.5
          - name: ok
            objective: availability
            target: 0.999
            threshold: 1s
          - name: Bad-Name
            objective: throughput
            target: 0.9
          - name: custom
            objective: ttft
            buckets: [0.1, 0.3, 1]
            threshold: 0.3s
            target: 0.9
            runbook: no-such-runbook
          - name: ttft
            objective: ttft
            threshold: 10000s
            target: 0.9
        """,
    )
    f = str(path)
    assert problems(path) == [
        f"{f}:4: slos[0].threshold: 0.3 s is not a bucket boundary of "
        "vllm:time_to_first_token_seconds (vLLM's default buckets); the nearest are 0.25 s "
        "and 0.5 s (an engine started with --custom-histogram-buckets: give its bounds under "
        "buckets:)",
        f"{f}:6: slos[1].threshold is needed by a e2e_latency objective",
        f"{f}:8: slos[1].target must be between 0 and 1 (a ratio of good requests, e.g. 0.99), "
        "got 1.5",
        f"{f}:12: slos[2].threshold is not used by an availability objective (it counts errors)",
        f"{f}:13: slos[3].name 'Bad-Name': use lower-case letters, digits and _, starting with "
        "a letter",
        f"{f}:14: slos[3].objective: " + problems_text_of_literal(),
        f"{f}:21: slos[4].runbook: unknown runbook 'no-such-runbook' (known: hot-path-backlog, "
        "latency-spike)",
        f"{f}:22: slos[5].name 'ttft': an SLO of that name comes first",
        f"{f}:24: slos[5].threshold: 10000 s is not a bucket boundary of "
        "vllm:time_to_first_token_seconds (vLLM's default buckets); the nearest are 2560 s "
        "(an engine started with --custom-histogram-buckets: give its bounds under buckets:)",
    ]


def problems_text_of_literal() -> str:
    return "Input should be 'ttft', 'e2e_latency' or 'availability'"


def test_a_name_used_twice(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - {name: a, objective: availability, target: 0.99}
          - {name: a, objective: availability, target: 0.9}
        """,
    )
    assert problems(path) == [f"{path}:3: slos[1].name 'a': an SLO of that name comes first"]


def test_custom_buckets_accept_their_bounds() -> None:
    slo = SloSpec(name="c", objective="ttft", buckets=[0.1, 0.3, 1], threshold=0.3, target=0.9)
    assert slo.le == "0.3"


def test_four_pairs_per_slo_and_the_page_pairs_hand_off_to_its_runbook() -> None:
    slo = SloSpec(
        name="ttft", objective="ttft", threshold=1.0, target=0.99, runbook="latency-spike"
    )
    rules = slo_rules([slo])
    assert [(r.alert, r.severity, r.runbook) for r in rules] == [
        ("VllmSloBurn_ttft_1h", "critical", "latency-spike"),
        ("VllmSloBurn_ttft_6h", "critical", "latency-spike"),
        ("VllmSloBurn_ttft_1d", "warning", None),
        ("VllmSloBurn_ttft_3d", "warning", None),
    ]
    # the thresholds: factor x budget, read over the pair's two windows
    for rule, pair in zip(rules, BURN_PAIRS, strict=True):
        assert isinstance(rule.condition, C.AllOf)
        long, short = rule.condition.terms
        assert isinstance(long, C.Compare) and isinstance(short, C.Compare)
        assert long.value == short.value == round(pair.factor * 0.01, 12)
        assert C.reach(long.expr) == pair.long and C.reach(short.expr) == pair.short
    # `automation:` decides what a fast burn does, by the runbook's name
    automation = Automation({"latency-spike": "approve"})
    assert [automation.mode(r.runbook) for r in rules] == ["approve", "approve", "notify", "notify"]


def test_the_deployment_evaluates_the_slo_rules(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - {name: ttft, objective: ttft, threshold: 1s, target: 0.99, runbook: hot-path-backlog}
        automation: {hot-path-backlog: auto}
        """,
    )
    deployment = load_deployment(path)
    burn = [r for r in deployment.rules if r.group == "slo"]
    assert [r.alert for r in burn] == [f"VllmSloBurn_ttft_{w}" for w in ("1h", "6h", "1d", "3d")]
    assert deployment.config.automation.mode(burn[0].runbook) == "auto"


def test_export_holds_the_slo_groups_and_passes_promtool(tmp_path: Path, capsys) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - {name: ttft, objective: ttft, threshold: 1s, target: 0.99, runbook: latency-spike}
          - {name: ok, objective: availability, target: 0.999, model: llama}
        """,
    )
    out = tmp_path / "rules.yml"
    assert main(["rules", "export", "--config", str(path), "-o", str(out)]) == 0
    groups = {g["name"]: g["rules"] for g in yaml.safe_load(out.read_text())["groups"]}
    ok = groups["vllm-runbook-slo-ok"]
    records = [r["record"] for r in ok if "slo_error_ratio" in r.get("record", "")]
    assert records == [
        f"vllm_runbook:slo_error_ratio:rate{w}" for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
    ]
    # the 30-day ratio: from the budget group's two 5-minute records, once a minute
    assert [r["record"] for r in groups["vllm-runbook-slo-ok-budget"]] == [
        "vllm_runbook:slo_errors:rate5m",
        "vllm_runbook:slo_requests:rate5m",
        "vllm_runbook:slo_error_ratio:rate30d",
        "vllm_runbook:slo_budget_left:ratio",
    ]
    assert groups["vllm-runbook-slo-ok-budget"][2]["expr"] == (
        'sum_over_time(vllm_runbook:slo_errors:rate5m{slo="ok"}[30d]) / '
        'sum_over_time(vllm_runbook:slo_requests:rate5m{slo="ok"}[30d])'
    )
    assert ok[0]["expr"] == (
        "sum by (instance, model_name, engine) (rate(vllm:request_success_total"
        '{finished_reason="error",model_name="llama"}[5m])) / sum by (instance, model_name, '
        'engine) (rate(vllm:request_success_total{model_name="llama"}[5m]))'
    ).join("()")
    alerts = [r for r in ok if "alert" in r]
    assert alerts[0]["expr"] == (
        'vllm_runbook:slo_error_ratio:rate1h{slo="ok"} > 0.0144 and '
        'vllm_runbook:slo_error_ratio:rate5m{slo="ok"} > 0.0144'
    )
    ttft_alerts = [r for r in groups["vllm-runbook-slo-ttft"] if "alert" in r]
    assert ttft_alerts[0]["annotations"]["runbook_url"] == "runbooks/catalog/latency-spike"
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    check = subprocess.run(["promtool", "check", "rules", str(out)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # the operator form carries the same groups
    op = tmp_path / "op.yml"
    assert main(["rules", "export", "--config", str(path), "--format", "prometheus-operator",
                 "-o", str(op)]) == 0  # fmt: skip
    spec = yaml.safe_load(op.read_text())["spec"]["groups"]
    assert [g["name"] for g in spec] == list(groups)


def test_other_windows_are_refused_with_the_supported_ones(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        slos:
          - {name: a, objective: availability, target: 0.99, window: 7d}
          - {name: b, objective: availability, target: 0.99,
             window: 10d}
          - {name: c, objective: availability, target: 0.99, window: 90d}
        """,
    )
    assert problems(path) == [
        f"{path}:4: slos[1].window: 10d is not a supported SLO window: use one of 7d, 14d, "
        "28d, 30d (the burn-rate windows are the 30-day ones scaled to it)",
        f"{path}:5: slos[2].window: 90d is not a supported SLO window: use one of 7d, 14d, "
        "28d, 30d (the burn-rate windows are the 30-day ones scaled to it)",
    ]


# The share of the budget each pair has spent when it fires (factor x long / period).
SHARES = (0.02, 0.05, 0.10, 0.10)


@pytest.mark.parametrize("days", [7, 14, 28, 30])
def test_each_pair_fires_after_the_same_share_of_the_budget_whatever_the_window(days) -> None:
    """The 7-day 1 h page of the unscaled table fired after 14.4 x 1 h / 7 d = 8.6 %."""
    period = days * 86400.0
    assert period in PERIODS
    pairs = burn_pairs(period)
    assert [p.factor for p in pairs] == [p.factor for p in BURN_PAIRS]
    for pair, share, base in zip(pairs, SHARES, BURN_PAIRS, strict=True):
        assert pair.factor * pair.long / period == pytest.approx(share, rel=1e-12)
        # the short window: 1/12 of the long one (1/4 for the slow pairs), to the
        # minute, at least 5 minutes
        assert pair.short == max(300.0, round(base.short * period / (30 * 86400) / 60) * 60)
        assert pair.short < pair.long


def test_the_7_day_windows() -> None:
    slo = SloSpec(name="w", objective="availability", target=0.99, window=7 * 86400.0)
    assert [(span(p.long), span(p.short)) for p in slo.pairs] == [
        ("14m", "5m"),
        ("1h24m", "7m"),
        ("5h36m", "28m"),
        ("16h48m", "1h24m"),
    ]
    assert [r.alert for r in slo_rules([slo])] == [
        "VllmSloBurn_w_14m",
        "VllmSloBurn_w_1h24m",
        "VllmSloBurn_w_5h36m",
        "VllmSloBurn_w_16h48m",
    ]


_FLOAT = re.compile(r"(?<![\w.])\d+\.\d+(?:e[-+]?\d+)?")


@pytest.mark.parametrize("target", [0.99, 0.999, 0.95, 0.9, 0.9995, 0.97])
def test_no_float_is_spelled_with_binary_noise_in_the_export(tmp_path: Path, target) -> None:
    """1 - 0.99 is 0.010000000000000009 in binary: every number of the whole export
    (the catalogs' rules and the SLO groups, expressions, labels and annotations) is
    written with at most 12 significant digits."""
    path = write(
        tmp_path,
        f"""\
        slos:
          - {{name: ttft, objective: ttft, threshold: 0.25s, target: {target}}}
          - {{name: ok, objective: availability, target: {target}, window: 28d}}
          - {{name: e2e, objective: e2e_latency, threshold: 2.5s, target: {target},
             window: 7d}}
        """,
    )
    out = tmp_path / "rules.yml"
    assert main(["rules", "export", "--config", str(path), "-o", str(out)]) == 0
    text = out.read_text()
    numbers = _FLOAT.findall(text)
    assert "0.01" in numbers or target != 0.99
    noisy = sorted({n for n in numbers if len(n.split("e")[0].replace(".", "").lstrip("0")) > 12})
    assert noisy == []
