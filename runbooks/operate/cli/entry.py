"""The `runbook` command: its parser, assembled from one module per command
group, and its one `main`, where every error becomes one stderr line and an
exit code (the table: vllm_runbook.runbooks.model.exit_codes).

A user's mistake never ends in a traceback; a bug still does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli import (
    approvals,
    check,
    demo,
    engines,
    execute,
    journal,
    report,
    rules,
    serve,
    slo,
    top,
    tune,
)
from vllm_runbook.runbooks.operate.cli.errors import UsageError, exit_code, message

# In `runbook --help`'s order.
COMMAND_GROUPS: tuple[Any, ...] = (
    engines,
    journal,
    execute,
    approvals,
    top,
    rules,
    slo,
    check,
    tune,
    serve,
    report,
    demo,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (through `main`)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="runbook", description="vLLM observability and runbook automation")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for group in COMMAND_GROUPS:
        group.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `runbook` command; its exit code (an `ExitCode`)."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except Exception as error:
        code = exit_code(error)
        if code is None:
            raise
        print(f"runbook: error: {message(error)}", file=sys.stderr)
        return code
