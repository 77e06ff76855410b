"""`runbook serve [--config FILE] [--host H] [--port P] [--db URL]`: its options.

What it runs (the service assembled from its configuration) is
vllm_runbook.runbooks.service.serve_cli.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_runbook.runbooks.operate.cli.journal import add_catalog_option
from vllm_runbook.runbooks.service.serve_cli import cmd_serve


def add_subcommands(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="Alertmanager webhooks, rule evaluation, remediation")
    p.add_argument("--config", metavar="FILE", help="configuration file (default: built-in)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8080, help="port (default 8080)")
    p.add_argument(
        "--db",
        metavar="URL",
        help="database URL (default: config, RUNBOOK_DB_URL, "
        "then SQLite in the user's data directory)",
    )
    add_catalog_option(p)
    p.add_argument("--no-rules", action="store_true", help="do not run the embedded evaluator")
    p.add_argument(
        "--no-worker",
        action="store_true",
        help="record executions but run none (another replica runs them)",
    )
    p.set_defaults(func=cmd_serve)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port
