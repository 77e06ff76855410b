"""CLI for approvals: `runbook pending`, `runbook approve ID`, `runbook reject ID`.

An `approve`-mode runbook's execution waits in the journal until a person
answers. Approving records who, when and why and leaves the run to the
service's worker (it holds the engine inventory, the waits and the lease that
makes one replica run it); rejecting refuses it. Both work on the journal
alone, so any machine that reaches the database can answer.

Exit codes: OK decided; FAILED too late (expired, the alert resolved,
already answered); USAGE (unknown id, not an execution awaiting approval, bad
config); STORE unavailable (raised, mapped by the CLI's `main`).
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timedelta
from typing import Any

from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.runbooks.model.config import DEFAULT_APPROVAL_TIMEOUT, load_config
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.cli.errors import UsageError
from vllm_runbook.runbooks.operate.cli.journal import add_db_option
from vllm_runbook.runbooks.run.executor import default_who, format_duration
from vllm_runbook.runbooks.run.render import format_table
from vllm_runbook.runbooks.store import Journal, has_journal
from vllm_runbook.runbooks.store.approvals import TOO_LATE
from vllm_runbook.runbooks.store.models import ApprovalState, utcnow


class TooLate(RunbookError):
    """The execution is no longer awaiting this answer (expired, resolved, already decided)."""

    exit_code = ExitCode.FAILED


def add_subcommands(subparsers: Any) -> None:
    p = subparsers.add_parser("pending", help="executions awaiting approval")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _common(p)
    p.set_defaults(func=cmd_pending)
    for verb, helptext in (
        ("approve", "approve an execution awaiting approval (the service runs it)"),
        ("reject", "reject an execution awaiting approval (nothing runs)"),
    ):
        p = subparsers.add_parser(verb, help=helptext)
        p.add_argument("id", type=int, help="execution id (see `runbook pending`)")
        p.add_argument("--note", help="why (kept in the journal)")
        p.add_argument("--by", metavar="NAME", help="who decides (default: the login name)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        _common(p)
        p.set_defaults(func=cmd_approve if verb == "approve" else cmd_reject)


def _common(p: argparse.ArgumentParser) -> None:
    add_db_option(p)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the service's configuration (its database and approvals.timeout)",
    )


class _Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        config = load_config(args.config) if args.config else None
        self.timeout_s = config.approvals.timeout_seconds if config else DEFAULT_APPROVAL_TIMEOUT
        self.db = args.db or (config.database if config else None)


def _setup(args: argparse.Namespace) -> _Setup:
    try:
        return _Setup(args)
    except CatalogError as exc:  # a broken configuration: its first problem is enough here
        raise UsageError(str(exc).splitlines()[0]) from None


def _expires(created: datetime, timeout_s: float) -> str:
    left = (created + timedelta(seconds=timeout_s) - utcnow()).total_seconds()
    return format_duration(math.ceil(left)) if left > 0 else "expired"


def cmd_pending(args: argparse.Namespace) -> int:
    setup = _setup(args)
    if not has_journal(setup.db):  # read-only: a missing store is no error, and stays missing
        if args.json:
            print(json.dumps({"pending": []}, indent=2))
        else:
            print("no executions awaiting approval (no journal yet)")
        return ExitCode.OK
    store = Journal(setup.db)
    try:
        records = store.pending_approvals()
    finally:
        store.close()
    if args.json:
        rows = [
            {
                **r.to_dict(),
                "expires_at": (r.created_at + timedelta(seconds=setup.timeout_s)).isoformat(),
            }
            for r in records
        ]
        print(json.dumps({"pending": rows}, indent=2, ensure_ascii=False))
        return ExitCode.OK
    if not records:
        print("no executions awaiting approval")
        return ExitCode.OK
    table = [
        (
            r.id,
            r.runbook,
            r.engine,
            r.who,
            r.created_at.strftime("%Y-%m-%d %H:%M:%SZ"),
            _expires(r.created_at, setup.timeout_s),
        )
        for r in records
    ]
    print(format_table(table, ["ID", "RUNBOOK", "ENGINE", "FROM", "SINCE", "EXPIRES IN"]))
    return ExitCode.OK


def _decide(args: argparse.Namespace, decision: str) -> int:
    setup = _setup(args)
    if not has_journal(setup.db):  # nothing to decide, and nothing created by asking
        raise UsageError(f"no executions yet (no execution with id {args.id})")
    store = Journal(setup.db)
    try:
        result = store.decide(
            args.id, decision, args.by or default_who(), args.note, timeout_s=setup.timeout_s
        )
    finally:
        store.close()
    if args.json:
        out = {"outcome": result.outcome, "message": result.message}
        print(json.dumps({**out, "execution": result.record.to_dict()}, indent=2))
    if result.ok:
        if not args.json:
            print(result.message)
        return ExitCode.OK
    if result.outcome == TOO_LATE:
        raise TooLate(result.message)
    raise UsageError(result.message)


def cmd_approve(args: argparse.Namespace) -> int:
    return _decide(args, ApprovalState.APPROVED)


def cmd_reject(args: argparse.Namespace) -> int:
    return _decide(args, ApprovalState.REJECTED)
