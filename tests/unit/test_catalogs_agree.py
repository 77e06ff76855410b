"""The rule catalog and the runbook catalog name each other: keep them in step.

`vllm_runbook.runbooks.spec.KNOWN_ALERTS` and `vllm_runbook.rules.model.RUNBOOK_NAMES` are the two
packages' contract with each other (each validates its YAML against the
other's names without loading it); these checks stop them from drifting.
"""

from __future__ import annotations

from vllm_runbook.rules import RUNBOOK_NAMES
from vllm_runbook.rules import load_catalog as load_rules
from vllm_runbook.runbooks.spec import KNOWN_ALERTS
from vllm_runbook.runbooks.spec import load_catalog as load_runbooks


def test_names_agree() -> None:
    assert set(load_rules().alerts) == set(KNOWN_ALERTS)
    assert set(load_runbooks()) == set(RUNBOOK_NAMES)


def test_each_rule_triggers_the_runbook_it_names_and_back() -> None:
    rules = load_rules().bind({})
    runbooks = load_runbooks()
    for rule in rules:
        if rule.runbook is not None:
            assert rule.alert in runbooks[rule.runbook].triggers, (rule.alert, rule.runbook)
    for name, runbook in runbooks.items():
        for alert in runbook.triggers:
            assert any(r.alert == alert and r.runbook == name for r in rules), (name, alert)
