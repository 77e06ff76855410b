"""`runbook report ID [--db URL] [--signals FILE] [-o FILE]`: one execution, summarised and drawn.

The summary comes from the journal (checks, changes, verification, revert;
for advisory mode's advice, what it would have done beside what happened after);
the picture and the measured effect need the signal history the demo
records beside its SQLite database (see vllm_runbook.runbooks.demo.report). Exit codes: OK;
FAILED no picture (no signal history for that time); USAGE unknown execution;
STORE unavailable (the last two raised, mapped by the CLI's `main`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_runbook.rules.durations import format_duration
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.errors import UsageError
from vllm_runbook.runbooks.operate.cli.journal import add_db_option
from vllm_runbook.runbooks.store import ExecutionRecord
from vllm_runbook.runbooks.store.models import STEP_PLANNED, STEP_SKIPPED

# History drawn around the execution, before its finding and after its revert.
MARGIN_S = 60.0


def add_subcommands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="an execution's summary and timeline picture (PNG) from the journal"
    )
    p.add_argument("id", type=int, help="execution id (a revert's id reports what it reverted)")
    add_db_option(p)
    p.add_argument(
        "--signals",
        metavar="FILE",
        type=Path,
        help="signal history (default: <database>.signals.jsonl beside a SQLite database)",
    )
    p.add_argument(
        "-o", "--output", metavar="FILE", type=Path, help="PNG to write (default: report-ID.png)"
    )
    p.set_defaults(func=cmd_report)


def advice_lines(record: ExecutionRecord) -> list[str]:
    """Advisory mode's advice beside what happened after it: what the service
    would have done (acted, or the refusal it met, and the changes), and
    whether the finding resolved by itself, and when."""
    lines = [f"advisory mode: {(record.reason or '').removeprefix('advisory: ')}"]
    for step in record.steps:
        if step.status == STEP_PLANNED and step.after is not None:
            before = step.before or {}
            change = ", ".join(f"{k} {before.get(k)} → {v}" for k, v in step.after.items())
            condition = (step.params or {}).get("when")
            lines.append(
                f"  would have: {step.action}: {change}"
                + (f" (if {condition})" if condition else "")
            )
        elif step.status == STEP_SKIPPED:
            lines.append(f"  would skip: {step.action} ({(step.params or {}).get('note', '')})")
    advised_at = record.finished_at or record.created_at
    if record.hold_since is not None:
        after = (record.hold_since - advised_at).total_seconds()
        lines.append(
            f"what happened: nothing was changed and the finding resolved by itself at "
            f"{record.hold_since:%Y-%m-%d %H:%M:%SZ}, {format_duration(max(0, round(after)))} "
            f"after the advice"
        )
    else:
        lines.append(
            "what happened: nothing was changed; no resolution of its finding is in the "
            "journal (still firing, or its resolution was not delivered)"
        )
    return lines


def cmd_report(args: argparse.Namespace) -> int:
    from vllm_runbook.runbooks.demo.report import (
        History,
        execution_lines,
        format_phase_table,
        phase_rows,
        reverts_of,
        signals_path_for,
        timeline_png,
        ts,
    )
    from vllm_runbook.runbooks.store import Journal, has_journal

    if not has_journal(args.db):  # read-only: a missing store is no error, and stays missing
        raise UsageError(f"no executions yet (no execution with id {args.id})")
    store = Journal(args.db)
    record = store.get_execution(args.id)
    if record.reverts_id is not None:
        record = store.get_execution(record.reverts_id)
    subject = record.to_dict()
    nearby = [e.to_dict() for e in store.list_executions(record.engine, limit=500)]
    revert = reverts_of(nearby).get(record.id)
    last = revert or subject
    start = ts(subject["created_at"]) or 0.0
    end = ts(last.get("finished_at")) or ts(last["created_at"]) or start
    window = (start - MARGIN_S, end + MARGIN_S)
    shown = [
        e for e in nearby if (t := ts(e["created_at"])) is not None and window[0] <= t <= window[1]
    ]

    path = args.signals or signals_path_for(store.url)
    full = History.load(path, engine=record.engine) if path and path.is_file() else History()
    samples = full.between(*window)
    history = History(samples, full.phases, full.requests) if samples else None
    origin = samples[0]["t"] if samples else None

    print(f"execution #{record.id}: {record.runbook} on {record.engine}")
    spans = {n for n, s, e in full.phase_spans() if e >= window[0] and s <= window[1]}
    rows = [r for r in phase_rows(full) if r["phase"] in spans]
    if rows:
        print()
        for line in format_phase_table(rows):
            print("  " + line)
    print()
    for line in execution_lines(subject, revert, history, origin):
        print("  " + line)
    if record.advised:
        print()
        for line in advice_lines(record):
            print("  " + line)
    if history is None:
        where = path if path is not None else "(none beside a server database: use --signals)"
        print(
            f"\nrunbook: no signal history around execution #{record.id} in {where}: no picture "
            "(`runbook demo` records one; see runbooks/demo/DEMO.md)",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    out = args.output or Path(f"report-{record.id}.png")
    timeline_png(
        history,
        sorted(shown, key=lambda e: e["id"]),
        out,
        title=f"execution #{record.id} {record.runbook} on {record.engine}",
    )
    print(f"\npicture: {out}")
    return ExitCode.OK
