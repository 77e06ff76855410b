"""deploy/kubernetes renders for every overlay, each object is valid for the
Kubernetes API (or its Operator CRD), and the pieces point at each other."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest

from tests.k8s.manifests import (
    KUBERNETES_VERSIONS,
    OVERLAYS,
    container,
    is_operator_kind,
    kubernetes_problems,
    matches,
    one,
    operator_problems,
    pod_spec,
    render,
)

OPERATOR_KINDS = Counter(
    {"ServiceMonitor": 1, "PodMonitor": 1, "PrometheusRule": 1, "AlertmanagerConfig": 1}
)
CORE_KINDS = Counter({"ServiceAccount": 1, "ConfigMap": 1, "Deployment": 1, "Service": 1})
# Three dashboard ConfigMaps besides the configuration.
EXPECTED_KINDS = {
    "minimal": CORE_KINDS,
    "default": CORE_KINDS + OPERATOR_KINDS + Counter({"ConfigMap": 3}),
    "ha": CORE_KINDS + OPERATOR_KINDS + Counter({"ConfigMap": 3, "PodDisruptionBudget": 1}),
}
RELEASE_LABEL = {"release": "kube-prometheus-stack"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_exactly_its_pieces(overlay: str) -> None:
    objects = render(overlay)
    assert Counter(o["kind"] for o in objects) == EXPECTED_KINDS[overlay]
    assert {o["metadata"]["namespace"] for o in objects} == {"vllm-runbook"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_pass_the_kubernetes_schema(overlay: str, version: str) -> None:
    builtin = [o for o in render(overlay) if not is_operator_kind(o)]
    assert len(builtin) == sum(
        n for k, n in EXPECTED_KINDS[overlay].items() if k not in OPERATOR_KINDS
    )
    assert [p for o in builtin for p in kubernetes_problems(o, version)] == []


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_operator_kinds_pass_their_crd_models(overlay: str) -> None:
    operator = [o for o in render(overlay) if is_operator_kind(o)]
    assert Counter(o["kind"] for o in operator) == OPERATOR_KINDS
    assert [p for o in operator for p in operator_problems(o)] == []


def test_the_schema_check_rejects_an_unknown_field_and_a_wrong_type() -> None:
    deployment = one(render("default"), "Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    (problem,) = kubernetes_problems(typo, KUBERNETES_VERSIONS[-1])
    assert "spec/template/spec/containers/0" in problem
    assert "'livenesProbe' was unexpected" in problem
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "two"
    assert len(kubernetes_problems(wrong, KUBERNETES_VERSIONS[-1])) == 1


def test_the_crd_check_rejects_an_unknown_field_and_a_bad_duration() -> None:
    rule = one(render("default"), "PrometheusRule")
    typo = copy.deepcopy(rule)
    typo["spec"]["groups"][0]["rules"][0]["annotation"] = {"x": "y"}
    assert operator_problems(typo) == [
        "PrometheusRule at /spec/groups/0/rules/0/annotation: not in the CRD"
    ]
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    (problem,) = operator_problems(bad)
    assert problem.startswith("PrometheusRule at spec/groups/0/rules/0/for: String should match")
    monitor = copy.deepcopy(one(render("default"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["scrapeIntervall"] = "15s"
    assert operator_problems(monitor) == [
        "ServiceMonitor at /spec/endpoints/0/scrapeIntervall: not in the CRD"
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_probes_and_selectors_meet_the_pods(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = one(objects, "Service")
    assert matches(service["spec"]["selector"], pod_labels)
    serve = container(objects)
    ports = {p["name"]: p["containerPort"] for p in serve["ports"]}
    assert ports == {"http": 8080}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert serve[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert set(serve["resources"]["requests"]) == {"cpu", "memory"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_non_root_with_a_read_only_root(overlay: str) -> None:
    objects = render(overlay)
    pod = pod_spec(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    serve = container(objects)
    assert serve["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_replicas_default_two_ha_three_with_a_disruption_budget() -> None:
    assert one(render("default"), "Deployment")["spec"]["replicas"] == 2
    assert one(render("minimal"), "Deployment")["spec"]["replicas"] == 2
    ha = render("ha")
    deployment = one(ha, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    budget = one(ha, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert matches(budget["spec"]["selector"]["matchLabels"], pod_labels)
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [s["topologyKey"] for s in spread] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]
    assert all(matches(s["labelSelector"]["matchLabels"], pod_labels) for s in spread)


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_monitors_select_the_service_and_the_agents(overlay: str) -> None:
    objects = render(overlay)
    service = one(objects, "Service")
    monitor = one(objects, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [
        p["name"] for p in service["spec"]["ports"]
    ]
    # Bound off loopback, /metrics is a read: the read token, which `serve` reads from env.
    [endpoint] = monitor["spec"]["endpoints"]
    read_token = {"name": "vllm-runbook", "key": "read-token"}
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": read_token}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(objects)["env"]}
    assert env["RUNBOOK_READ_TOKEN"] == {**read_token, "optional": True}
    pods = one(objects, "PodMonitor")
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    keep, instance, namespace, rank = endpoint["relabelings"]
    assert keep["regex"] == "runbook-dp[0-9]+"
    assert instance["targetLabel"] == "instance"
    assert (namespace["sourceLabels"], namespace["targetLabel"]) == (
        ["__meta_kubernetes_namespace"],
        "namespace",
    )
    assert (rank["regex"], rank["targetLabel"], rank["replacement"]) == (
        "runbook-dp([0-9]+)",
        "dp_rank",
        "$1",
    )
    # Prometheus selects what carries its release label.
    for obj in objects:
        if is_operator_kind(obj):
            assert matches(RELEASE_LABEL, obj["metadata"]["labels"]), obj["kind"]


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_the_default_overlays_discover_the_podmonitors_targets(
    overlay: str, tmp_path: Path
) -> None:
    """runbook.yaml asks Prometheus for the PodMonitor's targets (the Operator names
    their job <namespace>/<PodMonitor>); no engine is listed."""
    from vllm_runbook.runbooks.model.config import load_config
    from vllm_runbook.runbooks.service.discovery import targets_to_engines

    objects = render(overlay)
    [config_map] = [
        o for o in objects if o["kind"] == "ConfigMap" and "runbook.yaml" in o.get("data", {})
    ]
    path = tmp_path / "runbook.yaml"
    path.write_text(config_map["data"]["runbook.yaml"])
    config = load_config(path)
    assert config.engines == () and config.discovery.prometheus is not None
    monitor = one(objects, "PodMonitor")["metadata"]
    job = f"{one(objects, 'Service')['metadata']['namespace']}/{monitor['name']}"
    target = {
        "scrapeUrl": "http://10.1.0.5:9361/metrics",
        "labels": {"job": job, "instance": "llama-7d9f", "namespace": "llm", "dp_rank": "1"},
    }
    [engine] = targets_to_engines([target], config.discovery.prometheus, config.discovery.vllm_port)
    assert (engine.name, engine.agent, engine.vllm) == (
        "llama-7d9f-dp1",
        "http://10.1.0.5:9361",
        "http://10.1.0.5:8000",
    )
    # The service needs no Kubernetes API: no Role, no token mounted.
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole", "RoleBinding")]
    assert one(objects, "ServiceAccount")["automountServiceAccountToken"] is False


def test_with_the_prometheusrule_prometheus_detects_without_it_the_service_does() -> None:
    for overlay in ("default", "ha"):
        assert container(render(overlay))["args"][-1] == "--no-rules"
    assert "--no-rules" not in container(render("minimal"))["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_reach_the_service(overlay: str) -> None:
    objects = render(overlay)
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(objects)["env"]}
    assert env == {
        "RUNBOOK_DB_URL": {"name": "vllm-runbook", "key": "database-url"},
        "RUNBOOK_READ_TOKEN": {"name": "vllm-runbook", "key": "read-token", "optional": True},
        "VLLM_RUNBOOK_TOKEN": {"name": "vllm-runbook", "key": "agent-token", "optional": True},
    }
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert volumes["secrets"]["secret"]["secretName"] == "vllm-runbook"
    assert volumes["secrets"]["secret"]["items"] == [
        {"key": "webhook-token", "path": "webhook-token"}
    ]


def test_the_example_engine_is_valid_and_what_the_podmonitor_scrapes() -> None:
    import re

    import yaml

    from tests.k8s.manifests import DEPLOY

    text = (DEPLOY / "examples" / "vllm-engine.yaml").read_text(encoding="utf-8")
    engine = [doc for doc in yaml.safe_load_all(text) if doc]
    assert [o["kind"] for o in engine] == ["Service", "Deployment", "HorizontalPodAutoscaler"]
    for version in KUBERNETES_VERSIONS:
        assert [p for o in engine for p in kubernetes_problems(o, version)] == []
    pods = one(render("default"), "PodMonitor")
    deployment = one(engine, "Deployment")
    template = deployment["spec"]["template"]
    hpa = one(engine, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert matches(pods["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    keep = re.compile(pods["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["regex"])
    (vllm,) = template["spec"]["containers"]
    agents = {p["name"]: p["containerPort"] for p in vllm["ports"] if keep.fullmatch(p["name"])}
    assert agents == {"runbook-dp0": 9360}
    env = {e["name"]: e for e in vllm["env"]}
    assert env["VLLM_RUNBOOK_HOST"]["value"] == "0.0.0.0"
    serve_env = {e["name"]: e for e in container(render("default"))["env"]}
    assert env["VLLM_RUNBOOK_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        k: v
        for k, v in serve_env["VLLM_RUNBOOK_TOKEN"]["valueFrom"]["secretKeyRef"].items()
        if k != "optional"
    }


COMPONENT_KINDS = {
    "components/servicemonitor": "ServiceMonitor",
    "components/engine-podmonitor": "PodMonitor",
    "components/prometheusrule": "PrometheusRule",
    "components/alertmanagerconfig": "AlertmanagerConfig",
    "../../dashboards": "ConfigMap",
}


@pytest.mark.parametrize("dropped", sorted(COMPONENT_KINDS))
def test_each_optional_piece_switches_off_alone(dropped: str, tmp_path: Path) -> None:
    """The default overlay without one of its components renders the rest."""
    import os

    import yaml

    from tests.k8s.manifests import DEPLOY, render_dir

    default = yaml.safe_load((DEPLOY / "default" / "kustomization.yaml").read_text())
    overlay = tmp_path / "overlay"
    overlay.mkdir()

    def moved(path: str) -> str:
        return os.path.relpath((DEPLOY / "default" / path).resolve(), overlay)

    kept = [c for c in default["components"] if c != f"../{dropped}"]
    assert len(kept) == len(default["components"]) - 1
    default["resources"] = [moved(p) for p in default["resources"]]
    default["components"] = [moved(p) for p in kept]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(default))
    (overlay / "runbook.yaml").write_text((DEPLOY / "default" / "runbook.yaml").read_text())
    objects = render_dir(overlay)
    expected = EXPECTED_KINDS["default"] - Counter({COMPONENT_KINDS[dropped]: 1})
    if dropped == "../../dashboards":
        expected -= Counter({"ConfigMap": 2})
    assert Counter(o["kind"] for o in objects) == expected
    no_rules = "--no-rules" in container(objects)["args"]
    assert no_rules is (dropped != "components/prometheusrule")
