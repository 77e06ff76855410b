"""The rule catalog and the runbook catalog name each other: each is checked
against the one it is deployed with (vllm_runbook.runbooks.model.catalogs), not
against a list typed into the other package, so a deployment may rename both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from vllm_runbook.rules import CatalogError
from vllm_runbook.rules import load_catalog as load_rules
from vllm_runbook.rules.model import CATALOG_DIR as RULES_DIR
from vllm_runbook.runbooks.model.catalogs import load_deployment
from vllm_runbook.runbooks.model.spec import CATALOG_DIR as RUNBOOKS_DIR
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks

TOKEN = "catalogs-token"


def test_the_shipped_catalogs_load_together_and_name_each_other() -> None:
    deployment = load_deployment(None)
    rules, runbooks = deployment.rules, deployment.runbooks
    assert set(runbooks) == set(load_runbooks()) and len(runbooks) == 17
    assert deployment.alerts == load_rules().alerts and len(deployment.alerts) == 23
    for rule in rules:
        if rule.runbook is not None:
            assert rule.alert in runbooks[rule.runbook].triggers, (rule.alert, rule.runbook)
    for name, runbook in runbooks.items():
        for alert in runbook.triggers:
            assert any(r.alert == alert and r.runbook == name for r in rules), (name, alert)


def test_without_names_nothing_is_checked_with_them_each_name_is() -> None:
    runbooks = load_runbooks(alerts=None)  # no alert names given: triggers unchecked
    assert len(runbooks) == 17
    with pytest.raises(CatalogError) as info:
        load_runbooks(alerts=["VllmLatencySpike"])
    assert "unknown alert 'VllmOOMPressure'" in str(info.value)
    assert len(load_rules(runbooks=None).specs) == len(load_rules(runbooks=list(runbooks)).specs)
    with pytest.raises(CatalogError) as rinfo:
        load_rules(runbooks=["warmup"])
    assert any(
        "unknown runbook 'oom-pressure' (known: warmup;" in str(p) for p in rinfo.value.problems
    )


def renamed_catalogs(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of both shipped catalogs with VllmOOMPressure renamed ClusterKVExhausted
    and the runbook oom-pressure renamed kv-relief, in both."""
    out = []
    for src, name in ((RULES_DIR, "rules"), (RUNBOOKS_DIR, "runbooks")):
        dst = tmp_path / name
        dst.mkdir()
        for f in sorted(src.glob("*.yaml")):
            text = f.read_text(encoding="utf-8")
            text = text.replace("VllmOOMPressure", "ClusterKVExhausted")
            text = text.replace("oom-pressure", "kv-relief")
            (dst / f.name.replace("oom-pressure", "kv-relief")).write_text(text, encoding="utf-8")
        out.append(dst)
    return out[0], out[1]


def firing(alertname: str) -> dict[str, Any]:
    labels = {"alertname": alertname, "instance": "10.1.2.3:8000", "severity": "critical"}
    return {
        "version": "4",
        "groupKey": "{}:{alertname=" + alertname + "}",
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "vllm-runbook",
        "groupLabels": {"alertname": alertname},
        "commonLabels": labels,
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093",
        "alerts": [
            {
                "status": "firing",
                "labels": labels,  # no `runbook` label: the rule catalog maps the alert
                "annotations": {},
                "startsAt": "2026-11-29T10:00:00.000Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://127.0.0.1:9090/graph",
                "fingerprint": "4f2c0a1b9e",
            }
        ],
    }


def write_config(tmp_path: Path, rules_dir: Path | None) -> Path:
    (tmp_path / "token").write_text(TOKEN + "\n")
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        "engines:\n"
        "  - {name: engine-a, agent: 'http://127.0.0.1:9', labels: {instance: '10.1.2.3:8000'}}\n"
        f"database: sqlite:///{tmp_path / 'j.db'}\n"
        "webhook: {token_file: token}\n"
        + (f"rules: {{catalog: {rules_dir}}}\n" if rules_dir is not None else "")
        + "automation: {default: auto}\n"
    )
    return cfg


def test_serve_automates_a_catalog_under_new_alert_and_runbook_names(tmp_path: Path) -> None:
    from vllm_runbook.runbooks.service.serve_cli import build

    rules_dir, runbooks_dir = renamed_catalogs(tmp_path)
    cfg = write_config(tmp_path, rules_dir)
    deployment = load_deployment(cfg, [runbooks_dir])
    assert deployment.alert_runbooks["ClusterKVExhausted"] == "kv-relief"
    assert deployment.runbooks["kv-relief"].triggers == ("ClusterKVExhausted", "VllmOOMRateHigh")
    assert "oom-pressure" not in deployment.runbooks

    service = build(str(cfg), None, "127.0.0.1", False, False, [runbooks_dir])
    store = service.store
    try:
        r = TestClient(service.app, base_url="http://127.0.0.1").post(
            "/webhooks/alertmanager",
            json=firing("ClusterKVExhausted"),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200, r.text
        [execution] = r.json()["executions"]
        assert (execution["runbook"], execution["mode"], execution["created"]) == (
            "kv-relief",
            "auto",
            True,
        )
    finally:
        store.close()


def test_each_catalog_is_refused_against_a_catalog_that_lacks_its_names(tmp_path: Path) -> None:
    rules_dir, _ = renamed_catalogs(tmp_path)
    # Runbooks triggered by an alert the shipped rules lack.
    alert_only = tmp_path / "alert-only"
    alert_only.mkdir()
    for f in sorted(RUNBOOKS_DIR.glob("*.yaml")):
        text = f.read_text(encoding="utf-8").replace("VllmOOMPressure", "ClusterKVExhausted")
        (alert_only / f.name).write_text(text, encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_deployment(write_config(tmp_path, None), [alert_only])
    assert str(info.value).endswith(
        "runbook oom-pressure: triggers: Value error, unknown alert 'ClusterKVExhausted'"
    )
    # Renamed rules beside the shipped runbooks: the rules name a runbook they lack.
    with pytest.raises(CatalogError) as rinfo:
        load_deployment(write_config(tmp_path, rules_dir), None)
    messages = [str(p) for p in rinfo.value.problems]
    assert len(messages) == 2  # VllmOOMRateHigh and ClusterKVExhausted
    assert all("unknown runbook 'kv-relief' (known: batch-too-large," in m for m in messages)


def test_every_exported_rule_names_a_runbook_and_its_url() -> None:
    from vllm_runbook.rules.promql import rule_to_prometheus

    runbooks = load_runbooks()
    rules = load_rules().bind({})
    # VllmPaddingHigh and VllmSpecDecodeAcceptanceLow have two severities
    assert len(rules) == len(load_rules().alerts) + 2
    for rule in rules:
        exported = rule_to_prometheus(rule, runbook_url_base="https://runbooks.example/rb")
        name = exported["labels"]["runbook"]  # type: ignore[index]
        assert name in runbooks, rule.alert
        assert exported["annotations"]["runbook_url"] == (  # type: ignore[index]
            f"https://runbooks.example/rb/{name}"
        )


def test_every_signal_has_one_named_source() -> None:
    from vllm_runbook.rules.signals import READABLE
    from vllm_runbook.runbooks.engine.sources import SOURCES

    assert list(SOURCES) == list(READABLE)
