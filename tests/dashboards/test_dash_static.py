"""The checked-in dashboards: fresh, loadable by Grafana, querying only exported series."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.dashboards import catalog, lint
from vllm_runbook.dashboards.definitions import DASHBOARDS, ENGINE_UID, engine_overview
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR, RULE_FILE, render_all, stale_files
from vllm_runbook.dashboards.queries import RuleNotes
from vllm_runbook.rules import load_catalog
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.runbooks.service import metric_specs as S

KNOBS = (M.MAX_NUM_BATCHED_TOKENS, M.MAX_NUM_SEQS, M.SCHEDULER_POLICY)


def _load(name: str) -> dict[str, Any]:
    return dict(json.loads((DASHBOARDS_DIR / name).read_text()))


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict[str, Any]]:
    return {name: _load(name) for name in DASHBOARDS}


def test_checked_in_files_match_a_fresh_render() -> None:
    fresh = render_all()
    assert set(fresh) == {*DASHBOARDS, RULE_FILE}
    stale = [n for n, text in fresh.items() if (DASHBOARDS_DIR / n).read_text() != text]
    assert not stale, f"stale: {stale}; run `python -m vllm_runbook.dashboards.generate` and commit"
    assert stale_files() == []


def test_stale_check_notices_an_edit(tmp_path: Path) -> None:
    for name, text in render_all().items():
        (tmp_path / name).write_text(text)
    assert stale_files(tmp_path) == []
    path = tmp_path / "fleet.json"
    path.write_text(path.read_text().replace('"vLLM fleet"', '"edited"'))
    assert stale_files(tmp_path) == ["fleet.json"]


def test_every_dashboard_has_what_grafana_needs(dashboards: dict[str, dict[str, Any]]) -> None:
    uids = set()
    for name, d in dashboards.items():
        assert lint.problems(d) == [], name
        assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
        uids.add(d["uid"])
        panels = [p for p in lint.panels(d) if p["type"] != "row"]
        assert panels, name
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and all(t["expr"] for t in p["targets"])
            assert set(p["gridPos"]) >= {"h", "w", "x", "y"}
        ids = [p["id"] for p in lint.panels(d)]
        assert len(ids) == len(set(ids)), name
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[:3] == ["datasource", "model_name", "engine"]
    assert len(uids) == len(dashboards)


def test_lint_finds_what_grafana_or_prometheus_would_reject(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    d = json.loads(json.dumps(dashboards["engine-overview.json"]))
    panel = next(p for p in d["panels"] if p["type"] == "timeseries")
    panel["targets"][0]["expr"] = 'rate(vllm_runbook_nope_total{pod="x"}[$__rate_interval])'
    panel["datasource"] = {"type": "prometheus", "uid": "prom"}
    d["panels"][3]["id"] = d["panels"][2]["id"]
    found = "\n".join(lint.problems(d))
    assert "vllm_runbook_nope_total is exported by neither" in found
    assert "label 'pod'" in found
    assert "datasource is not ${datasource}" in found
    assert "id missing or not unique" in found


def test_every_query_names_only_series_from_the_catalogs(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    known = catalog.all_known_series()
    used: set[str] = set()
    for d in dashboards.values():
        for q in lint.queries(d):
            names = lint.metric_names(q.expr)
            assert names and names <= set(known), (q.where, names - set(known))
            used |= names
    # Each source is really used, and every name resolves to its declaring catalog.
    assert {catalog.source_of(n) for n in used} == {"collector", "vllm", "service", "slo rules"}
    collector_series = {n for spec in M.ALL_METRICS for n in catalog.series_names(spec)}
    service_series = {n for spec in S.SERVICE_METRICS for n in catalog.series_names(spec)}
    for name in used:
        source = catalog.source_of(name)
        if source == "collector":
            assert name in collector_series
        elif source == "service":
            assert name in service_series


def test_vllm_series_exist_in_the_installed_vllm() -> None:
    path = catalog.vllm_loggers_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed: its metric names cannot be checked")
        pytest.skip("vLLM is not installed")
    declared = dict(catalog.vllm_metric_types(path.read_text()))
    assert len(declared) > 20  # the parser still understands loggers.py
    spec_decode = catalog.vllm_spec_decode_path()
    assert spec_decode is not None
    declared |= catalog.vllm_spec_decode_counters(spec_decode.read_text())
    for spec in catalog.VLLM_METRICS:
        assert declared.get(spec.name) == spec.type, spec.name
    # The rules read vLLM's series by the signal registry's names: the same check.
    for signal in SIGNALS.values():
        for name in (signal.metric, signal.vllm):
            if name is None or not name.startswith("vllm:"):
                continue
            kind = "histogram" if signal.of and signal.how in ("sum", "count") else signal.type
            base = name.removesuffix(f"_{signal.how}") if kind != signal.type else name
            base = base.removesuffix("_total") if kind == "counter" else base
            assert declared.get(base) == kind, (signal.name, name)


def test_every_collector_metric_is_on_a_dashboard(dashboards: dict[str, dict[str, Any]]) -> None:
    used = {
        n for d in dashboards.values() for q in lint.queries(d) for n in lint.metric_names(q.expr)
    }
    for spec in (*M.ALL_METRICS, *S.SERVICE_METRICS):
        assert catalog.series_names(spec) & used, spec.name


def test_descriptions_name_the_rules_and_their_thresholds(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    engine = dashboards["engine-overview.json"]
    assert engine["uid"] == ENGINE_UID
    text = " ".join(p.get("description", "") for p in lint.panels(engine))
    for alert in load_catalog().alerts:
        assert f"Rule {alert} " in text, alert
    # Every threshold line drawn is a number the description states.
    for d in dashboards.values():
        for p in lint.panels(d):
            steps = p.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {})
            for step in steps.get("steps", []):
                if step["value"] is not None:
                    assert f"{step['value']:g}" in p["description"], (p["title"], step)


def test_thresholds_come_from_the_catalog_parameters(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    default = load_catalog().bind()
    rule = next(r for r in default if r.alert == "VllmBlockFragmentationHigh")
    panel = _panel(dashboards["engine-overview.json"], "KV block fragmentation")
    assert _threshold_values(panel) == [None, rule.params["threshold"]]
    # The same generator with an overridden catalog draws the overridden value.
    bound = load_catalog().bind({"VllmBlockFragmentationHigh": {"threshold": 0.33}})
    overridden = engine_overview(RuleNotes(bound))
    panel = _panel(overridden, "KV block fragmentation")
    assert _threshold_values(panel) == [None, 0.33]
    assert "above 0.33 (dashed line) for 10m" in panel["description"]


def _threshold_values(panel: dict[str, Any]) -> list[float | None]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_knobs_are_stepped_lines_and_gpu_panels_are_documented(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    knob_series = {k.series_name for k in KNOBS}
    for d in dashboards.values():
        for p in lint.panels(d):
            if p["type"] != "timeseries":
                continue
            names = {n for t in p["targets"] for n in lint.metric_names(t["expr"])}
            style = p["fieldConfig"]["defaults"]["custom"]
            if names & knob_series:
                assert style["lineInterpolation"] == "stepAfter", p["title"]
            specs = [catalog.all_known_series()[n] for n in names]
            gpu_only = all(s.gpu_only for s in specs)
            assert p["description"].startswith("GPU-only") == gpu_only, p["title"]


def test_engine_panels_carry_runbook_annotations(dashboards: dict[str, dict[str, Any]]) -> None:
    annotations = dashboards["engine-overview.json"]["annotations"]["list"]
    exprs = " ".join(a["expr"] for a in annotations if "expr" in a)
    for knob in KNOBS:
        assert f"changes({knob.series_name}{{" in exprs
    assert S.EXECUTIONS.series_name in exprs


def test_service_metrics_build_and_expose_their_declared_names() -> None:
    registry = CollectorRegistry()
    built = S.build_all(registry)
    assert set(built) == set(S.SERVICE_METRICS)
    for spec, metric in built.items():
        labelled = metric.labels(*["x"] * len(spec.extra_labels)) if spec.extra_labels else metric
        if spec.type == "histogram":
            labelled.observe(1.0)  # type: ignore[union-attr]
        elif spec.type == "counter":
            labelled.inc()  # type: ignore[union-attr]
        else:
            labelled.set(1)  # type: ignore[union-attr]
    from prometheus_client import generate_latest

    exposed = {
        s.name for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }  # fmt: skip
    for spec in S.SERVICE_METRICS:
        assert catalog.series_names(spec) <= exposed, spec.name
        assert spec.name.startswith("vllm_runbook_service_")


def test_provisioning_files_point_grafana_at_the_dashboards() -> None:
    ds = yaml.safe_load((DASHBOARDS_DIR / "provisioning" / "datasources.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://")
    # The rate window Grafana computes assumes this is the scrape interval.
    prom = yaml.safe_load((DASHBOARDS_DIR / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    dash = yaml.safe_load((DASHBOARDS_DIR / "provisioning" / "dashboards.yaml").read_text())
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_prometheus_config_gives_both_targets_of_an_engine_one_instance() -> None:
    prom = yaml.safe_load((DASHBOARDS_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {"vllm", "vllm-runbook-agent", "runbook-serve"}
    targets = {n: j["static_configs"][0]["targets"] for n, j in jobs.items()}
    assert targets == {
        "vllm": ["127.0.0.1:8000"],
        "vllm-runbook-agent": ["127.0.0.1:9360"],
        "runbook-serve": ["127.0.0.1:8080"],
    }
    instances = {
        n: jobs[n]["static_configs"][0]["labels"]["__engine_instance"]
        for n in ("vllm", "vllm-runbook-agent")
    }
    assert len(set(instances.values())) == 1
    for n in instances:
        (relabel,) = jobs[n]["relabel_configs"]
        assert relabel["source_labels"] == ["__engine_instance"]
        assert relabel["target_label"] == "instance"
    assert prom["rule_files"] == [RULE_FILE]


def test_alertmanager_posts_to_the_service_with_bearer_auth() -> None:
    am = yaml.safe_load((DASHBOARDS_DIR / "alertmanager.yml").read_text())
    (receiver,) = am["receivers"]
    assert am["route"]["receiver"] == receiver["name"]
    (hook,) = receiver["webhook_configs"]
    assert hook["url"] == "http://127.0.0.1:8080/webhooks/alertmanager"
    assert hook["send_resolved"] is True
    auth = hook["http_config"]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials_file"]
    assert not re.match(r"^/", auth["credentials_file"])  # relative to the config file


def _panel(d: dict[str, Any], title: str) -> Any:
    return next(p for p in lint.panels(d) if p["title"] == title)
