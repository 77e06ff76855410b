"""`runbook demo` from an installed package: the wheel built from this checkout,
unpacked into a directory of its own and run from another directory, with no
source checkout on the import path (no engine; tests/demo/test_demo.py runs
the story itself)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collector", "rules", "runbooks", "dashboards")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, unpacked: what `pip install` puts in site-packages."""
    src = tmp_path_factory.mktemp("src")  # built from a copy: no build/ in the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(
            REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    wheels = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip, "--no-index", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("vllm_runbook-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python *args` with the unpacked wheel as the only project on the import path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_runbook_demo_help_from_an_installed_package(site: Path, tmp_path: Path) -> None:
    proc = run_installed(
        site, tmp_path, "-m", "vllm_runbook.runbooks.operate.cli", "demo", "--help"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: runbook demo [-h] [--ci] [--dir DIR]\n"), proc.stdout
    assert "--ci " in proc.stdout and "default\n              .demo)" in proc.stdout
    assert "an engine in trouble, detected, fixed and reverted" in proc.stdout
    assert proc.stderr == ""
    assert list(tmp_path.iterdir()) == []  # --help writes nothing


def test_the_installed_demo_needs_no_checkout(site: Path, tmp_path: Path) -> None:
    """Every demo module imports from the wheel alone, and the demo's files are
    written from its package data (the shipped runbook catalog, DEMO.md)."""
    script = """
import importlib, importlib.resources, json, pkgutil, sys
from pathlib import Path
import vllm_runbook.runbooks.demo as demo
for m in pkgutil.iter_modules(demo.__path__, demo.__name__ + "."):
    importlib.import_module(m.name)
from vllm_runbook.runbooks.demo.config import write_config, write_runbooks
out = Path("out")
write_runbooks(out / "runbooks")
write_config(out / "runbook.yaml", "sqlite:///x.db", "http://127.0.0.1:1", "http://127.0.0.1:2")
print(json.dumps({
    "modules": {n: getattr(m, "__file__", None) for n, m in sys.modules.items()
                if n.split(".")[0] in ("vllm_runbook", "tests", "benchmarks")},
    "demo_md": (importlib.resources.files("vllm_runbook.runbooks.demo") / "DEMO.md").is_file(),
}))
"""
    proc = run_installed(site, tmp_path, "-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    modules = found["modules"]
    demo_modules = {n for n in modules if n.startswith("vllm_runbook.runbooks.demo.")}
    assert demo_modules == {
        f"vllm_runbook.runbooks.demo.{n}"
        for n in ("config", "live", "report", "servers", "story", "summary", "traffic")
    }
    outside = {n: f for n, f in modules.items() if f and not Path(f).is_relative_to(site)}
    assert outside == {}, "imported from outside the installed package"
    assert found["demo_md"] is True

    written = sorted(p.name for p in (tmp_path / "out/runbooks").iterdir())
    shipped = sorted(p.name for p in (REPO_ROOT / "runbooks/catalog").glob("*.yaml"))
    assert written == shipped
    oom = yaml.safe_load((tmp_path / "out/runbooks/oom-pressure.yaml").read_text())
    assert oom["verification"]["deadline_seconds"] == 40
    assert oom["revert"]["healthy_period_seconds"] == 8
    config = yaml.safe_load((tmp_path / "out/runbook.yaml").read_text())
    assert config["engines"] == [
        {"name": "cpu-0", "agent": "http://127.0.0.1:1", "vllm": "http://127.0.0.1:2"}
    ]
    assert config["automation"]["oom-pressure"] == "auto"
