"""The dashboards are built on Grafana's own types (the Grafana Foundation SDK).

Grafana itself cannot run here, so its schema, as the SDK generates it for the
pinned Grafana version, referees the JSON: every field we write must read back
through the SDK's models, except the few that the schema has no place for
(docs/development.md says which). The SDK is needed only to regenerate; without
it, or with another release, the generator says so instead of a traceback.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as grafana
from vllm_runbook.dashboards import generate
from vllm_runbook.dashboards.definitions import DASHBOARDS
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR, SDK

REPO = Path(__file__).resolve().parents[2]
# The Prometheus data source's annotation options (builder.PromAnnotation).
PROMETHEUS_ANNOTATION_OPTIONS = {"step", "titleFormat", "textFormat", "tagKeys", "useValueForTime"}


def _lost(written: Any, read_back: Any, path: str = "") -> list[str]:
    """The paths of `written` that are missing from `read_back`, or differ."""
    if isinstance(written, dict) and isinstance(read_back, dict):
        out = [f"{path}/{k}" for k in written if k not in read_back]
        for k in written.keys() & read_back.keys():
            out += _lost(written[k], read_back[k], f"{path}/{k}")
        return out
    if isinstance(written, list) and isinstance(read_back, list):
        if len(written) != len(read_back):
            return [f"{path} (length)"]
        return [
            p
            for i, (a, b) in enumerate(zip(written, read_back, strict=True))
            for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if written == read_back else [f"{path} ({written!r} -> {read_back!r})"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_the_json_reads_back_through_grafanas_types(name: str) -> None:
    written = json.loads((DASHBOARDS_DIR / name).read_text())
    model = grafana.Dashboard.from_json(written)
    read_back = json.loads(json.dumps(model, cls=JSONEncoder))
    prometheus_annotations = [
        i for i, a in enumerate(written["annotations"]["list"]) if "expr" in a
    ]
    assert prometheus_annotations  # the knob changes at least
    expected = sorted(
        f"/annotations/list[{i}]/{option}"
        for i in prometheus_annotations
        for option in PROMETHEUS_ANNOTATION_OPTIONS
    )
    assert sorted(_lost(written, read_back)) == expected
    assert written["schemaVersion"] == grafana.Dashboard().schema_version == 41


def test_the_pin_is_installed_and_names_the_grafana_version_the_docs_state() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    # The SDK's pin, beside promql-parser (dashboards/lint.py's parser).
    (pin,) = [p for p in extras["dashboards"] if p.startswith(SDK)]
    installed = importlib.metadata.version(SDK)
    assert pin == f"{SDK}=={installed}"
    assert "vllm-runbook[dashboards]" in extras["dev"]  # make setup / make dashboards have it
    assert generate.sdk_pin() == installed
    grafana_version = installed.partition("!")[2]  # 1769699379!11.6.0: build, Grafana 11.6.0
    major_minor = ".".join(grafana_version.split(".")[:2])
    assert major_minor == "11.6"
    docs = (REPO / "docs" / "dashboards.md").read_text()
    assert f"Grafana {major_minor}" in docs and f"`{pin.partition('==')[2]}`" in docs


def test_generate_without_the_sdk_says_how_to_install_it() -> None:
    # None in sys.modules makes the import fail as it does where the package is absent.
    script = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"
        "from vllm_runbook.dashboards.generate import main\n"
        "sys.exit(main(['--check']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr == (f"error: {SDK} is not installed; to regenerate: {generate.INSTALL}\n")


def test_generate_refuses_another_sdk_release(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_version = importlib.metadata.version
    other = "1769699998!10.1.0"
    monkeypatch.setattr(
        importlib.metadata, "version", lambda n: other if n == SDK else real_version(n)
    )
    assert generate.main(["--check"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"error: {SDK} {other} is installed but vllm-runbook pins {real_version(SDK)} (one "
        f"release per Grafana version, and their JSON differs); reinstall: {generate.INSTALL}\n"
    )
