"""The AlertmanagerConfig, merged into Alertmanager's configuration as the Operator
does: amtool accepts it and routes every catalog alert, and nothing else, to
`runbook serve`'s webhook with the Secret's bearer token."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from vllm_runbook.rules import load_catalog

from tests.engines import require_tool
from tests.k8s.alertmanager import ROOT_RECEIVER, alertmanager_config
from tests.k8s.manifests import one, pod_spec, render

TOKEN = "test-token-of-the-secret"
NAMESPACE = "vllm-runbook"
RECEIVER = f"{NAMESPACE}/vllm-runbook/runbook-serve"


def _write_config(tmp_path: Path, overlay: str = "default") -> Path:
    amc = one(render(overlay), "AlertmanagerConfig")
    path = tmp_path / "alertmanager.yml"
    config = alertmanager_config(amc, {("vllm-runbook", "webhook-token"): TOKEN})
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _route(amtool: str, config: Path, *labels: str) -> str:
    done = subprocess.run(
        [amtool, "config", "routes", "test", "--config.file", str(config), *labels],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_amtool_accepts_the_merged_configuration(tmp_path: Path, overlay: str) -> None:
    amtool = require_tool("amtool")
    done = subprocess.run(
        [amtool, "check-config", str(_write_config(tmp_path, overlay))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 receivers" in done.stdout
    assert "1 inhibit rules" in done.stdout


def test_every_catalog_alert_routes_to_the_webhook(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    config = _write_config(tmp_path)
    alerts = sorted(load_catalog().alerts)
    assert len(alerts) == 23
    for alert in alerts:
        got = _route(amtool, config, f"alertname={alert}", f"namespace={NAMESPACE}")
        assert got == RECEIVER, alert


def test_other_alerts_and_other_namespaces_stay_on_the_root_route(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    config = _write_config(tmp_path)
    assert _route(amtool, config, "alertname=KubePodCrashLooping", f"namespace={NAMESPACE}") == (
        ROOT_RECEIVER
    )
    # The Operator's namespace matcher: alerts of engines in another namespace.
    assert _route(amtool, config, "alertname=VllmOOMPressure", "namespace=llm") == ROOT_RECEIVER


def test_amtool_rejects_a_route_to_an_unknown_receiver(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    path = _write_config(tmp_path)
    path.write_text(path.read_text().replace("receiver: " + RECEIVER, "receiver: nobody"))
    done = subprocess.run([amtool, "check-config", str(path)], capture_output=True, timeout=60)
    assert done.returncode != 0


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_webhook_reaches_the_service_with_the_secrets_token(overlay: str) -> None:
    objects = render(overlay)
    service = one(objects, "Service")
    amc = one(objects, "AlertmanagerConfig")
    (receiver,) = amc["spec"]["receivers"]
    (hook,) = receiver["webhookConfigs"]
    url = urlsplit(hook["url"])
    (port,) = service["spec"]["ports"]
    meta = service["metadata"]
    assert url.scheme == "http"
    assert url.netloc == f"{meta['name']}.{meta['namespace']}.svc:{port['port']}"
    assert url.path == "/webhooks/alertmanager"
    assert hook["sendResolved"] is True
    credentials = hook["httpConfig"]["authorization"]["credentials"]
    secret = {v["name"]: v for v in pod_spec(objects)["volumes"]}["secrets"]["secret"]
    assert credentials == {"name": secret["secretName"], "key": secret["items"][0]["key"]}
    merged = alertmanager_config(amc, {("vllm-runbook", "webhook-token"): TOKEN})
    auth = merged["receivers"][1]["webhook_configs"][0]["http_config"]["authorization"]
    assert auth == {"type": "Bearer", "credentials": TOKEN}


# The overlay the README shows for installing elsewhere than the defaults.
YOUR_OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: llm
resources:
  - {default}
labels:
  - pairs:
      release: my-prometheus
images:
  - name: vllm-runbook
    newName: registry.example.com/vllm-runbook
    newTag: 0.1.0
configMapGenerator:
  - name: vllm-runbook-config
    behavior: replace
    files:
      - runbook.yaml
# The webhook URL names the namespace: point it at this overlay's.
replacements:
  - source:
      kind: Service
      name: vllm-runbook
      fieldPath: metadata.namespace
    targets:
      - select:
          kind: AlertmanagerConfig
          name: vllm-runbook
        fieldPaths:
          - spec.receivers.[name=runbook-serve].webhookConfigs.0.url
        options:
          delimiter: "."
          index: 1
"""


def test_your_overlay_sets_namespace_release_image_and_configuration(tmp_path: Path) -> None:
    import os

    from tests.k8s.manifests import DEPLOY, container, render_dir

    overlay = tmp_path / "mine"
    overlay.mkdir()
    default = os.path.relpath(DEPLOY / "default", overlay)
    (overlay / "kustomization.yaml").write_text(YOUR_OVERLAY.format(default=default))
    (overlay / "runbook.yaml").write_text("automation: {oom-pressure: auto}\n")
    objects = render_dir(overlay)
    assert {o["metadata"]["namespace"] for o in objects} == {"llm"}
    amc = one(objects, "AlertmanagerConfig")
    url = amc["spec"]["receivers"][0]["webhookConfigs"][0]["url"]
    assert url == "http://vllm-runbook.llm.svc:8080/webhooks/alertmanager"
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"):
        assert one(objects, kind)["metadata"]["labels"]["release"] == "my-prometheus"
    assert container(objects)["image"] == "registry.example.com/vllm-runbook:0.1.0"
    config = one(objects, "ConfigMap", _config_map_name(objects))
    assert config["data"] == {"runbook.yaml": "automation: {oom-pressure: auto}\n"}


def _config_map_name(objects: list[dict]) -> str:
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    return str(volumes["config"]["configMap"]["name"])
