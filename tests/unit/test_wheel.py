"""The wheel: one top-level name, the data it needs, and it works installed.

Built from a copy of the sources with the shared venv's setuptools (no
network, no build isolation), installed into a fresh venv that sees the
shared venv's packages through a .pth path entry but not its editable
install of this project; from there vLLM loads the plugin, `runbook --help`
answers and `runbook db upgrade` migrates a SQLite file from another cwd.
Not marked: it runs with the fast tests and in CI (about half a minute).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "collector", "rules", "runbooks", "dashboards")


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--no-index", "-q", "-w", str(dist), str(src)),
        ]
    )
    [built] = dist.glob("*.whl")
    return built


def test_the_wheel_holds_one_top_level_name_and_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"vllm_runbook", "vllm_runbook-0.1.0.dist-info"}
    assert "vllm_runbook/__init__.py" not in names  # a namespace package
    inside = {n.removeprefix("vllm_runbook/") for n in names}
    shipped = {
        f"{pkg}/{p.relative_to(ROOT / pkg)}"
        for pkg, patterns in (
            ("collector", ["vllm_matrix.json", "adapters/*.py"]),
            ("rules", ["catalog/*.yaml"]),
            ("runbooks", ["catalog/*.yaml", "templates/*.j2", "templates/*.css", "demo/DEMO.md"]),
            ("runbooks", ["store/migrations/script.py.mako", "store/migrations/env.py"]),
            ("runbooks", ["store/migrations/versions/*.py"]),
            ("dashboards", ["*.json", "*.yml", "provisioning/*.yaml"]),
        )
        for pattern in patterns
        for p in (ROOT / pkg).glob(pattern)
    }
    named = {
        "collector/vllm_matrix.json",
        "collector/adapters/admission.py",
        "rules/catalog/memory.yaml",
        "runbooks/catalog/oom-pressure.yaml",
        "runbooks/store/migrations/script.py.mako",
        "runbooks/store/migrations/versions/0001_initial_schema.py",
        "dashboards/provisioning/dashboards.yaml",
    }
    assert named <= shipped  # the globs above do find the data
    assert (
        len([s for s in shipped if s.startswith("runbooks/templates/")])
        == len(
            [p for p in (ROOT / "runbooks" / "templates").iterdir() if p.suffix in (".j2", ".css")]
        )
        > 0
    )
    assert shipped - inside == set()
    entry_points = zipfile.ZipFile(wheel).read("vllm_runbook-0.1.0.dist-info/entry_points.txt")
    assert "vllm_runbook = vllm_runbook.collector.plugin:register" in entry_points.decode()


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = Path(purelib.stdout.strip())
    # A path entry, not a .pth file: the shared venv's own .pth files (the
    # editable install's finder among them) are not processed from it.
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "shared-venv.pth").write_text("\n".join(sorted(shared)) + "\n")
    run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env=env(),
    )
    return venv


def env() -> dict[str, str]:
    """No PYTHONPATH (the link tree of the sources) and no plugin allow-list."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}


def test_vllm_loads_the_plugin_from_the_installed_wheel(fresh_venv: Path) -> None:
    code = """
import json, sys
from vllm.plugins import load_general_plugins, load_plugins_by_group
from vllm.config.scheduler import SchedulerConfig
load_general_plugins()
import vllm_runbook.collector.plugin as plugin
print(json.dumps({
    "registered": plugin._registered,
    "wrapped_by": SchedulerConfig.get_scheduler_cls.__code__.co_filename,
    "plugin_file": plugin.__file__,
    "editable": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
    "group": sorted(load_plugins_by_group("vllm.general_plugins")),
}))
"""
    out = run([str(fresh_venv / "bin" / "python"), "-c", code], env=env(), cwd=fresh_venv)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["registered"] is True
    assert seen["wrapped_by"] == seen["plugin_file"]  # our wrapper, from the installed wheel
    assert Path(seen["plugin_file"]).is_relative_to(fresh_venv)
    assert seen["editable"] == []  # the shared venv's editable finder is not installed
    assert "vllm_runbook" in seen["group"]


def test_the_cli_runs_and_migrates_from_the_installed_wheel(
    fresh_venv: Path, tmp_path: Path
) -> None:
    runbook = str(fresh_venv / "bin" / "runbook")
    helped = run([runbook, "--help"], env=env(), cwd=tmp_path)
    assert helped.stdout.startswith("usage: runbook")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    db = tmp_path / "journal.db"
    run([runbook, "db", "upgrade", "--db", f"sqlite:///{db}"], env=env(), cwd=elsewhere)
    with sqlite3.connect(db) as conn:
        [(version,)] = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    heads = sorted(
        p.stem.split("_")[0] for p in (ROOT / "runbooks/store/migrations/versions").glob("*.py")
    )
    assert version == heads[-1]
