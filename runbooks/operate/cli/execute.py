"""`runbook exec NAME --engine URL` and `runbook revert ID`: act on an engine, journaled.

The exit code is the execution's (`ExecutionResult.exit_code`: OK, FAILED when
it failed or was rolled back, USAGE when refused, ENGINE); errors before or
around it (a broken catalog, an unknown runbook or id, the store unavailable
or a PostgreSQL store not migrated: `runbook db upgrade`; a SQLite journal is
created on first use) are raised and mapped by the CLI's `main`.

Errors are one line on stderr; the report (checks, before → after,
verification) goes to stdout, or `--json` for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_runbook.runbooks.engine.client import CommandRefused, normalize_url
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.operate.cli.argtypes import non_negative_seconds, positive_seconds
from vllm_runbook.runbooks.operate.cli.journal import add_catalog_option
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.render import render_report
from vllm_runbook.runbooks.store import Journal, ensure_schema


def add_subcommands(subparsers: Any) -> None:
    """Mount `exec` and `revert` on the `runbook` command's subparsers."""
    p = subparsers.add_parser("exec", help="run a runbook against an engine (guarded, journaled)")
    p.add_argument("name", help="runbook name (see `runbook list`)")
    p.add_argument("--engine", required=True, metavar="URL", help="engine agent URL")
    p.add_argument(
        "--vllm",
        metavar="URL",
        help="the engine's vLLM API server, for actions that send requests (warmup)",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")
    p.add_argument("--yes", action="store_true", help="approve a runbook that requires approval")
    p.add_argument(
        "--verify-seconds",
        type=non_negative_seconds,
        metavar="S",
        help="verification deadline (default: the runbook's)",
    )
    p.add_argument(
        "--condition-seconds",
        type=non_negative_seconds,
        metavar="S",
        help="wait before evaluating a step's `when` (default: the runbook's after_seconds)",
    )
    p.add_argument(
        "--poll-seconds",
        type=non_negative_seconds,
        default=1.0,
        metavar="S",
        help="seconds between signal reads while waiting (default 1)",
    )
    _common(p)
    p.set_defaults(func=cmd_exec)

    p = subparsers.add_parser("revert", help="restore the knob values an execution recorded")
    p.add_argument("id", type=int, help="execution id (see `runbook history`)")
    p.add_argument(
        "--stepwise",
        action="store_true",
        help="restore in the runbook's stages, waiting a healthy period between them",
    )
    p.add_argument(
        "--healthy-seconds",
        type=non_negative_seconds,
        metavar="S",
        help="healthy period between stages (default: the runbook's)",
    )
    p.add_argument("--poll-seconds", type=non_negative_seconds, default=1.0, metavar="S")
    _common(p)
    p.set_defaults(func=cmd_revert)


def _common(p: argparse.ArgumentParser) -> None:
    add_agent_options(p)
    add_catalog_option(p)


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that changes an engine through its agent, journaled."""
    p.add_argument("--token", help="agent token (default: VLLM_RUNBOOK_TOKEN or the local one)")
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=35.0,
        metavar="S",
        help="seconds to wait for each answer of the engine's agent (default 35)",
    )
    p.add_argument("--who", help="who is acting (default: the login name)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--db", metavar="URL", help="database URL (default: $RUNBOOK_DB_URL or SQLite)")


def _executor(args: argparse.Namespace, store: Journal) -> Executor:
    from vllm_runbook.runbooks.engine.client import EngineClient
    from vllm_runbook.runbooks.engine.operations import engine_registry

    registry = engine_registry()
    catalog = load_catalog(args.catalog, registry=registry)
    token, timeout = args.token, args.timeout
    api_urls = {}
    if getattr(args, "vllm", None):
        api_urls[normalize_url(args.engine)] = _api_url(args.vllm)
    return Executor(
        store,
        catalog,
        registry,
        client_factory=lambda url: EngineClient(url, token, timeout=timeout),
        poll_seconds=args.poll_seconds or 0.05,
        api_urls=api_urls,
    )


def _api_url(url: str) -> str:
    try:
        return normalize_url(url)
    except CommandRefused:
        raise CommandRefused(f"--vllm: not an HTTP URL: {url!r}") from None


def _output(args: argparse.Namespace, result: ExecutionResult) -> int:
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(render_report(result.record))
        for warning in result.warnings:
            print(f"warning: {warning}")
    if result.exit_code != ExitCode.OK and result.message:
        print(f"runbook: error: {result.message}", file=sys.stderr)
    return result.exit_code


def _run(args: argparse.Namespace, body: Any) -> int:
    """Open the store, run `body(executor)`, report; errors are raised to `main`."""
    # First use: the default SQLite journal is created and migrated here.
    store = Journal(ensure_schema(args.db))
    try:
        return _output(args, body(_executor(args, store)))
    finally:
        store.close()


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a runbook against one engine."""
    return _run(
        args,
        lambda x: x.execute(
            args.name,
            args.engine,
            trigger="cli",
            who=args.who,
            dry_run=args.dry_run,
            approved=args.yes,
            verify_seconds=args.verify_seconds,
            condition_seconds=args.condition_seconds,
        ),
    )


def cmd_revert(args: argparse.Namespace) -> int:
    """Restore what an execution changed."""
    return _run(
        args,
        lambda x: x.revert(
            args.id,
            who=args.who,
            stepwise=args.stepwise,
            healthy_period_seconds=args.healthy_seconds,
        ),
    )
