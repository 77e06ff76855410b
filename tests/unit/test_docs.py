"""The README and docs/ stay true to the code they document.

Tables that restate code are generated (`python -m tools.docs`, tools/docs.py);
these tests fail while a page is stale, a link dangles, a `make` target or a
benchmark command is gone, or a benchmark table's header is not its script's.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from vllm_runbook.rules import load_catalog as load_rule_catalog
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog

from tools import docs as D

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The page without fenced code blocks (links and headings there are not Markdown)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in _HEADING.finditer(_prose(path.read_text(encoding="utf-8"))):
        slug = _slug(match.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


# --- generated regions ----------------------------------------------------------


def test_generated_regions_are_fresh() -> None:
    stale = D.stale_pages(ROOT)
    assert not stale, f"stale generated docs: {', '.join(stale)}; run `{D.COMMAND}`"


def test_every_generator_has_a_page() -> None:
    used = {
        m.group("name")
        for page in DOCS.glob("*.md")
        for m in D._REGION.finditer(page.read_text(encoding="utf-8"))
    }
    assert used == set(D.GENERATORS)


def test_check_names_a_stale_page_and_the_rewrite_fixes_it(tmp_path: Path) -> None:
    shutil.copytree(DOCS, tmp_path / "docs")
    page = tmp_path / "docs" / "metrics.md"
    text = page.read_text(encoding="utf-8")
    row = "| `vllm_runbook_kv_hit_ratio` | gauge |"
    assert row in text
    page.write_text(text.replace(row, "| `vllm_runbook_kv_hit_ratio_old` | gauge |"))
    assert D.main(["--check", "--root", str(tmp_path)]) == 1
    assert D.stale_pages(tmp_path) == ["docs/metrics.md"]
    assert D.main(["--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == text
    assert D.main(["--check", "--root", str(tmp_path)]) == 0


def test_the_agent_api_schema_is_generated_from_the_models(tmp_path: Path) -> None:
    from vllm_runbook.collector import agent_api

    shutil.copytree(DOCS, tmp_path / "docs")
    schema = tmp_path / "docs" / "agent-api.schema.json"
    published = schema.read_text(encoding="utf-8")
    assert json.loads(published) == agent_api.json_schema()
    schema.write_text(published.replace("Token budget per step.", "Token budget."))
    assert D.main(["--check", "--root", str(tmp_path)]) == 1
    assert D.stale_pages(tmp_path) == ["docs/agent-api.schema.json"]
    assert D.main(["--root", str(tmp_path)]) == 0
    assert schema.read_text(encoding="utf-8") == published
    schema.unlink()  # a missing file is stale too, and written back
    assert D.stale_pages(tmp_path, write=True) == ["docs/agent-api.schema.json"]
    assert schema.read_text(encoding="utf-8") == published


def test_text_outside_the_markers_is_kept() -> None:
    page = "intro\n<!-- BEGIN generated:metrics -->\nSTALE\n<!-- END generated:metrics -->\nafter\n"
    out = D.render(page)
    assert out.startswith("intro\n<!-- BEGIN generated:metrics -->\n| series |")
    assert out.endswith("|\n<!-- END generated:metrics -->\nafter\n")
    assert "STALE" not in out


@pytest.mark.parametrize(
    "page, message",
    [
        ("<!-- BEGIN generated:metrics -->\n", "unpaired generated-region marker"),
        (
            "<!-- BEGIN generated:metrics -->\n<!-- END generated:alerts -->",
            "unpaired generated-region marker",
        ),
        ("<!-- BEGIN generated:nope -->\n<!-- END generated:nope -->", "unknown generated region"),
    ],
)
def test_broken_markers_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], page: str, message: str
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(page)
    assert D.main(["--check", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("docs: error: docs/x.md: ") and message in err
    assert err.count("\n") == 1


def test_missing_docs_folder_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert D.main(["--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"docs: error: no docs/ under {tmp_path}: run from a source checkout or pass --root\n"
    )


def test_cli_reference_has_every_subcommand() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    from vllm_runbook.runbooks.operate.cli import build_parser

    for sub in D._subparsers(build_parser()):
        assert f"### `{sub.prog}`" in text


# --- hand-written notes beside generated tables ----------------------------------


def test_alert_notes_name_exactly_the_catalog() -> None:
    text = (DOCS / "rules.md").read_text(encoding="utf-8")
    noted = re.findall(r"^- \*\*(Vllm\w+)\*\* \((\w+)\):", text, re.MULTILINE)
    catalog = [(s.spec.alert, s.spec.severity) for s in load_rule_catalog().specs]
    assert sorted(noted) == sorted(catalog)


def test_runbook_notes_name_exactly_the_catalog() -> None:
    text = (DOCS / "runbooks.md").read_text(encoding="utf-8")
    noted = re.findall(r"^- \*\*`([a-z0-9-]+)`\*\*:", text, re.MULTILINE)
    assert sorted(noted) == sorted(load_runbook_catalog())


def test_install_page_shows_the_default_port_and_the_entry_point() -> None:
    from vllm_runbook.collector.settings import DEFAULT_PORT

    assert f"`{DEFAULT_PORT}`" in (DOCS / "install.md").read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    entry = re.search(r'^vllm_runbook = "([^"]+)"$', pyproject, re.MULTILINE)
    assert entry is not None and f"`{entry.group(1)}`" in README.read_text(encoding="utf-8")


# --- README: a landing page --------------------------------------------------------


def test_readme_is_a_landing_page_linking_every_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 8 * 1024
    assert "make demo" in text and "make test" in text
    linked = {m.group(1) for m in _LINK.finditer(_prose(text))}
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in linked, page.name


# --- links and make targets ----------------------------------------------------------


def _links() -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), m.group(1))
        for page in PAGES
        for m in _LINK.finditer(_prose(page.read_text(encoding="utf-8")))
        if not re.match(r"[a-z]+:", m.group(1))
    ]


def test_pages_have_relative_links() -> None:
    assert len(_links()) >= 20  # the checks below must have something to check


@pytest.mark.parametrize("page, target", _links())
def test_relative_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (ROOT / page).parent / path if path else ROOT / page
    assert resolved.exists(), f"{page}: {target}: no such file"
    if anchor:
        assert resolved.suffix == ".md", f"{page}: {target}: anchor into a non-page"
        assert anchor in _anchors(resolved), f"{page}: {target}: no such heading"


def test_slug_matches_githubs() -> None:
    assert _slug("End to end, measured") == "end-to-end-measured"
    assert (
        _slug("`runbook serve`: webhooks, embedded rules")
        == "runbook-serve-webhooks-embedded-rules"
    )
    assert _slug("Production checklist: `runbook check`") == "production-checklist-runbook-check"
    assert _slug("Plugin configuration (environment of the vLLM process)") == (
        "plugin-configuration-environment-of-the-vllm-process"
    )


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.MULTILINE))


def test_every_make_command_mentioned_exists() -> None:
    targets = _make_targets()
    assert {"demo", "test", "bench"} <= targets
    # `make X` in inline code, or at the start of a line of a code block
    command = re.compile(r"(?:`|^)make ([a-z][\w-]*)", re.MULTILINE)
    mentioned = {
        (page.name, m.group(1))
        for page in PAGES
        for m in command.finditer(page.read_text(encoding="utf-8"))
    }
    assert ("README.md", "demo") in mentioned
    missing = sorted((page, t) for page, t in mentioned if t not in targets)
    assert not missing, missing


# --- benchmark tables ------------------------------------------------------------------

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _bench_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of docs/benchmarks.md, in order."""
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]


def _bench_commands() -> list[str]:
    return [body.strip() for lang, body in _bench_blocks() if lang == "sh"]


def _script_headers(script: Path) -> list[str]:
    """The module-level header strings the script prints above its rows: HEADER, and
    any NAME_HEADER of a second table (e.g. a mode with other columns)."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    printed = {
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Name)
    }
    assert "HEADER" in printed, f"{script.name} does not print(HEADER)"
    headers = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and (node.targets[0].id == "HEADER" or node.targets[0].id.endswith("_HEADER"))
            and node.targets[0].id in printed
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            headers.append(value)
    assert headers, f"{script.name} has no literal HEADER"
    return headers


def test_each_benchmark_table_sits_under_the_command_that_prints_it() -> None:
    blocks = _bench_blocks()
    tables = 0
    command: str | None = None
    for lang, body in blocks:
        if lang == "sh":
            command = body.strip()
            assert "\n" not in command, command
            continue
        assert lang == "text", f"block without a language in benchmarks.md: {body[:40]!r}"
        assert command is not None, "a benchmark table without a command above it"
        argv = command.split()
        assert argv[0] == "python" and argv[1].startswith("benchmarks/"), command
        script = ROOT / argv[1]
        assert script.is_file(), command
        headers = _script_headers(script)
        assert set(headers) & set(body.splitlines()), f"{command}: no header row of {headers}"
        tables += 1
        command = None  # one table per command
    assert tables == len(_bench_commands()) == 14


def test_make_bench_runs_exactly_the_commands_of_the_page() -> None:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe is not None
    lines = [line.strip().replace("$(PY) ", "python ") for line in recipe.group(1).splitlines()]
    assert lines == _bench_commands()
