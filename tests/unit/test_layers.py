"""The layers point one way: collector <- rules <- runbooks <- dashboards, and
inside the runbooks model <- engine | store <- run <- service <- demo <- operate;
no module imports one that imports it back.

`lint-imports` (the contracts in pyproject.toml, run by `make lint`) keeps the
real tree and refuses a copy of it with one wrong import; importing the rules
loads no database, web framework or store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collector", "rules", "runbooks", "dashboards")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over `root`'s folders under their import names (a build/ns link tree)."""
    ns = root / "build" / "ns" / "vllm_runbook"
    ns.mkdir(parents=True, exist_ok=True)
    for p in PACKAGES:
        link = ns / p
        if not link.exists():
            link.symlink_to(root / p, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(root / "build" / "ns")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def with_line(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """lint-imports over a copy of the tree with `line` added to `module` (a path)."""
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    for p in PACKAGES:
        shutil.copytree(ROOT / p, copy / p, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")
    return lint_imports(copy)


def test_the_tree_keeps_every_import_contract_and_a_wrong_import_breaks_one(
    tmp_path: Path,
) -> None:
    kept = lint_imports(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "Contracts: 7 kept, 0 broken." in kept.stdout

    broken = with_line(
        tmp_path, "rules/evaluator.py", "from vllm_runbook.runbooks.store import Journal"
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "Contracts: 5 kept, 2 broken." in broken.stdout
    assert "Layers: dashboards > runbooks > rules > collector BROKEN" in broken.stdout
    assert "The rules know no database, web service or server BROKEN" in broken.stdout
    assert "vllm_runbook.rules.evaluator -> vllm_runbook.runbooks.store" in broken.stdout


def test_a_room_that_imports_one_above_it_breaks_the_rooms(tmp_path: Path) -> None:
    # The journal asking the service: upward, and a circle (the service imports the store).
    broken = with_line(
        tmp_path,
        "runbooks/store/journal.py",
        "from vllm_runbook.runbooks.service.breaker import Breaker",
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "Rooms: operate > demo > service > run > engine | store > model BROKEN" in broken.stdout
    assert "vllm_runbook.runbooks.store.journal -> vllm_runbook.runbooks.service.breaker" in (
        broken.stdout
    )
    assert "No module imports one that imports it back BROKEN" in broken.stdout


def test_a_circle_inside_one_room_breaks_the_acyclic_contract(tmp_path: Path) -> None:
    # A type-checking import counts: the state builder naming the collector back.
    broken = with_line(
        tmp_path,
        "collector/state.py",
        "from vllm_runbook.collector.engine_collector import EngineCollector",
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "Contracts: 6 kept, 1 broken." in broken.stdout
    assert "No module imports one that imports it back BROKEN" in broken.stdout
    assert "No cycles are allowed in vllm_runbook.collector." in broken.stdout


def test_importing_the_rules_loads_no_database_web_service_or_store() -> None:
    code = "import json, sys\nimport vllm_runbook.rules\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = json.loads(out.stdout)
    assert "vllm_runbook.rules.evaluator" in loaded  # the import did load the rules
    unwanted = ("sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn", "vllm_runbook.runbooks")
    assert [m for m in loaded if m.split(".")[0] in unwanted or m.startswith(unwanted)] == []
