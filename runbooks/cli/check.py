"""`runbook check`: the seeds' production checklist against one live engine.

The checks themselves (what is measured, the limits, the report) are
vllm_runbook.rules.checklist; this samples the engine's agent (and vLLM's
/metrics with --vllm) over HTTP and maps the outcome to an exit code:
OK every check passed or n/a, FAILED a check failed; a usage error (USAGE) or
an engine that does not answer as expected (ENGINE) is raised to `main`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import ValidationError
from vllm_runbook.collector.agent_api import AgentState, answer_error
from vllm_runbook.rules.checklist import (
    Samples,
    Scrape,
    as_json,
    format_results,
    parse_exposition,
    run_checklist,
    with_note,
)
from vllm_runbook.rules.config_checks import run_config_checks
from vllm_runbook.runbooks.cli.errors import UsageError
from vllm_runbook.runbooks.engine.client import normalize_url
from vllm_runbook.runbooks.exit_codes import ExitCode, RunbookError


class Unreachable(RunbookError):
    """The agent (or the vLLM server) did not answer as expected."""

    exit_code = ExitCode.ENGINE


def _get(client: httpx.Client, url: str, what: str) -> httpx.Response:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise Unreachable(f"{what} {url} unreachable: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise Unreachable(f"{what} {url} answered HTTP {response.status_code}")
    return response


def fetch_state(client: httpx.Client, agent: str) -> AgentState:
    response = _get(client, agent + "/v1/state", "engine agent")
    try:
        return AgentState.model_validate_json(response.content)
    except ValidationError as exc:
        raise Unreachable(
            f"{agent} is not a vllm-runbook agent (/v1/state: {answer_error(exc)})"
        ) from None


def scrape(client: httpx.Client, agent: str, vllm: str | None, model: str, engine: str) -> Scrape:
    at = time.time()
    match = {"model_name": model, "engine": engine}
    texts = [(agent, "engine agent")] + ([(vllm, "vLLM server")] if vllm else [])
    parsed: list[Samples] = []
    for base, what in texts:
        text = _get(client, base + "/metrics", what).text
        try:
            parsed.append(parse_exposition(text, **match))
        except ValueError as exc:
            raise Unreachable(f"{what} {base}/metrics is not Prometheus text: {exc}") from None
    return Scrape(at, parsed[0], parsed[1] if vllm else None)


def sample(
    agent: str,
    vllm: str | None,
    *,
    scrapes: int,
    interval: float,
    timeout: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[AgentState, list[Scrape]]:
    with httpx.Client(timeout=timeout) as client:
        state = fetch_state(client, agent)
        model, engine = state.engine.model_name, state.engine.engine
        out = []
        for i in range(scrapes):
            if i:
                sleep(interval)
            out.append(scrape(client, agent, vllm, model, engine))
    return state, out


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", help="the production checklist against a live engine")
    p.add_argument("--engine", required=True, metavar="URL", help="engine agent URL")
    p.add_argument("--vllm", metavar="URL", help="vLLM API server URL (latency, finished requests)")
    p.add_argument("--sla-seconds", type=float, default=1.0, help="P99 latency SLA (default 1.0)")
    p.add_argument(
        "--interval", type=float, default=2.0, help="seconds between scrapes (default 2)"
    )
    p.add_argument("--scrapes", type=int, default=3, help="scrapes to take, >= 2 (default 3)")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)
    return p


def cmd_check(args: argparse.Namespace) -> int:
    agent = normalize_url(args.engine)  # a malformed URL: CommandRefused (USAGE)
    vllm = normalize_url(args.vllm) if args.vllm else None
    bad = [
        msg
        for msg, wrong in (
            ("--scrapes must be at least 2", args.scrapes < 2),
            ("--interval must be positive", not args.interval > 0),
            ("--sla-seconds must be positive", not args.sla_seconds > 0),
            ("--timeout must be positive", not args.timeout > 0),
        )
        if wrong
    ]
    if bad:
        raise UsageError(bad[0])
    state, scrapes = sample(
        agent, vllm, scrapes=args.scrapes, interval=args.interval, timeout=args.timeout
    )
    model, engine = state.engine.model_name, state.engine.engine
    results = run_checklist(scrapes, model, engine, args.sla_seconds)
    results += run_config_checks(state)
    if not state.collector_up:
        note = "collector disabled on the engine: its gauges are stale"
        results = [r if r.status == "n/a" else with_note(r, note) for r in results]
    failed = sum(r.status == "fail" for r in results)
    if args.json:
        print(json.dumps(as_json(agent, vllm, model, engine, scrapes, results), indent=2))
    else:
        print(format_results(agent, model, engine, scrapes, results))
    return ExitCode.FAILED if failed else ExitCode.OK
