"""The `runbook` command: its parser, assembled from one module per command
group, and its one `main`, where every error becomes one stderr line and an
exit code (the table: vllm_runbook.runbooks.model.exit_codes).

A user's mistake never ends in a traceback; a bug still does. Nor does a
command whose extra is not installed (`pip install vllm-runbook` is the
engine's plugin alone): the command groups, which import the service's
packages, are imported inside `main`, and a missing package is one line
naming the extra (extras.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.extras import needed_extra


def command_groups() -> tuple[Any, ...]:
    """The command groups, in `runbook --help`'s order."""
    from vllm_runbook.runbooks.operate.cli import (
        approvals,
        backtest,
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

    return (
        engines,
        journal,
        execute,
        approvals,
        top,
        rules,
        slo,
        backtest,
        check,
        tune,
        serve,
        report,
        demo,
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (through `main`)
        from vllm_runbook.runbooks.operate.cli.errors import UsageError

        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="runbook", description="vLLM observability and runbook automation")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for group in command_groups():
        group.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `runbook` command; its exit code (an `ExitCode`)."""
    given = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(given)
        return int(args.func(args))
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except Exception as error:
        missing = needed_extra(error, given)
        if missing is not None:
            print(f"runbook: error: {missing}", file=sys.stderr)
            return ExitCode.USAGE
        from vllm_runbook.runbooks.operate.cli.errors import exit_code, message

        code = exit_code(error)
        if code is None:
            raise
        print(f"runbook: error: {message(error)}", file=sys.stderr)
        return code
