"""`runbook top`: a live terminal view of engines, findings and executions.

Straight from the agents (`--engine URL`, repeatable: their /v1/state, the
embedded evaluator's findings over their /metrics, and the journal's
executions, as `runbook pending` reads it), or from the service's API
(`--server URL`). `a` / `r` approve or reject the selected execution awaiting
approval, after a confirmation: in the journal as `runbook approve` does, or
through the service with the webhook's credentials.

Before the view opens every engine (or the service) must answer: an error is
one line and an exit code (ENGINE, SERVICE, USAGE); an engine that stops
answering later shows as DOWN, and a refresh that fails keeps the last view.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.argtypes import positive_seconds
from vllm_runbook.runbooks.operate.cli.engines import engine_urls
from vllm_runbook.runbooks.operate.cli.errors import UsageError
from vllm_runbook.runbooks.operate.cli.journal import add_db_option

DEFAULT_INTERVAL = 2.0
DEFAULT_TIMEOUT = 5.0


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("top", help="live view: engines, firing findings, executions; approve")
    p.add_argument("--engine", action="append", metavar="URL", help="engine agent URL (repeatable)")
    p.add_argument(
        "--engines-file",
        metavar="FILE",
        help="file of engine URLs (one per line) or the YAML config",
    )
    p.add_argument(
        "--server", metavar="URL", help="read `runbook serve`'s API instead of the agents"
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="with --server: the webhook's bearer token, to approve and reject "
        "(default: --config's webhook credentials, RUNBOOK_WEBHOOK_TOKEN, or the token "
        "a local service generated)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the service's configuration: its rules, its database and approvals.timeout "
        "(with --engine), its webhook credentials (with --server)",
    )
    add_db_option(p)
    p.add_argument(
        "--by", metavar="NAME", help="with --engine: who answers (default: the login name)"
    )
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=DEFAULT_INTERVAL,
        metavar="S",
        help=f"seconds between refreshes (default {DEFAULT_INTERVAL:g})",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds to wait for each answer (default {DEFAULT_TIMEOUT:g})",
    )
    p.set_defaults(func=cmd_top)


def build_source(args: argparse.Namespace) -> Any:
    """The source the options name, checked: every engine or the service answers now."""
    from vllm_runbook.runbooks.model.config import load_config
    from vllm_runbook.runbooks.operate.top.sources import (
        AgentSource,
        ServerSource,
        server_authorization,
    )
    from vllm_runbook.runbooks.run.executor import default_who

    if args.server and (args.engine or args.engines_file):
        raise UsageError("give --server URL or --engine URL, not both")
    if args.token_file and not args.server:
        raise UsageError("--token-file is the service's: give it with --server URL")
    try:
        config = load_config(args.config) if args.config else None
    except CatalogError as exc:  # a broken configuration: its first problem is enough here
        raise UsageError(str(exc).splitlines()[0]) from None
    source: Any
    if args.server:
        authorization = server_authorization(args.server, token_file=args.token_file, config=config)
        source = ServerSource(args.server, authorization, timeout=args.timeout)
    else:
        source = AgentSource(
            engine_urls(args),
            timeout=args.timeout,
            config=config,
            journal=True,
            journal_url=args.db or (config.database if config else None),
            who=args.by or default_who(),
        )
    try:
        source.check()
    except BaseException:
        source.close()
        raise
    return source


def cmd_top(args: argparse.Namespace) -> int:
    from vllm_runbook.runbooks.operate.top.app import TopApp

    source = build_source(args)
    try:
        first = source.snapshot()
        # The scraper's and the store's log lines would draw over the view.
        logging.getLogger().handlers[:] = [logging.NullHandler()]
        logging.getLogger().setLevel(logging.CRITICAL)
        TopApp(source, args.interval, first).run()
    finally:
        source.close()
    return ExitCode.OK
