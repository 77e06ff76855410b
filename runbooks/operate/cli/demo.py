"""`runbook demo [--ci] [--dir DIR]`: its options and its ends (the story: runbooks.demo)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_runbook.runbooks.demo import DESCRIPTION
from vllm_runbook.runbooks.model.exit_codes import ExitCode


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (CI cancelling, `timeout`) unwinds like Ctrl-C: every process is stopped."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_subcommands(subparsers: Any) -> None:
    """`runbook demo [--ci] [--dir DIR]`."""
    p = subparsers.add_parser("demo", help=DESCRIPTION, description=DESCRIPTION)
    p.add_argument(
        "--ci",
        action="store_true",
        help="plain output (also when CI=true or stdout is not a terminal)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("RUNBOOK_DEMO_DIR", ".demo")),
        help="working directory: model, database, logs, picture (default .demo)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """OK the story happened, FAILED it did not, USAGE it could not start, INTERRUPTED.

    The demo tells its story on stdout, so its ends are told there too."""
    # The story's modules (httpx, asyncio, matplotlib later) load only when it runs.
    from vllm_runbook.runbooks.demo.story import DemoFailed, run

    ci = args.ci or os.environ.get("CI", "").lower() in ("1", "true") or not sys.stdout.isatty()
    try:
        with _terminate_as_interrupt():
            return run(args.dir, ci)
    except KeyboardInterrupt:
        print("\ndemo: interrupted; every process it started is stopped", flush=True)
        return ExitCode.INTERRUPTED
    except DemoFailed as exc:
        print(f"demo: could not start: {exc}", flush=True)
        return ExitCode.USAGE
