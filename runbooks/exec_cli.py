"""CLI pieces for acting on engines: `runbook exec NAME --engine URL` and `runbook revert ID`.

Mounted by `vllm_runbook.runbooks.cli` with `add_subcommands(subparsers)`. Exit codes:

    0  succeeded (or a dry run)
    1  the execution failed or was rolled back (the journal says why)
    2  usage, a broken runbook catalog, the engine's bounds, or a guardrail refusal
    3  engine unreachable or authentication failed
    4  store unavailable (down, locked, or a PostgreSQL store not migrated: run
       `runbook db upgrade`; a SQLite journal is created on first use)

Errors are one line on stderr; the report (checks, before → after,
verification) goes to stdout, or `--json` for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Final

from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.runbooks.client import CommandRefused, EngineClientError, normalize_url
from vllm_runbook.runbooks.executor import (
    EXIT_REFUSED,
    EXIT_STORE,
    ExecutionResult,
    Executor,
    UnknownRunbook,
)
from vllm_runbook.runbooks.render import render_report
from vllm_runbook.runbooks.revert import RevertRefused
from vllm_runbook.runbooks.spec import load_catalog
from vllm_runbook.runbooks.store import (
    ExecutionNotFound,
    Store,
    StoreError,
    StoreUnavailable,
    ensure_schema,
)

EXIT_STORE_ERROR: Final = 1


def _fail(code: int, message: str) -> int:
    print(f"runbook: error: {message}", file=sys.stderr)
    return code


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be > 0")
    return value


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
        type=_non_negative,
        metavar="S",
        help="verification deadline (default: the runbook's)",
    )
    p.add_argument(
        "--condition-seconds",
        type=_non_negative,
        metavar="S",
        help="wait before evaluating a step's `when` (default: the runbook's after_seconds)",
    )
    p.add_argument(
        "--poll-seconds",
        type=_non_negative,
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
        type=_non_negative,
        metavar="S",
        help="healthy period between stages (default: the runbook's)",
    )
    p.add_argument("--poll-seconds", type=_non_negative, default=1.0, metavar="S")
    _common(p)
    p.set_defaults(func=cmd_revert)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", help="agent token (default: VLLM_RUNBOOK_TOKEN or the local one)")
    p.add_argument(
        "--timeout",
        type=_positive,
        default=35.0,
        metavar="S",
        help="seconds to wait for each answer of the engine's agent (default 35)",
    )
    p.add_argument("--who", help="who is acting (default: the login name)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--db", metavar="URL", help="database URL (default: $RUNBOOK_DB_URL or SQLite)")
    p.add_argument(
        "--catalog",
        metavar="DIR",
        type=Path,
        action="append",
        help="load runbooks from DIR instead of the shipped catalog (repeatable)",
    )


def _executor(args: argparse.Namespace, store: Store) -> Executor:
    from vllm_runbook.runbooks.client import EngineClient
    from vllm_runbook.runbooks.engine_actions import engine_registry

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
    if result.exit_code != 0 and result.message:
        print(f"runbook: error: {result.message}", file=sys.stderr)
    return result.exit_code


def _run(args: argparse.Namespace, body: Any) -> int:
    """Open the store, run `body(executor)`, map every error to one line and a code."""
    try:
        # First use: the default SQLite journal is created and migrated here.
        store = Store(ensure_schema(args.db))
    except StoreUnavailable as e:
        return _fail(EXIT_STORE, str(e))
    except StoreError as e:
        return _fail(EXIT_STORE_ERROR, str(e))
    try:
        executor = _executor(args, store)
        return _output(args, body(executor))
    except CatalogError as e:
        # One line per problem, each naming its file and line.
        return _fail(EXIT_REFUSED, f"invalid runbook catalog: {e}")
    except StoreUnavailable as e:
        return _fail(EXIT_STORE, str(e))
    except ExecutionNotFound as e:
        return _fail(EXIT_REFUSED, str(e))
    except StoreError as e:
        return _fail(EXIT_STORE_ERROR, str(e))
    except (UnknownRunbook, RevertRefused) as e:
        return _fail(EXIT_REFUSED, str(e))
    except CommandRefused as e:
        return _fail(EXIT_REFUSED, str(e))
    except EngineClientError as e:
        return _fail(e.exit_code, str(e))
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
