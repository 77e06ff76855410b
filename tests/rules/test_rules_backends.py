"""Every rule, through both backends, on the synthetic cases of rule_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from rule_cases import CASES
from rule_harness import EVAL, promtool_required, promtool_version, run_evaluator, run_promtool
from rule_harness import select_rule as select
from vllm_runbook.rules.model import load_catalog

RULES = load_catalog().bind()
PROMTOOL = promtool_version()


def test_every_rule_has_a_firing_and_a_quiet_case() -> None:
    for rule in RULES:
        mine = [c for c in CASES if c.alert == rule.alert and c.severity in (None, rule.severity)]
        assert any(c.fires_at is not None for c in mine), rule.key
        assert any(c.fires_at is None for c in mine), rule.key


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_evaluator_matches_oracle(case) -> None:
    rule = select(RULES, case)
    assert run_evaluator(rule, case, left_open=False) == case.oracle(False)
    assert run_evaluator(rule, case, left_open=True) == case.oracle(True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_prometheus_agrees(case, tmp_path: Path) -> None:
    if PROMTOOL is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        pytest.skip("promtool not installed (apt-get install prometheus); CI fails instead")
    rule = select(RULES, case)
    fired = run_evaluator(rule, case, left_open=PROMTOOL >= 3)
    result = run_promtool(rule, case, fired, tmp_path)
    assert result.returncode == 0, (
        f"Prometheus disagrees with the evaluator (fired at {fired}, tolerance {EVAL}s):\n"
        f"{result.stdout}\n{result.stderr}"
    )
