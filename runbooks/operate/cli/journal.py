"""`runbook db upgrade`, `history`, `list` and `show`: the journal and the catalog.

Each handler returns an exit code or raises: the store's, the catalog's and
the engine client's errors carry theirs (an unknown execution id or runbook:
USAGE; a broken catalog: USAGE, one line per problem as file:line; the store
down, locked, not migrated or not a database: STORE; `show --engine` on an
engine unreachable: ENGINE), mapped by the CLI's `main`.

Human output is aligned tables; `--json` output is stable for scripts (keys
are only ever added).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import Catalog, Runbook, load_catalog
from vllm_runbook.runbooks.operate.cli.argtypes import positive_int
from vllm_runbook.runbooks.operate.cli.errors import UsageError
from vllm_runbook.runbooks.run.render import format_table, format_value, render_report
from vllm_runbook.runbooks.store import (
    ExecutionRecord,
    Journal,
    display_url,
    has_journal,
    head_revision,
    resolve_url,
    upgrade,
)
from vllm_runbook.runbooks.store.notifications import NotificationRecord


def add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        metavar="URL",
        help="database URL (default: $RUNBOOK_DB_URL, else a SQLite file in the data directory)",
    )


def add_catalog_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--catalog",
        metavar="DIR",
        type=Path,
        action="append",
        help="load runbooks from DIR instead of the shipped catalog (repeatable)",
    )


def add_subcommands(subparsers: Any) -> None:
    """Mount `db`, `history`, `list` and `show` on the `runbook` command's subparsers."""
    db = subparsers.add_parser("db", help="manage the journal database")
    db_commands = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    db_upgrade = db_commands.add_parser("upgrade", help="create or migrate the schema to head")
    add_db_option(db_upgrade)
    db_upgrade.set_defaults(func=cmd_db_upgrade)

    history = subparsers.add_parser("history", help="past executions, newest first")
    history.add_argument("id", nargs="?", type=int, help="show one execution in full")
    history.add_argument("--engine", metavar="URL", help="only executions on this engine")
    history.add_argument("--runbook", metavar="NAME", help="only executions of this runbook")
    history.add_argument("--limit", type=positive_int, default=20, help="at most N (default 20)")
    history.add_argument("--json", action="store_true", help="machine-readable output")
    add_db_option(history)
    history.set_defaults(func=cmd_history)

    list_parser = subparsers.add_parser("list", help="the runbook catalog")
    list_parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_catalog_option(list_parser)
    list_parser.set_defaults(func=cmd_list)

    show = subparsers.add_parser("show", help="one runbook: triggers, checks, steps, guardrails")
    show.add_argument("name", help="runbook name (see `runbook list`)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument(
        "--engine",
        metavar="URL",
        help="also read each check, verification signal and guard on this engine's agent",
    )
    show.add_argument(
        "--vllm", metavar="URL", help="the engine's vLLM API server (what only it knows)"
    )
    show.add_argument("--token", help="agent token (default: VLLM_RUNBOOK_TOKEN or the local one)")
    add_catalog_option(show)
    show.set_defaults(func=cmd_show)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False))


# --- db upgrade ------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Create or migrate the journal schema to the newest revision."""
    url = resolve_url(args.db)
    revision = upgrade(url)
    print(f"{display_url(url)}: at revision {revision} (head {head_revision()})")
    return ExitCode.OK


# --- history ---------------------------------------------------------------------


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")


def cmd_history(args: argparse.Namespace) -> int:
    """Executions from the journal; with an id, that execution's full report."""
    if not has_journal(args.db):  # read-only: a missing store is no error, and stays missing
        if args.id is not None:
            raise UsageError(f"no executions yet (no execution with id {args.id})")
        if args.json:
            _print_json({"executions": []})
        else:
            print("no executions yet")
        return ExitCode.OK
    store = Journal(args.db)
    try:
        if args.id is not None:
            record = store.get_execution(args.id)
            sent = store.notifications([record.id]).get(record.id, [])
            if args.json:
                _print_json(
                    {"execution": record.to_dict(), "notifications": [n.to_dict() for n in sent]}
                )
            else:
                sys.stdout.write(render_report(record) + _notifications_text(sent))
            return ExitCode.OK
        records = store.list_executions(args.engine, runbook=args.runbook, limit=args.limit)
        failed = store.notifications([r.id for r in records], status="failed")
    finally:
        store.close()
    if args.json:
        _print_json({"executions": [r.to_dict() for r in records]})
        return ExitCode.OK
    if not records:
        print("no executions recorded")
        return ExitCode.OK
    rows = [
        (
            r.id,
            r.runbook,
            r.engine,
            r.display_status + (" (dry run)" if r.dry_run and not r.advised else ""),
            r.trigger,
            r.who,
            _when(r.started_at or r.created_at),
            f"{sum(s.status == 'applied' for s in r.steps)}/{len(r.steps)}",
            _note(r, failed.get(r.id, [])),
        )
        for r in records
    ]
    headers = ["ID", "RUNBOOK", "ENGINE", "STATUS", "TRIGGER", "WHO", "STARTED", "APPLIED", "NOTE"]
    print(format_table(rows, headers))
    return ExitCode.OK


def _note(record: ExecutionRecord, failed: list[NotificationRecord]) -> str:
    note = record.error or record.reason or ""
    if failed:
        receivers = sorted({n.receiver for n in failed})
        note += ("; " if note else "") + f"notification failed: {', '.join(receivers)}"
    return note


def _notifications_text(sent: list[NotificationRecord]) -> str:
    """The report's tail: each event sent to each receiver, and the failures' reasons."""
    if not sent:
        return ""
    lines = ["", "Notifications"]
    for n in sent:
        error = f" ({n.last_error})" if n.last_error else ""
        lines.append(f"  {n.event} → {n.receiver}: {n.status}{error}")
    return "\n".join(lines) + "\n"


# --- catalog ---------------------------------------------------------------------


def _catalog(args: argparse.Namespace) -> Catalog:
    return load_catalog(args.catalog)


def _runbook_json(runbook: Runbook, catalog: Catalog) -> dict[str, Any]:
    data = runbook.model_dump(mode="json")
    data["source"] = str(catalog.sources[runbook.name])
    return data


def cmd_list(args: argparse.Namespace) -> int:
    """The catalog: one line per runbook."""
    catalog = _catalog(args)
    if args.json:
        _print_json({"runbooks": [_runbook_json(r, catalog) for r in catalog.values()]})
        return ExitCode.OK
    rows = [
        (
            r.name,
            ", ".join(r.triggers) or "(manual)",
            " → ".join(s.action for s in r.steps),
            "yes" if r.guardrails.requires_approval else "no",
        )
        for r in catalog.values()
    ]
    print(format_table(rows, ["NAME", "TRIGGERS", "STEPS", "APPROVAL"]))
    return ExitCode.OK


def cmd_show(args: argparse.Namespace) -> int:
    """One runbook: what it checks, what it changes, how it verifies and reverts."""
    catalog = _catalog(args)
    runbook = catalog.get(args.name)
    if runbook is None:
        known = ", ".join(catalog) or "none"
        raise UsageError(f"unknown runbook {args.name!r} (known: {known})")
    live = None
    if getattr(args, "engine", None):
        live = _live_readings(runbook, args.engine, args.vllm, args.token)
    if args.json:
        data: dict[str, Any] = {"runbook": _runbook_json(runbook, catalog)}
        if live is not None:
            data["live"] = live
        _print_json(data)
        return ExitCode.OK
    print(_describe(runbook))
    if live is not None:
        print("\n" + _describe_live(live))
    return ExitCode.OK


def _live_readings(
    runbook: Runbook, engine: str, vllm: str | None, token: str | None
) -> dict[str, Any]:
    """Each check, verification signal and guard read on the engine now: its
    value, source and window, or why it cannot be read."""
    from vllm_runbook.runbooks.engine.client import EngineClient, normalize_url
    from vllm_runbook.runbooks.engine.operations import SignalReader
    from vllm_runbook.runbooks.engine.sources import SOURCES, runbook_readings

    client = EngineClient(engine, token, timeout=35.0)
    reader = SignalReader(client, api_url=normalize_url(vllm) if vllm else None)
    signals = reader.read()
    readings = []
    for role, name, signal in runbook_readings(runbook):
        source = SOURCES[signal]
        row: dict[str, Any] = {
            "role": role,
            "name": name,
            "signal": signal,
            "value": signals.get(signal),
            "source": source.source,
            "window": source.window,
        }
        if row["value"] is None:
            row["unavailable"] = reader.unavailable.get(signal, "not read")
        readings.append(row)
    step = None if reader.last_state is None else reader.last_state.engine.step
    return {"engine": client.url, "vllm": reader.api_url, "step": step, "readings": readings}


def _describe_live(live: dict[str, Any]) -> str:
    from vllm_runbook.runbooks.run.render import format_signal

    rows = [
        (
            r["role"],
            r["name"] if r["name"] == r["signal"] else f"{r['name']} ({r['signal']})",
            format_signal(r["signal"], r["value"])
            if r["value"] is not None
            else f"unavailable: {r['unavailable']}",
            r["source"],
            r["window"],
        )
        for r in live["readings"]
    ]
    head = f"On {live['engine']} now (step {live['step']})"
    table = format_table(rows, ["reading", "name", "value", "source", "window"])
    return head + "\n" + _indent(table)


def _describe(runbook: Runbook) -> str:
    lines = [f"{runbook.name}: {runbook.description}", ""]
    lines.append(f"Triggers: {', '.join(runbook.triggers) or '(manual only)'}")
    lines += ["", "Checks"]
    from vllm_runbook.runbooks.engine.sources import SOURCES as _SOURCES

    check_rows = [
        (c.name, c.signal, c.description, _SOURCES[c.signal].source) for c in runbook.checks
    ]
    lines.append(_indent(format_table(check_rows, ["check", "signal", "description", "source"])))
    lines += ["", "Steps"]
    step_rows = [
        (
            i,
            s.action,
            ", ".join(f"{k}={format_value(v)}" for k, v in s.params.items()) or "-",
            _condition(s.when),
            s.description or "",
        )
        for i, s in enumerate(runbook.steps, 1)
    ]
    lines.append(_indent(format_table(step_rows, ["#", "action", "params", "when", "description"])))
    lines += ["", "Verification"]
    v = runbook.verification
    if v is None:
        lines.append("  none (advice / diagnostics only)")
    else:
        from vllm_runbook.runbooks.engine.sources import SOURCES
        from vllm_runbook.runbooks.run.verification import needed_text

        lines.append(
            f"  {needed_text(v.signal, v)}, measured after the change took effect, "
            f"within {v.deadline_seconds} s"
        )
        if v.rollback_if_worse:
            guards = [
                g + (" (required)" if g in v.required_guards else "") for g in v.rollback_if_worse
            ]
            lines.append(f"  roll back if worse: {', '.join(guards)}")
        for name in (v.signal, *v.rollback_if_worse):
            source = SOURCES[name]
            lines.append(f"  {name}: {source.source}; {source.window}")
    r, g = runbook.revert, runbook.guardrails
    lines += ["", "Revert"]
    lines.append(f"  on resolve: {format_value(r.on_resolve)}")
    if r.on_resolve:
        cause = " and ".join(_condition(c) for c in r.until)
        lines.append(
            f"  holds {r.hold_seconds} s after the alert resolved"
            + (f", with {cause} on end" if cause else "")
        )
    if r.stepwise:
        stages = " → ".join(f"{f:.0%}" for f in r.stepwise)
        lines.append(f"  stepwise: {stages}, each after {r.healthy_period_seconds} s healthy")
    lines += ["", "Guardrails"]
    lines.append(
        f"  cooldown {g.cooldown_seconds} s, at most {g.max_runs_per_hour} runs/hour, "
        f"at most {g.max_concurrent_engines} engine(s) at once, "
        f"approval {'required' if g.requires_approval else 'not required'}"
    )
    return "\n".join(lines)


def _condition(when: Any) -> str:
    if when is None:
        return "always"
    op, bound = (">", when.above) if when.above is not None else ("<", when.below)
    wait = f" after {when.after_seconds} s" if when.after_seconds else ""
    return f"{when.signal} {op} {format_value(bound)}{wait}"


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())
