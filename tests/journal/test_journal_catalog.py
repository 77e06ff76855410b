"""The shipped runbook catalog and the loader's error messages."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.model import load_catalog as load_rules
from vllm_runbook.runbooks.engine.operations import SetMaxNumSeqs, advise
from vllm_runbook.runbooks.model.actions import DuplicateAction, UnknownAction, catalog_registry
from vllm_runbook.runbooks.model.spec import CATALOG_DIR, load_catalog

EXPECTED = {
    "batch-too-large",
    "batch-utilization-low",
    "engine-stalled",
    "engine-stuck",
    "error-rate-high",
    "gpu-compute-skew",
    "gpu-memory-imbalance",
    "hot-path-backlog",
    "padding-high",
    "kv-hit-low",
    "latency-spike",
    "memory-leak",
    "oom-pressure",
    "restore",
    "spec-decode-acceptance-low",
    "throughput-drop",
    "warmup",
}

VALID = """\
name: {name}
description: test runbook
triggers: [VllmOOMPressure]
checks:
  - name: kv_usage
    description: KV usage
    signal: kv_cache_usage
steps:
  - action: scale_max_num_batched_tokens
    params: {{factor: 0.5}}
"""


def write(directory: Path, filename: str, text: str) -> Path:
    path = directory / filename
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path: Path) -> str:
    with pytest.raises(CatalogError) as info:
        # Triggers are checked against the alerts of the rule catalog deployed with.
        load_catalog([tmp_path], alerts=load_rules().alerts)
    return str(info.value)


@pytest.fixture(autouse=True)
def relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Error messages show paths relative to the working directory.
    monkeypatch.chdir(tmp_path.parent)


def test_shipped_catalog_loads() -> None:
    catalog = load_catalog()
    assert set(catalog) == EXPECTED
    oom = catalog["oom-pressure"]
    assert [s.action for s in oom.steps] == [
        "scale_max_num_batched_tokens",
        "set_max_num_seqs",
        "set_autopilot",
    ]
    assert oom.steps[0].params == {"factor": 0.5}
    assert oom.steps[1].params == {"value": "kv_capacity"}
    assert oom.steps[1].when is not None and oom.steps[1].when.above == 0
    assert oom.verification is not None
    assert (oom.verification.signal, oom.verification.direction) == (
        "preemptions_per_minute",
        "decrease",
    )
    assert oom.revert.stepwise == (0.5, 1.0)
    latency = catalog["latency-spike"]
    assert latency.steps[0].params == {"policy": "fcfs"} and latency.revert.on_resolve is True
    assert [r.name for r in catalog.for_alert("VllmOOMPressure")] == ["oom-pressure"]
    assert catalog.sources["warmup"] == CATALOG_DIR / "warmup.yaml"
    assert catalog["restore"].triggers == ()
    assert catalog["memory-leak"].guardrails.requires_approval is True


def test_unknown_action_names_file_line_and_runbook(tmp_path: Path) -> None:
    text = VALID.format(name="oom-pressure").replace("scale_max_num_batched_tokens", "halve")
    write(tmp_path, "oom.yaml", text)
    assert load_error(tmp_path) == (
        f"{tmp_path.name}/oom.yaml:9: runbook oom-pressure: unknown action 'halve'"
    )


def test_bad_param_points_at_the_param(tmp_path: Path) -> None:
    text = VALID.format(name="x").replace("{factor: 0.5}", "\n      factor: 2\n      extra: 1")
    write(tmp_path, "x.yaml", text)
    assert load_error(tmp_path).splitlines() == [
        f"{tmp_path.name}/x.yaml:11: runbook x: action scale_max_num_batched_tokens: "
        "steps[0].params.factor: Input should be less than or equal to 1",
        f"{tmp_path.name}/x.yaml:12: runbook x: action scale_max_num_batched_tokens: "
        "steps[0].params.extra: Extra inputs are not permitted",
    ]


def test_broken_yaml_names_the_line(tmp_path: Path) -> None:
    write(tmp_path, "broken.yaml", "name: x\nsteps:\n  - action: [unclosed\n")
    message = load_error(tmp_path)
    assert message.startswith(f"{tmp_path.name}/broken.yaml:4: invalid YAML: ")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    write(tmp_path, "dup.yaml", VALID.format(name="x") + "description: again\n")
    assert load_error(tmp_path) == f"{tmp_path.name}/dup.yaml:11: duplicate key 'description'"


def test_duplicate_runbook_name_names_both_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="same"))
    write(tmp_path, "b.yaml", VALID.format(name="same"))
    d = tmp_path.name
    assert load_error(tmp_path) == (
        f"{d}/b.yaml:1: runbook same: duplicate runbook name (first defined in {d}/a.yaml:1)"
    )


def test_model_errors_are_all_reported_with_lines(tmp_path: Path) -> None:
    text = (
        VALID.format(name="Bad_Name")
        .replace("VllmOOMPressure", "VllmNoSuchAlert")
        .replace("kv_cache_usage", "kv_usage_percent")
        + "guardrails:\n  cooldown_seconds: -1\n  max_runs: 3\n"
    )
    write(tmp_path, "bad.yaml", text)
    lines = load_error(tmp_path).splitlines()
    d = tmp_path.name
    assert lines[0] == (
        f"{d}/bad.yaml:1: runbook Bad_Name: name: String should match pattern "
        "'^[a-z][a-z0-9]*(-[a-z0-9]+)*$'"
    )
    assert lines[1] == (
        f"{d}/bad.yaml:3: runbook Bad_Name: triggers: Value error, unknown alert 'VllmNoSuchAlert'"
    )
    assert lines[2].startswith(
        f"{d}/bad.yaml:7: runbook Bad_Name: checks[0].signal: Value error, "
        "unknown signal 'kv_usage_percent' (known: "
    )
    assert lines[3:] == [
        f"{d}/bad.yaml:12: runbook Bad_Name: guardrails.cooldown_seconds: "
        "Input should be greater than or equal to 0",
        f"{d}/bad.yaml:13: runbook Bad_Name: guardrails.max_runs: Extra inputs are not permitted",
    ]


def test_missing_field_reports_the_enclosing_line(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "name: m\ndescription: no steps\n")
    assert load_error(tmp_path) == f"{tmp_path.name}/m.yaml:1: runbook m: steps: Field required"


def test_not_a_mapping(tmp_path: Path) -> None:
    write(tmp_path, "list.yaml", "- a\n- b\n")
    assert load_error(tmp_path) == f"{tmp_path.name}/list.yaml:1: a runbook file must be a mapping"


def test_stepwise_must_end_at_one(tmp_path: Path) -> None:
    write(tmp_path, "s.yaml", VALID.format(name="s") + "revert:\n  stepwise: [0.5, 0.9]\n")
    assert load_error(tmp_path) == (
        f"{tmp_path.name}/s.yaml:12: runbook s: revert.stepwise: "
        "Value error, stepwise fractions must increase strictly and end at 1.0"
    )


def test_registry_rejects_duplicates_and_validates() -> None:
    registry = catalog_registry()
    assert list(registry) == [
        "advise",
        "advise_block_size",
        "capture_diagnostics",
        "drain",
        "restart_engine",
        "restore_knobs",
        "scale_max_num_batched_tokens",
        "send_warmup_requests",
        "set_autopilot",
        "set_max_num_seqs",
        "set_policy",
        "undrain",
        "wait_for_progress",
    ]
    with pytest.raises(DuplicateAction, match="'advise' is already registered"):
        registry.register(advise, mutating=False)
    assert registry.validate("set_max_num_seqs", {"value": "kv_capacity"}) == SetMaxNumSeqs(
        value="kv_capacity"
    )
    assert registry.validate("set_max_num_seqs", {"value": 8}) == SetMaxNumSeqs(value=8)
    with pytest.raises(UnknownAction, match="unknown action 'halve'"):
        registry.validate("halve", {})
    mutating = {name for name in registry if registry.get(name).mutating}
    assert mutating == {
        "drain",
        "restart_engine",
        "undrain",
        "restore_knobs",
        "scale_max_num_batched_tokens",
        "set_autopilot",
        "set_max_num_seqs",
        "set_policy",
    }
