"""`runbook slo`: each SLO of the configuration, per engine: its error budget left and burn rates.

The error ratios come from Prometheus (`--prometheus URL`), computed there by
the same expressions the exported recording rules hold
(vllm_runbook.rules.slo.error_ratio), so the table needs no recording rule
installed; the SLO's window (30 d by default) is longer than what the embedded
evaluator keeps. A pair is shown as firing when both its windows burn above
its factor, as both backends decide. Exit codes: OK; USAGE for a bad
argument or configuration (also: no `slos:`); FAILED when Prometheus does not
answer or refuses the query.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import httpx
from vllm_runbook.rules.promql import PromQLRenderer
from vllm_runbook.rules.signals import ENGINE_LABELS
from vllm_runbook.rules.slo import (
    SloSpec,
    SloStatus,
    alert_name,
    error_ratio,
    span,
    windows,
)
from vllm_runbook.runbooks.model.catalogs import runbook_names
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.cli.errors import UsageError


class PrometheusError(RunbookError):
    """Prometheus did not answer the query, or refused it."""

    exit_code = ExitCode.FAILED


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "slo", help="SLOs per engine: error budget left, burn rates, firing burn-rate alerts"
    )
    p.add_argument("--config", type=Path, default=None, help="configuration file with slos:")
    p.add_argument(
        "--prometheus",
        metavar="URL",
        required=True,
        help="Prometheus that scrapes the engines' vLLM /metrics (its HTTP API)",
    )
    p.add_argument(
        "--time",
        type=float,
        default=None,
        metavar="UNIX_SECONDS",
        help="evaluate at this time (default: now)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per query (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    p.set_defaults(func=cmd_slo)
    return p


def _url(text: str) -> str:
    parts = httpx.URL(text) if "://" in text else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.host:
        raise UsageError(f"--prometheus must be an http(s) URL, got {text!r}")
    return text.rstrip("/")


def query(url: str, expr: str, at: float | None, timeout: float) -> list[dict[str, Any]]:
    """An instant query's vector; PrometheusError when it cannot be had."""
    params: dict[str, str] = {"query": expr}
    if at is not None:
        params["time"] = repr(at)
    try:
        response = httpx.get(f"{url}/api/v1/query", params=params, timeout=timeout)
        answer = response.json()
    except httpx.HTTPError as exc:
        raise PrometheusError(f"Prometheus at {url} did not answer: {exc}") from None
    except ValueError:
        raise PrometheusError(
            f"{url} answered HTTP {response.status_code}, not as Prometheus' API does"
        ) from None
    if answer.get("status") != "success":
        raise PrometheusError(f"Prometheus refused the query: {answer.get('error', answer)}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def statuses(
    slos: tuple[SloSpec, ...], url: str, at: float | None, timeout: float
) -> list[SloStatus]:
    render = PromQLRenderer(ENGINE_LABELS)
    out: list[SloStatus] = []
    for slo in slos:
        by_engine: dict[tuple[str, ...], dict[float, float | None]] = {}
        needed = sorted({*windows(slo.window), slo.window})
        for window in needed:
            for sample in query(url, render.expr(error_ratio(slo, window)), at, timeout):
                key = tuple(sample["metric"].get(k, "") for k in ENGINE_LABELS)
                value = float(sample["value"][1])
                by_engine.setdefault(key, {})[window] = None if math.isnan(value) else value
        for key in sorted(by_engine):
            ratios = {w: by_engine[key].get(w) for w in needed}
            out.append(SloStatus(slo, dict(zip(ENGINE_LABELS, key, strict=True)), ratios))
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[SloStatus]) -> str:
    # The burn rate over each pair's long window (scaled to the SLO's window): named
    # by the window when every SLO shown has the same ones, else by the pair.
    longs = {tuple(p.long for p in row.slo.pairs) for row in rows}
    shown = [f"BURN {span(w)}" for w in next(iter(longs))] if len(longs) == 1 else []
    head = ["SLO", "ENGINE", "OBJECTIVE", "BUDGET LEFT"]
    head += (shown or [f"BURN PAIR {i}" for i in range(1, 5)]) + ["FIRING"]
    lines = [head]
    for row in rows:
        left = row.budget_left
        lines.append(
            [
                row.slo.name,
                f"{row.engine['instance']}/{row.engine['model_name']}/{row.engine['engine']}",
                row.slo.describe(),
                "-" if left is None else f"{left * 100:.1f}%",
                *(_num(row.burn_rate(p.long), ".2f") for p in row.slo.pairs),
                ", ".join(alert_name(row.slo, p) for p in row.firing()) or "-",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def cmd_slo(args: argparse.Namespace) -> int:
    url = _url(args.prometheus)
    config = load_config(args.config, runbooks=runbook_names())
    if not config.slos:
        raise UsageError(f"no slos: in {args.config or 'the default configuration'}")
    rows = statuses(config.slos, url, args.time, args.timeout)
    if args.json:
        print(json.dumps([row.as_json() for row in rows], indent=2))
    elif not rows:
        print("no engine has requests in any SLO's window")
    else:
        print(table(rows))
    return ExitCode.OK
