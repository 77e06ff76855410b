"""Bad rule files: each mistake named with file, line and rule; nothing dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.errors import (
    CatalogError,
    DuplicateRuleError,
    DurationError,
    SyntaxProblem,
    TemplateError,
    UnknownParameterError,
    UnknownRunbookError,
    UnknownSignalError,
)
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.promql import to_promql
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks

# The shipped runbook catalog's names: what the rules are deployed with.
RUNBOOK_NAMES = list(load_runbooks())

GOOD = """\
rules:
  - alert: VllmFoo
    severity: warning
    runbook: kv-hit-low
    summary: "foo on {{ $labels.engine }}"
    description: "value {{ $value }} below {{ $params.threshold }}"
    parameters: {threshold: 0.5, for: 1m}
    for: $for
    condition:
      expr: kv_hit_ratio
      below: $threshold
"""


def write(tmp_path: Path, text: str, name: str = "kv.yaml") -> Path:
    (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def problems(tmp_path: Path, text: str) -> list:
    with pytest.raises(CatalogError) as info:
        load_catalog(write(tmp_path, text), display_root=tmp_path, runbooks=RUNBOOK_NAMES)
    return info.value.problems


def test_good_file_loads(tmp_path: Path) -> None:
    rules = load_catalog(write(tmp_path, GOOD)).bind()
    assert [(r.alert, r.for_seconds, r.runbook) for r in rules] == [("VllmFoo", 60.0, "kv-hit-low")]
    assert rules[0].description == "value {{ $value }} below 0.5"


def test_unknown_signal_names_file_line_and_rule(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("expr: kv_hit_ratio", "expr: kv_hit_ratoi"))
    assert isinstance(p, UnknownSignalError)
    assert str(p) == "kv.yaml:10: rule VllmFoo: unknown signal 'kv_hit_ratoi'"


def test_bad_duration(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("for: 1m}", "for: 5 minutes}"))
    assert isinstance(p, DurationError)
    assert (
        str(p)
        == "kv.yaml:8: rule VllmFoo: bad duration '5 minutes': expected e.g. '30s', '5m', '1h30m'"
    )


def test_bad_window_duration_points_at_its_mapping(tmp_path: Path) -> None:
    text = GOOD.replace("expr: kv_hit_ratio", "expr: {avg_over_time: kv_hit_ratio, window: 5}")
    [p] = problems(tmp_path, text)
    assert isinstance(p, DurationError)
    assert str(p) == "kv.yaml:10: rule VllmFoo: bad duration 5: give a unit, e.g. '5s'"


def test_unknown_runbook(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("runbook: kv-hit-low", "runbook: reboot"))
    assert isinstance(p, UnknownRunbookError)
    assert str(p).startswith(
        "kv.yaml:4: rule VllmFoo: unknown runbook 'reboot' (known: batch-too-large, "
        "batch-utilization-low,"
    )


def test_diagnose_only_rule_has_no_runbook(tmp_path: Path) -> None:
    rules = load_catalog(
        write(tmp_path, GOOD.replace("runbook: kv-hit-low", "runbook: null"))
    ).bind()
    assert rules[0].runbook is None
    assert "runbook" not in rules[0].alert_labels


def test_runbook_key_is_required(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("    runbook: kv-hit-low\n", ""))
    assert isinstance(p, SyntaxProblem)
    assert str(p) == "kv.yaml:2: rule VllmFoo: runbook: Field required"


def test_every_problem_is_reported_not_only_the_first(tmp_path: Path) -> None:
    second = GOOD.replace("VllmFoo", "VllmBar").replace("rules:\n", "")
    text = GOOD.replace("expr: kv_hit_ratio", "expr: nope") + second.replace(
        "runbook: kv-hit-low", "runbook: x"
    )
    found = problems(tmp_path, text)
    assert {type(p) for p in found} == {UnknownSignalError, UnknownRunbookError}


def test_unknown_parameter_reference(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("below: $threshold", "below: $treshold"))
    assert isinstance(p, UnknownParameterError)
    assert str(p) == "kv.yaml:10: rule VllmFoo: unknown parameter '$treshold'"


def test_wrong_signal_type(tmp_path: Path) -> None:
    text = GOOD.replace("expr: kv_hit_ratio", "expr: {rate: kv_hit_ratio, window: 1m}")
    [p] = problems(tmp_path, text)
    assert (
        str(p)
        == "kv.yaml:10: rule VllmFoo: signal 'kv_hit_ratio' is a gauge; here a counter is needed"
    )


def test_per_gpu_value_must_be_reduced(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("expr: kv_hit_ratio", "expr: gpu_utilization"))
    assert "reduce over 'gpu' first" in str(p)


def test_duplicate_alert_and_severity(tmp_path: Path) -> None:
    text = GOOD + GOOD.replace("rules:\n", "")
    [p] = problems(tmp_path, text)
    assert isinstance(p, DuplicateRuleError)
    assert (
        str(p)
        == "kv.yaml:12: rule VllmFoo: alert VllmFoo with severity warning already defined at "
        "kv.yaml:2"
    )


def test_unsupported_template(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("{{ $value }}", "{{ $value | humanize }}"))
    assert isinstance(p, TemplateError)
    assert str(p).startswith("kv.yaml:6: rule VllmFoo: unsupported template action")


def test_invalid_yaml(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("    for: $for\n", "    for: [\n"))
    assert isinstance(p, SyntaxProblem)
    assert (
        str(p) == "kv.yaml:10: invalid YAML: expected ',' or ']', but got ':'"
    )  # where YAML noticed


def test_unknown_field(tmp_path: Path) -> None:
    [p] = problems(tmp_path, GOOD.replace("    for: $for\n", "    for: $for\n    forr: 1m\n"))
    assert str(p) == "kv.yaml:9: rule VllmFoo: forr: Extra inputs are not permitted"


def test_unless_beside_a_condition_compiles_to_promql_unless(tmp_path: Path) -> None:
    text = GOOD.replace("      below: $threshold\n", UNLESS)
    [rule] = load_catalog(write(tmp_path, text)).bind()
    assert isinstance(rule.condition, C.Unless)
    assert to_promql(rule.condition) == (
        "(max by (instance, model_name, engine) (vllm_runbook_kv_hit_ratio) < 0.5) unless "
        "(max by (instance, model_name, engine) (vllm_runbook_num_requests_waiting) > 0)"
    )


def test_unless_is_checked_like_any_condition(tmp_path: Path) -> None:
    text = GOOD.replace("      below: $threshold\n", "      below: $threshold\n      unless: 3\n")
    [p] = problems(tmp_path, text)
    assert str(p) == "kv.yaml:9: rule VllmFoo: a condition must be a mapping, got 3"
    text = GOOD.replace("      below: $threshold\n", UNLESS + "      nor: {}\n")
    [p] = problems(tmp_path, text)
    assert str(p) == (
        "kv.yaml:10: rule VllmFoo: unexpected key(s) ['nor']; allowed: ['below', 'expr', 'unless']"
    )


UNLESS = "      below: $threshold\n      unless: {expr: requests_waiting, above: 0}\n"


def test_overrides(tmp_path: Path) -> None:
    catalog = load_catalog(write(tmp_path, GOOD), display_root=tmp_path)
    [rule] = catalog.bind({"VllmFoo": {"threshold": 0.25, "for": "30s"}})
    assert (rule.condition.value, rule.for_seconds) == (0.25, 30.0)  # type: ignore[union-attr]
    with pytest.raises(CatalogError) as info:
        catalog.bind({"VllmFoo": {"treshold": 1}, "VllmNope": {}})
    assert [str(p) for p in info.value.problems] == [
        "overrides: rule VllmFoo: override of unknown parameter 'treshold' (has: for, threshold)",
        "overrides: override for unknown alert 'VllmNope'",
    ]
    with pytest.raises(CatalogError) as info:
        catalog.bind({"VllmFoo": {"for": "soon"}})
    assert (
        str(info.value)
        == "kv.yaml:8: rule VllmFoo: bad duration 'soon': expected e.g. '30s', '5m', '1h30m'"
    )


def test_shipped_catalog_covers_design_alerts() -> None:
    catalog = load_catalog()
    assert catalog.alerts == sorted(
        [
            "VllmKVCacheHitRatioLow",
            "VllmKVFragmentationSuspected",
            "VllmBatchTooLarge",
            "VllmOOMPressure",
            "VllmLatencySpike",
            "VllmLatencyRiseFlatLoad",
            "VllmThroughputDrop",
            "VllmPaddingHigh",
            "VllmCudagraphPaddingHigh",
            "VllmBatchUtilizationLow",
            "VllmBlockFragmentationHigh",
            "VllmGPUMemoryLeak",
            "VllmGPUComputeSkew",
            "VllmGPUMemoryImbalance",
            "VllmInsufficientWarmup",
            "VllmHotPathBacklog",
            "VllmRequestStarvation",
            "VllmEngineStalled",
            "VllmEngineStuck",
            "VllmOOMRateHigh",
            "VllmErrorRateHigh",
            "VllmKVCacheRetentionShort",
            "VllmSpecDecodeAcceptanceLow",
        ]
    )
    assert {s.spec.runbook for s in catalog.specs} <= {*RUNBOOK_NAMES, None}
