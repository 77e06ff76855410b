"""deploy/Containerfile builds what the Deployment runs. No container engine runs
here, so the file is read: the package folders it copies, the user it runs as,
its port and entry point, against pyproject.toml and the rendered Deployment."""

from __future__ import annotations

import json
import shlex
import tomllib

from tests.k8s.manifests import REPO, container, pod_spec, render

CONTAINERFILE = REPO / "deploy" / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    text = CONTAINERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_image_copies_every_package_folder_and_the_build_context_holds_them() -> None:
    folders = set(_pyproject()["tool"]["setuptools"]["package-dir"].values())
    copied = {
        source
        for word, rest in _instructions()
        if word == "COPY" and not rest.startswith("--from")
        for source in shlex.split(rest)[:-1]
    }
    assert copied == folders | {"pyproject.toml", "README.md"}
    ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert {line[1:] for line in ignore if line.startswith("!")} == copied


def test_the_image_runs_runbook_as_the_deployments_user_on_its_port() -> None:
    instructions = dict(_instructions()[-4:])
    assert _pyproject()["project"]["scripts"]["runbook"] == "vllm_runbook.runbooks.operate.cli:main"
    assert json.loads(instructions["ENTRYPOINT"]) == ["runbook"]
    objects = render("default")
    security = pod_spec(objects)["securityContext"]
    assert instructions["USER"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert int(instructions["EXPOSE"]) == container(objects)["ports"][0]["containerPort"]
    assert json.loads(instructions["CMD"])[0] == container(objects)["args"][0] == "serve"


def test_the_image_installs_the_postgres_extra() -> None:
    assert "postgres" in _pyproject()["project"]["optional-dependencies"]
    installs = [rest for word, rest in _instructions() if word == "RUN" and "pip install" in rest]
    assert len(installs) == 1
    assert '"${wheel}[postgres]"' in installs[0]
