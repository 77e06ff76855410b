"""`runbook tune --engine URL`: the reports' five tuning steps on live traffic, journaled.

The walk itself is vllm_runbook.runbooks.operate.tune. Here: the arguments (a bad one
is one stderr line, exit USAGE), one journal execution (runbook `tune`) under
the engine's lock like `runbook exec`: each change a step whose before-values
are committed before the engine is touched (so `runbook revert ID` undoes a
tune), the baseline as its checks, the whole report as its verification.

Exit codes: OK tuned (or a dry run), FAILED no point met the limits, USAGE
refused (a bad argument, the engine busy), ENGINE the agent unreachable or
lost mid-run, INTERRUPTED Ctrl-C / SIGTERM: what tune changed is restored first.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.argtypes import positive_int, positive_seconds
from vllm_runbook.runbooks.operate.cli.errors import UsageError
from vllm_runbook.runbooks.operate.cli.execute import add_agent_options

TUNE_RUNBOOK = "tune"


class Refused(Exception):
    """A guardrail refused the run before any change."""


def _tune_spec() -> Any:
    """tune as the guardrails see it: no cooldown (a person asked for it), at most
    6 runs per engine and hour, and counted in the blast radius (one engine under
    remediation or tuning at once), like a runbook."""
    from vllm_runbook.runbooks.model.spec import Runbook

    return Runbook.model_validate(
        {
            "name": TUNE_RUNBOOK,
            "description": "the reports' five tuning steps (runbook tune)",
            "steps": [{"action": "advise", "params": {"text": "-"}}],
            "guardrails": {"cooldown_seconds": 0, "max_runs_per_hour": 6},
        }
    )


def add_subcommands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="the reports' five tuning steps on live traffic: baseline, block size, policy, "
        "budget and admission walk, circuit breaker (journaled)",
    )
    p.add_argument("--engine", required=True, metavar="URL", help="engine agent URL")
    p.add_argument(
        "--vllm", metavar="URL", help="the engine's vLLM API server: TTFT from its /metrics"
    )
    p.add_argument(
        "--sla-p99", type=positive_seconds, metavar="S", help="P99 end-to-end latency SLA, seconds"
    )
    p.add_argument(
        "--sla-ttft-p99",
        type=positive_seconds,
        metavar="S",
        help="P99 time-to-first-token SLA, seconds (needs --vllm)",
    )
    p.add_argument(
        "--window",
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="seconds each point is held and measured (default 30)",
    )
    p.add_argument(
        "--max-points",
        type=positive_int,
        default=12,
        metavar="N",
        help="settings measured besides the baseline, at most (default 12)",
    )
    p.add_argument("--dry-run", action="store_true", help="measure and recommend; change nothing")
    p.add_argument(
        "--restore", action="store_true", help="end at the startup values (report the best)"
    )
    p.add_argument(
        "--poll-seconds",
        type=positive_seconds,
        default=0.5,
        metavar="S",
        help="seconds between reads of the agent while a point is held (default 0.5)",
    )
    add_agent_options(p)
    p.set_defaults(func=cmd_tune)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends a tune as Ctrl-C does: restored first


def cmd_tune(args: argparse.Namespace) -> int:
    from vllm_runbook.runbooks.engine.client import CommandRefused, EngineClient, normalize_url
    from vllm_runbook.runbooks.operate.tune import AgentEngine, TuneLimits, Tuner, TuneStopped
    from vllm_runbook.runbooks.run.executor import default_who
    from vllm_runbook.runbooks.run.guardrails import admission, engine_lock, guardrail_refusal
    from vllm_runbook.runbooks.run.outcome import EngineBusy
    from vllm_runbook.runbooks.store import Journal, ensure_schema
    from vllm_runbook.runbooks.store.models import ExecutionStatus

    if args.sla_ttft_p99 is not None and not args.vllm:
        raise UsageError("--sla-ttft-p99 needs --vllm URL: TTFT comes from vLLM's /metrics")
    if args.dry_run and args.restore:
        raise UsageError("--restore has nothing to restore in a --dry-run")
    client = EngineClient(args.engine, args.token, timeout=args.timeout)
    api_url = None
    if args.vllm:
        try:
            api_url = normalize_url(args.vllm)
        except CommandRefused:
            raise UsageError(f"--vllm: not an HTTP URL: {args.vllm!r}") from None
    client.state()  # unreachable or not an agent: ENGINE, before anything is journaled
    limits = TuneLimits(sla_e2e_p99=args.sla_p99, sla_ttft_p99=args.sla_ttft_p99)
    spec = _tune_spec()
    store = Journal(ensure_schema(args.db))
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        record, _ = store.create_execution(
            TUNE_RUNBOOK,
            client.url,
            trigger="cli",
            who=args.who or default_who(),
            dry_run=args.dry_run,
        )
        engine = AgentEngine(
            client,
            api_url,
            journal=store,
            execution_id=record.id,
            poll_seconds=args.poll_seconds,
        )
        tuner = Tuner(
            engine,
            limits,
            window_seconds=args.window,
            max_points=args.max_points,
            dry_run=args.dry_run,
            restore=args.restore,
        )

        def run() -> tuple[dict[str, Any], ExitCode, str | None]:
            refusal = guardrail_refusal(store, spec, client.url, approved=True)
            if not args.dry_run:
                with admission(store, record.id, time.monotonic):
                    refusal = guardrail_refusal(store, spec, client.url, approved=True)
                    if refusal is not None:
                        raise Refused(refusal)
                    store.transition(record.id, ExecutionStatus.RUNNING)
            else:
                store.transition(record.id, ExecutionStatus.RUNNING)
            if refusal is not None:
                tuner.events.append(f"a real run would be refused now: {refusal}")
            try:
                report = tuner.run()
            except TuneStopped as stopped:
                return stopped.report, stopped.code, str(stopped)
            if report["kept_point"] is None and not args.dry_run:
                return report, ExitCode.FAILED, report["outcome"]
            return report, ExitCode.OK, None

        try:
            if args.dry_run:  # like `runbook exec --dry-run`: no lock
                report, code, error = run()
            else:
                with engine_lock(store, client.url, record.id) as renew:
                    engine.renew = renew
                    report, code, error = run()
        except (EngineBusy, Refused) as busy:
            store.transition(record.id, ExecutionStatus.REFUSED, reason=str(busy))
            print(f"runbook: error: {busy}", file=sys.stderr)
            return ExitCode.USAGE
        report["engine"] = client.url
        report["execution_id"] = record.id
        kept = report.get("kept_point")
        points = report["points"]
        store.record_checks(
            record.id,
            {
                "baseline": {
                    "signal": "scheduled_tokens_per_second",
                    "value": points[0]["throughput"],
                }
            }
            if points
            else {},
        )
        store.record_verification(
            record.id,
            {
                "signal": "scheduled_tokens_per_second",
                "before": points[0]["throughput"] if points else None,
                "after": points[kept]["throughput"] if kept is not None else None,
                "outcome": report["outcome"],
                "tune": report,
            },
        )
        if code == ExitCode.OK:
            store.transition(record.id, ExecutionStatus.SUCCEEDED, reason=report["outcome"])
        else:
            store.transition(record.id, ExecutionStatus.FAILED, error)
    finally:
        signal.signal(signal.SIGTERM, previous)
        store.close()
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        from vllm_runbook.runbooks.operate.tune import format_report

        sys.stdout.write(format_report(report))
        print(f"journal: execution #{record.id} (`runbook history {record.id}`)")
    if error is not None:
        print(f"runbook: error: {error}", file=sys.stderr)
    return code
