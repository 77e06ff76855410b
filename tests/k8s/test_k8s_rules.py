"""The PrometheusRule: generated from the catalog (fresh), the same groups as the
plain rule file, accepted by promtool; and `runbook rules export --format
prometheus-operator` as a user calls it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR, RULE_FILE
from vllm_runbook.rules import load_catalog
from vllm_runbook.rules.prometheus_operator import export_prometheus_rule
from vllm_runbook.rules.promql import rule_groups
from vllm_runbook.runbooks.operate.cli import main

from tests.engines import require_tool
from tests.k8s.manifests import DEPLOY, one, render

RULE_RESOURCE = DEPLOY / "components" / "prometheusrule" / "prometheusrule.yaml"
CATALOG_RULES = 25


def test_the_checked_in_prometheusrule_is_fresh() -> None:
    fresh = export_prometheus_rule(load_catalog())
    assert RULE_RESOURCE.read_text(encoding="utf-8") == fresh, (
        "stale: runbook rules export --format prometheus-operator "
        "-o deploy/kubernetes/components/prometheusrule/prometheusrule.yaml"
    )


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_rendered_groups_are_the_rule_files_groups(overlay: str) -> None:
    rule = one(render(overlay), "PrometheusRule")
    plain = yaml.safe_load((DASHBOARDS_DIR / RULE_FILE).read_text(encoding="utf-8"))
    assert rule["spec"]["groups"] == plain["groups"] == rule_groups(load_catalog())
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) == CATALOG_RULES
    with_runbook = [r for r in alerts if "runbook" in r["labels"]]
    assert with_runbook and all(
        r["annotations"]["runbook_url"] == f"runbooks/catalog/{r['labels']['runbook']}"
        for r in with_runbook
    )


def test_promtool_checks_the_rendered_groups(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rule = one(render("default"), "PrometheusRule")
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {CATALOG_RULES} rules found" in done.stdout


def test_promtool_rejects_broken_groups(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    groups = one(render("default"), "PrometheusRule")["spec"]["groups"]
    groups[0]["rules"][0]["expr"] = "max by (instance (vllm_runbook_kv_hit_ratio)"
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60)
    assert done.returncode != 0


def test_export_sets_name_namespace_and_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rule.yaml"
    argv = ["rules", "export", "--format", "prometheus-operator", "--name", "vllm-rules"]
    argv += ["--namespace", "monitoring", "--label", "release=prom", "--label", "team=llm"]
    argv += ["--runbook-url-base", "https://runbooks.example/vllm/", "-o", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr() == ("", "")
    doc = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert doc["metadata"] == {
        "name": "vllm-rules",
        "namespace": "monitoring",
        "labels": {"release": "prom", "team": "llm"},
    }
    oom = next(
        r for g in doc["spec"]["groups"] for r in g["rules"] if r["alert"] == "VllmOOMPressure"
    )
    assert oom["annotations"]["runbook_url"] == "https://runbooks.example/vllm/oom-pressure"


def test_export_applies_the_configs_overrides(tmp_path: Path) -> None:
    config = tmp_path / "runbook.yaml"
    config.write_text("rules:\n  overrides: {VllmOOMPressure: {for: 30s}}\n", encoding="utf-8")
    out = tmp_path / "rule.yaml"
    argv = ["rules", "export", "--format", "prometheus-operator", "--config", str(config)]
    assert main([*argv, "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text(encoding="utf-8"))
    fors = {r["alert"]: r["for"] for g in doc["spec"]["groups"] for r in g["rules"]}
    assert fors["VllmOOMPressure"] == "30s"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--name", "Vllm_Rules"], "invalid name 'Vllm_Rules': "),
        (["--namespace", "monitoring."], "invalid namespace 'monitoring.': "),
        (["--label", "release"], "invalid label 'release': expected KEY=VALUE"),
        (["--label", "release=-x"], "invalid label value '-x' for release: "),
        (["--label", "bad key=x"], "invalid label key 'bad key': "),
        (["--label", "Example.com/x=y"], "invalid label key 'Example.com/x': "),
    ],
)
def test_export_refuses_what_the_api_server_would_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rules", "export", "--format", "prometheus-operator", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("runbook: error: " + message)
    assert err.count("\n") == 1


def test_operator_options_need_the_operator_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "export", "--namespace", "monitoring"]) == 2
    assert capsys.readouterr() == (
        "",
        "runbook: error: --name, --namespace and --label need --format prometheus-operator\n",
    )


def test_label_with_a_prefix_and_an_empty_value_is_accepted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["rules", "export", "--format", "prometheus-operator"]
    assert main([*argv, "--label", "example.com/tier=", "--label", "a.b_c-d=E.f_g-h"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["metadata"]["labels"] == {"example.com/tier": "", "a.b_c-d": "E.f_g-h"}
