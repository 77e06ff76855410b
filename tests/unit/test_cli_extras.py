"""A command whose extra is not installed says which one, in one line, exit 2.

`pip install vllm-runbook` is the engine's plugin alone; the commands need
the `service` extra (`runbook top`: the `top` extra). Each case runs the CLI
in a subprocess where a meta-path finder makes the named packages absent, as
in an install without them (ModuleNotFoundError, as Python raises for a
package that is not there). The extras' lists agree with pyproject.toml.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.extras import EXTRA_MODULES, needed_extra

ROOT = Path(__file__).resolve().parents[2]

# Runs `runbook ARGS...` with the packages of argv[1] (comma-separated) absent.
WITHOUT = """
import importlib.abc, sys

absent = set(sys.argv[1].split(","))


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from vllm_runbook.runbooks.operate.cli import main

sys.exit(main(sys.argv[2:]))
"""

SERVICE = sorted(EXTRA_MODULES["service"])
TOP = sorted(EXTRA_MODULES["top"])
CORE_ONLY = [*SERVICE, *TOP, *sorted(EXTRA_MODULES["plots"])]


def runbook_without(absent: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(absent), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    return out.stderr


@pytest.mark.parametrize(
    ("args", "extra", "who"),
    [
        (["--help"], "service", "the `runbook` command"),
        (["status", "--engine", "http://127.0.0.1:9"], "service", "`runbook status`"),
        (["db", "upgrade", "--db", "sqlite:///{tmp}/journal.db"], "service", "`runbook db`"),
        (["serve"], "service", "`runbook serve`"),
        (["top", "--engine", "http://127.0.0.1:9"], "top", "`runbook top`"),
    ],
    ids=["help", "status", "db", "serve", "top"],
)
def test_the_core_install_names_the_extra_each_command_needs(
    args: list[str], extra: str, who: str, tmp_path: Path
) -> None:
    line = one_line(runbook_without(CORE_ONLY, *(a.format(tmp=tmp_path) for a in args)))
    assert line.startswith(
        f"runbook: error: {who} needs the {extra} extra: pip install 'vllm-runbook[{extra}]' "
    ), line
    assert list(tmp_path.iterdir()) == []  # nothing was done


def test_top_without_textual_names_the_top_extra() -> None:
    line = one_line(runbook_without(TOP, "top", "--engine", "http://127.0.0.1:9"))
    assert line == (
        "runbook: error: `runbook top` needs the top extra: "
        "pip install 'vllm-runbook[top]' (no module named 'textual')\n"
    )


def test_serve_without_uvicorn_names_the_service_extra() -> None:
    # `runbook serve` imports uvicorn when it starts, after the parser is built.
    line = one_line(runbook_without(["uvicorn"], "serve"))
    assert line == (
        "runbook: error: `runbook serve` needs the service extra: "
        "pip install 'vllm-runbook[service]' (no module named 'uvicorn')\n"
    )


def test_with_the_extras_the_same_command_runs() -> None:
    out = runbook_without(TOP, "--help")  # textual is not needed for the parser
    assert out.returncode == 0 and out.stdout.startswith("usage: runbook"), out.stderr


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (ModuleNotFoundError("No module named 'nope'", name="nope"), None),
        # A missing module of an installed package is a bug: its traceback is kept.
        (ModuleNotFoundError("No module named 'sqlalchemy.nope'", name="sqlalchemy.nope"), None),
        (ImportError("cannot import name 'x' from 'fastapi'", name="fastapi"), None),
        (ValueError("a bug"), None),
        (
            ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"),
            "`runbook report` needs the plots extra: pip install 'vllm-runbook[plots]' "
            "(no module named 'matplotlib')",
        ),
        (
            ModuleNotFoundError("No module named 'rich'", name="rich"),
            "`runbook report` needs the top extra: pip install 'vllm-runbook[top]' "
            "(no module named 'rich')",
        ),
    ],
)
def test_only_a_missing_package_of_an_extra_is_one_line(
    error: BaseException, line: str | None
) -> None:
    assert needed_extra(error, ["report", "1"]) == line


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lists_are_the_extras_of_pyproject() -> None:
    """Each package an extra requires is in its list; each listed module is a
    package of that extra (or one that a package of it brings: starlette, rich)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    dists_of = {m: {_canonical(d) for d in ds} for m, ds in packages_distributions().items()}
    brought = {"rich": "textual"}
    for extra, modules in EXTRA_MODULES.items():
        required = {
            _canonical(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in extras[extra]
        } - {"vllm-runbook"}
        listed = {d for m in modules for d in dists_of[m]}
        assert required <= listed, f"{extra}: {required - listed} missing from EXTRA_MODULES"
        for module in modules:
            dist = _canonical(brought.get(module, next(iter(dists_of[module]))))
            assert dist in required, f"{extra}: {module} is not a package of the extra"
