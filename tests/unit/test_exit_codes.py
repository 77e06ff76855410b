"""One exit-code table: `ExitCode` (runbooks/model/exit_codes.py) is the only place a
code is given a name, every error that ends a command carries one of its
members, and the CLI's one `main` maps them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from vllm_runbook.collector.auth import TokenError
from vllm_runbook.rules.errors import RUNBOOK_CATALOG, CatalogError, Problem
from vllm_runbook.runbooks.engine.client import (
    AuthFailed,
    CommandRefused,
    EngineClientError,
    EngineUnreachable,
    NotAnAgent,
)
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.cli.errors import UsageError, exit_code, message
from vllm_runbook.runbooks.operate.top.sources import DecisionFailed, ServiceError
from vllm_runbook.runbooks.run.outcome import UnknownRunbook
from vllm_runbook.runbooks.run.revert import RevertRefused
from vllm_runbook.runbooks.store import (
    ExecutionNotFound,
    InvalidInput,
    StoreError,
    StoreUnavailable,
)
from vllm_runbook.runbooks.store.errors import IllegalTransition, SchemaMissing

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "runbooks" / "model" / "exit_codes.py"
SOURCES = sorted(
    p
    for folder in ("collector", "rules", "runbooks", "dashboards", "benchmarks", "tests")
    for p in (ROOT / folder).rglob("*.py")
    if p != TABLE
)
# Where a command's code is decided: a bare number returned there is a second table.
COMMAND_MODULES = [
    *sorted((ROOT / "runbooks" / "operate" / "cli").glob("*.py")),
    ROOT / "runbooks" / "service" / "serve_cli.py",
    ROOT / "runbooks" / "demo" / "summary.py",
]


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for t in target.elts for n in _names(t)]
    return []


def _int(node: ast.expr | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
    )


def _second_tables(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for name in (n for t in targets for n in _names(t)):
            if name.startswith("EXIT_"):
                found.append(f"{shown}:{node.lineno}: defines {name}")
            elif name == "exit_code" and _int(value):
                found.append(f"{shown}:{node.lineno}: exit_code = a number")
    return found


def test_no_module_but_the_table_names_an_exit_code() -> None:
    assert len(SOURCES) > 100  # the scan sees the tree
    found = [line for path in SOURCES for line in _second_tables(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_a_second_table(tmp_path: Path) -> None:
    for text in ("EXIT_OK = 0\n", "EXIT_A, EXIT_B = 1, 2\n", "class E:\n    exit_code = 3\n"):
        path = tmp_path / "probe.py"
        path.write_text(text, encoding="utf-8")
        assert _second_tables(path), text


@pytest.mark.parametrize("path", COMMAND_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_return_members_of_the_table_not_numbers(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    numbers = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Return) and _int(n.value)]
    assert not numbers, f"{path.relative_to(ROOT)}: `return <number>` at lines {numbers}"


def test_the_table_is_one_meaning_per_number() -> None:
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("OK", 0),
        ("FAILED", 1),
        ("USAGE", 2),
        ("ENGINE", 3),
        ("STORE", 4),
        ("SERVICE", 5),
        ("INTERRUPTED", 130),
    ]
    assert all(c.meaning for c in ExitCode)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (StoreError("at an unknown revision"), ExitCode.STORE),
        (StoreUnavailable("down"), ExitCode.STORE),
        (SchemaMissing("not migrated"), ExitCode.STORE),
        (IllegalTransition(1, "succeeded", "running"), ExitCode.STORE),
        (ExecutionNotFound(7), ExitCode.USAGE),
        (InvalidInput("note too long"), ExitCode.USAGE),
        (EngineClientError("odd answer"), ExitCode.FAILED),
        (EngineUnreachable("refused"), ExitCode.ENGINE),
        (NotAnAgent("html"), ExitCode.ENGINE),
        (AuthFailed("401"), ExitCode.ENGINE),
        (CommandRefused("out of bounds"), ExitCode.USAGE),
        (UnknownRunbook("nope"), ExitCode.USAGE),
        (RevertRefused("already reverted"), ExitCode.USAGE),
        (UsageError("bad argument"), ExitCode.USAGE),
        (ServiceError("unreachable"), ExitCode.SERVICE),
        (DecisionFailed("too late"), ExitCode.FAILED),
        (CatalogError([Problem("broken", file="x.yaml", line=1)]), ExitCode.USAGE),
        (TokenError("unreadable token"), ExitCode.USAGE),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ExitCode.USAGE),
        (ValueError("a bug"), None),
    ],
)
def test_each_error_maps_to_one_code(error: BaseException, code: ExitCode | None) -> None:
    assert exit_code(error) is code
    if isinstance(error, RunbookError):
        assert isinstance(type(error).exit_code, ExitCode)


def test_a_broken_runbook_catalog_is_named_then_one_line_per_problem() -> None:
    problems = [
        Problem("x", file="a.yaml", line=1, runbook="a"),
        Problem("y", file="b.yaml", line=2, runbook="b"),
    ]
    error = CatalogError(problems, what=RUNBOOK_CATALOG)
    assert (
        message(error) == "invalid runbook catalog:\na.yaml:1: runbook a: x\nb.yaml:2: runbook b: y"
    )
    assert message(UsageError("one line")) == "one line"
