"""What the code and the docs cite is in the repository.

A tracked text file (.py, .md, .yaml, .yml, .toml) that names a file of ours
(`collector/…py`, `rules/…py`, `runbooks/…py`, `dashboards/…py`, `tools/…py`,
`compat/…py`, `docs/…md`, from the repository's root) or a module of ours
(`vllm_runbook.<package>.<module>[.<name>]`) names one that exists; and
nothing cites the design document, which is not in the repository. A
relative link (`../collector/x.py`, `metrics.md`) is not a citation from the
root: test_docs.py resolves the pages' links. `tests/…` and `benchmarks/…`
are not checked: vLLM has folders of those names and its files are cited too.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml")
# Not preceded by a path character (so not the tail of a relative link or of
# another repository's path), not followed by one (`script.py.mako` is not
# `script.py`; a sentence's full stop may follow).
_PATH = re.compile(
    r"(?<![\w./-])"
    r"((?:collector|rules|runbooks|dashboards|tools|compat)/[\w./-]*?\.py|docs/[\w./-]*?\.md)"
    r"(?![\w-]|\.\w)"
)
# Logger names (`vllm_runbook.service`) are not modules: only our four packages.
_MODULE = re.compile(r"(?<![\w.])vllm_runbook\.((?:collector|rules|runbooks|dashboards)(?:\.\w+)*)")
_DESIGN = re.compile(r"\bDESIGN\.md\b")

# The bad citations of this file's second test.
EXAMPLES = ("DESIGN.md", "docs/gone.md", "rules/gone.py", "vllm_runbook.runbooks.check_cli")
# (file, cited): paths of the temporary trees tests build, and the examples.
ALLOWED = {
    ("tests/unit/test_docs.py", "docs/x.md"),
    *(("tests/unit/test_citations.py", cited) for cited in ("docs/x.md", *EXAMPLES)),
}


def tracked(root: Path) -> list[str]:
    """The text files git knows under `root` (tracked, or new and not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return sorted({name for name in out.stdout.splitlines() if name.endswith(SUFFIXES)})


def _module_exists(root: Path, dotted: str) -> bool:
    """`collector.metrics.MetricSpec` exists: the longest prefix that is a module
    of the checkout, and the next name (if any) occurs in that module's text."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file():
            module = base.with_suffix(".py")
        elif (base / "__init__.py").is_file():
            module = base / "__init__.py"
        else:
            continue
        rest = parts[n:]
        if not rest:
            return True
        text = module.read_text(encoding="utf-8")
        return re.search(rf"\b{re.escape(rest[0])}\b", text) is not None
    return False


def dangling(
    root: Path, files: Iterable[str], allowed: set[tuple[str, str]] = ALLOWED
) -> list[str]:
    """`file:line: cited` for every citation in `files` (relative to `root`)
    of something the checkout does not have."""
    found = []
    for name in files:
        path = root / name
        if not path.is_file():  # deleted in the working tree
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            cited = [m.group(0) for m in _DESIGN.finditer(line)]
            cited += [m.group(1) for m in _PATH.finditer(line) if not (root / m.group(1)).exists()]
            cited += [
                m.group(0) for m in _MODULE.finditer(line) if not _module_exists(root, m.group(1))
            ]
            found += [f"{name}:{number}: {c}" for c in cited if (name, c) not in allowed]
    return found


def test_every_citation_names_a_file_of_the_repository() -> None:
    files = tracked(ROOT)
    assert "rules/checklist.py" in files and "docs/rules.md" in files
    assert dangling(ROOT, files) == []


def test_a_citation_of_a_missing_file_or_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "rules").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "rules" / "checklist.py").write_text(
        '"""Samples them: vllm_runbook.rules.checklist and rules/checklist.py.\n\n'
        "Rules (see DESIGN.md); the command is vllm_runbook.runbooks.check_cli;\n"
        'the details in docs/gone.md and rules/gone.py."""\n'
        "CheckResult = object\n",
        encoding="utf-8",
    )
    (tmp_path / "docs" / "rules.md").write_text(
        "See [the checklist](../rules/checklist.py), [gone](../rules/gone.py),\n"
        "`rules/checklist.py`, `vllm_runbook.rules.checklist.CheckResult` and\n"
        "rules/gone.py.\n",
        encoding="utf-8",
    )
    (tmp_path / "rules" / "data.json").write_text('"rules/gone.py"', encoding="utf-8")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, timeout=60)
    files = tracked(tmp_path)
    assert files == ["docs/rules.md", "rules/checklist.py"]
    assert dangling(tmp_path, files, allowed=set()) == [
        "docs/rules.md:3: rules/gone.py",
        "rules/checklist.py:3: DESIGN.md",
        "rules/checklist.py:3: vllm_runbook.runbooks.check_cli",
        "rules/checklist.py:4: docs/gone.md",
        "rules/checklist.py:4: rules/gone.py",
    ]
    assert dangling(tmp_path, files, allowed={("docs/rules.md", "rules/gone.py")}) == [
        "rules/checklist.py:3: DESIGN.md",
        "rules/checklist.py:3: vllm_runbook.runbooks.check_cli",
        "rules/checklist.py:4: docs/gone.md",
        "rules/checklist.py:4: rules/gone.py",
    ]
