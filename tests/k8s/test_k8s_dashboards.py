"""The dashboards reach Grafana's sidecar as ConfigMaps made from the generated files."""

from __future__ import annotations

import json

import pytest
from vllm_runbook.dashboards.definitions import DASHBOARDS
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR

from tests.k8s.manifests import REPO, render


@pytest.mark.parametrize("overlay", ["default", "ha"])
def test_every_generated_dashboard_is_a_sidecar_configmap_of_its_file(overlay: str) -> None:
    maps = [
        o
        for o in render(overlay)
        if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    found = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "vLLM runbook"}
        ((key, text),) = config_map["data"].items()
        found[key] = text
    assert set(found) == set(DASHBOARDS)
    for name, text in found.items():
        assert text == (DASHBOARDS_DIR / name).read_text(encoding="utf-8")
        assert json.loads(text)["uid"]


def test_the_component_lives_beside_the_files_it_reads() -> None:
    # Kustomize reads files only inside a kustomization's folder: the component
    # is dashboards/kustomization.yaml, so there is no copy to go stale.
    assert (REPO / "dashboards" / "kustomization.yaml").is_file()
    assert DASHBOARDS_DIR.resolve() == (REPO / "dashboards").resolve()


def test_no_dashboards_without_the_component() -> None:
    assert not [
        o for o in render("minimal") if "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
