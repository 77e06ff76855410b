"""`runbook check`: the seeds' production checklist against one live engine.

The checks themselves (what is measured, the limits, the report) are
vllm_runbook.rules.checklist; this samples the engine's agent (and vLLM's
/metrics with --vllm) over HTTP and maps the outcome to an exit code:
`--soak DURATION` is the reports' long stability check instead: scrapes over
the whole period, and the alert catalog (with the deployment's `--config`
overrides) evaluated on the engine at every scrape, as `runbook serve` does;
any alert that fires fails the soak.

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
    READS,
    CheckResult,
    Samples,
    Scrape,
    as_json,
    format_results,
    parse_exposition,
    run_checklist,
    with_note,
)
from vllm_runbook.rules.config_checks import run_config_checks
from vllm_runbook.runbooks.engine.client import normalize_url
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.cli.errors import UsageError


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


class Soak:
    """The alert catalog evaluated on one engine, as the service does, during a soak."""

    def __init__(self, agent: str, vllm: str | None, config_path: str | None) -> None:
        from vllm_runbook.rules.config import Automation, EngineConfig
        from vllm_runbook.runbooks.model.config import load_config
        from vllm_runbook.runbooks.service.rules_service import RulesService

        config = load_config(config_path)  # CatalogError: one line, file and line
        engine = EngineConfig(name="soak", agent=agent, vllm=vllm)
        # Notify only: the soak watches, it never runs a runbook.
        config = config.model_copy(update={"engines": (engine,), "automation": Automation()})
        self.service = RulesService.from_config(config)
        self.fired: list[tuple[str, float]] = []

    def cycle(self) -> None:
        for event in self.service.run_cycle():
            if event.state == "firing":
                self.fired.append((event.alert, event.at))

    def result(self, started: float) -> CheckResult:
        name, limit = "findings", "none fired"
        if not self.fired:
            return CheckResult(name, limit, "pass", 0.0, "0", "no alert of the catalog fired")
        first: dict[str, float] = {}
        for alert, at in self.fired:
            first.setdefault(alert, at)
        shown = ", ".join(f"{a} at +{at - started:.0f} s" for a, at in first.items())
        return CheckResult(
            name, limit, "fail", float(len(self.fired)), str(len(self.fired)), f"fired: {shown}"
        )


def slim(s: Scrape) -> Scrape:
    """Only the samples a check reads: a day's soak holds thousands of scrapes."""

    def keep(samples: Samples) -> Samples:
        return {name: v for name, v in samples.items() if name in READS}

    return Scrape(s.at, keep(s.agent), keep(s.vllm) if s.vllm is not None else None)


def sample(
    agent: str,
    vllm: str | None,
    *,
    scrapes: int,
    interval: float,
    timeout: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    soak: Soak | None = None,
) -> tuple[AgentState, list[Scrape]]:
    """`scrapes` scrapes `interval` apart. With a `soak`, each is slimmed to what the
    checks read and the rules are evaluated after it, and the state (the workload)
    is read again at the end."""
    with httpx.Client(timeout=timeout) as client:
        state = fetch_state(client, agent)
        model, engine = state.engine.model_name, state.engine.engine
        out = []
        for i in range(scrapes):
            if i:
                sleep(interval)
            taken = scrape(client, agent, vllm, model, engine)
            if soak is not None:
                out.append(slim(taken))
                soak.cycle()
            else:
                out.append(taken)
        if soak is not None:
            state = fetch_state(client, agent)  # the workload over the soak's end
    return state, out


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", help="the production checklist against a live engine")
    p.add_argument("--engine", required=True, metavar="URL", help="engine agent URL")
    p.add_argument("--vllm", metavar="URL", help="vLLM API server URL (latency, finished requests)")
    p.add_argument("--sla-seconds", type=float, default=1.0, help="P99 latency SLA (default 1.0)")
    p.add_argument(
        "--interval",
        type=float,
        default=None,
        help="seconds between scrapes (default 2; with --soak, 15)",
    )
    p.add_argument("--scrapes", type=int, default=None, help="scrapes to take, >= 2 (default 3)")
    p.add_argument(
        "--soak",
        metavar="DURATION",
        help="the reports' stability check over DURATION (e.g. 1h): throughput variation "
        "< 10%% and no alert fired, instead of the few-scrape sample",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="with --soak: the service configuration whose rule overrides apply",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)
    return p


def cmd_check(args: argparse.Namespace) -> int:
    agent = normalize_url(args.engine)  # a malformed URL: CommandRefused (USAGE)
    vllm = normalize_url(args.vllm) if args.vllm else None
    soak_seconds = _soak_seconds(args.soak) if args.soak is not None else None
    interval = args.interval if args.interval is not None else (15.0 if args.soak else 2.0)
    scrapes_n = args.scrapes if args.scrapes is not None else 3
    bad = [
        msg
        for msg, wrong in (
            ("--scrapes must be at least 2", scrapes_n < 2),
            ("--interval must be positive", not interval > 0),
            ("--sla-seconds must be positive", not args.sla_seconds > 0),
            ("--timeout must be positive", not args.timeout > 0),
            (
                "--soak takes its scrapes from DURATION / --interval: drop --scrapes",
                args.soak is not None and args.scrapes is not None,
            ),
            ("--config is read only with --soak", args.config is not None and args.soak is None),
            (
                f"--soak {args.soak} is shorter than --interval {interval:g} s",
                soak_seconds is not None and soak_seconds < interval,
            ),
        )
        if wrong
    ]
    if bad:
        raise UsageError(bad[0])
    soak: Soak | None = None
    started = time.time()
    if soak_seconds is not None:
        soak = Soak(agent, vllm, args.config)
        try:
            state, scrapes = sample(
                agent, vllm, scrapes=max(2, int(soak_seconds // interval) + 1),
                interval=interval, timeout=args.timeout, soak=soak,
            )  # fmt: skip
        finally:
            soak.service.close()
    else:
        state, scrapes = sample(
            agent, vllm, scrapes=scrapes_n, interval=interval, timeout=args.timeout
        )
    model, engine = state.engine.model_name, state.engine.engine
    results = run_checklist(scrapes, model, engine, args.sla_seconds)
    if soak is not None:
        results.append(soak.result(started))
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


def _soak_seconds(text: str) -> float:
    from vllm_runbook.rules.durations import DurationError, parse_duration

    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise UsageError(f"--soak: {exc.message}") from None
    if not seconds > 0:
        raise UsageError(f"--soak {text!r}: must be positive")
    return seconds
