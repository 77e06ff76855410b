"""`runbook backtest`: the rule catalog and the runbooks over a recorded range.

Reads the series the rules and the runbooks' checks need from Prometheus'
HTTP API (vllm_runbook.rules.backtest: raw samples, in chunks), runs the
embedded evaluator at every `--step` from `--from` to `--to`, and says for each
finding what the service would have done (vllm_runbook.runbooks.operate.backtest).
Exit codes: OK; USAGE for a bad argument or file; FAILED when Prometheus does
not answer or refuses a query.
"""

from __future__ import annotations

import argparse
import json
import math
import ssl
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vllm_runbook.rules.backtest import (
    CHUNK_SECONDS,
    BacktestError,
    Finding,
    PrometheusRange,
    Replay,
    parse_time,
    run,
)
from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.rules.errors import RulesError
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.backtest import Decision, Simulator, summary
from vllm_runbook.runbooks.operate.cli.errors import UsageError

# Drawn per engine in --png (the demo's panels: KV, pressure, knobs).
PLOTTED = (
    "kv_cache_usage",
    "kv_cache_usage_peak",
    "preemptions_per_minute",
    "requests_running",
    "requests_waiting",
    "max_num_seqs",
)
MAX_PLOTTED_ENGINES = 8


class BacktestFailed(RunbookError):
    """Prometheus did not answer, or refused a query."""

    exit_code = ExitCode.FAILED


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "backtest",
        help="replay the rules and runbooks over a Prometheus' history: what would have fired "
        "and what the service would have done",
    )
    p.add_argument("--prometheus", metavar="URL", required=True, help="Prometheus' HTTP API")
    p.add_argument(
        "--from",
        dest="start",
        required=True,
        metavar="TIME",
        help="start: UNIX seconds, RFC 3339 (2026-12-05T10:00:00Z) or now-DURATION",
    )
    p.add_argument("--to", dest="end", default="now", metavar="TIME", help="end (default: now)")
    p.add_argument("--step", default="15s", help="evaluation interval (default 15s)")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="configuration file: rule overrides, automation, breaker, mode",
    )
    p.add_argument(
        "--rules",
        type=Path,
        default=None,
        metavar="FILE",
        help="rule catalog (default: the configuration's, else the shipped one)",
    )
    p.add_argument(
        "--runbooks",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="runbook catalog directory (repeatable; default: the shipped one)",
    )
    p.add_argument(
        "--engine",
        default="",
        metavar="SELECTOR",
        help='PromQL label matchers that select the engines, e.g. instance=~"gpu-.*"',
    )
    p.add_argument("--json", action="store_true", help="one JSON document instead of the timeline")
    p.add_argument(
        "--incidents",
        type=Path,
        default=None,
        metavar="FILE",
        help="known incidents (YAML/JSON list of {engine, start, end[, alerts]}): "
        "prints each rule's precision and recall",
    )
    p.add_argument(
        "--png",
        type=Path,
        default=None,
        metavar="FILE",
        help="draw the engines' signals with the findings marked (needs the plots extra)",
    )
    auth = p.add_argument_group("Prometheus credentials (as discovery's)")
    auth.add_argument("--bearer-token-file", type=Path, default=None, metavar="FILE")
    auth.add_argument("--username", default=None)
    auth.add_argument("--password-file", type=Path, default=None, metavar="FILE")
    auth.add_argument("--ca-file", type=Path, default=None, metavar="FILE")
    auth.add_argument("--timeout", default="60s", help="per query (default 60s)")
    p.add_argument("--chunk", default="1h", help="span read per query (default 1h)")
    p.set_defaults(func=cmd_backtest)
    return p


def _secret(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None


def source_of(args: argparse.Namespace) -> PrometheusRange:
    url = str(args.prometheus)
    if not url.startswith(("http://", "https://")) or "://" not in url or not url.split("://")[1]:
        raise UsageError(f"--prometheus must be an http(s) URL, got {url!r}")
    if args.bearer_token_file and (args.username or args.password_file):
        raise UsageError("give --bearer-token-file or --username + --password-file, not both")
    if (args.username is None) != (args.password_file is None):
        raise UsageError("basic auth needs both --username and --password-file")
    if "}" in args.engine or "{" in args.engine.strip("{}") or "\n" in args.engine:
        raise UsageError(f'--engine takes label matchers, e.g. instance="a", got {args.engine!r}')
    context = None
    if args.ca_file is not None:
        try:
            context = ssl.create_default_context(cafile=str(args.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--ca-file {args.ca_file}: {exc}") from None
    return PrometheusRange(
        url,
        bearer_token=_secret(args.bearer_token_file, "--bearer-token-file")
        if args.bearer_token_file
        else None,
        basic_auth=(args.username, _secret(args.password_file, "--password-file"))
        if args.username
        else None,
        ssl_context=context,
        timeout=_duration(args.timeout, "--timeout"),
        selector=args.engine.strip().strip("{}"),
    )


def load(args: argparse.Namespace) -> tuple[Any, list[Any], Any, Any]:
    """(config, rules, runbook catalog, action registry), each checked against the others."""
    from vllm_runbook.rules.model import load_catalog as load_rule_catalog
    from vllm_runbook.rules.slo import slo_rules
    from vllm_runbook.runbooks.engine.operations import engine_registry
    from vllm_runbook.runbooks.model.catalogs import runbook_names
    from vllm_runbook.runbooks.model.config import load_config
    from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog

    registry = engine_registry()
    names = runbook_names(args.runbooks, registry)
    config = load_config(args.config, runbooks=names)
    rule_catalog = load_rule_catalog(args.rules or config.catalog, runbooks=names)
    rules = config.bind(rule_catalog) + slo_rules(config.slos)
    runbooks = load_runbook_catalog(args.runbooks, registry, alerts=rule_catalog.alerts)
    return config, rules, runbooks, registry


def _duration(text: str, option: str) -> float:
    try:
        return parse_duration(text)
    except RulesError:
        raise UsageError(f"{option} must be a positive duration (15s, 1m), got {text!r}") from None


def cmd_backtest(args: argparse.Namespace) -> int:
    now = time.time()
    try:
        start, end = parse_time(args.start, now), parse_time(args.end, now)
    except RulesError as exc:
        raise UsageError(f"--from/--to: {exc}") from None
    step, chunk = _duration(args.step, "--step"), _duration(args.chunk, "--chunk")
    if not end > start:
        raise UsageError("--to must be after --from")
    if step <= 0:
        raise UsageError("--step must be positive")
    incidents = read_incidents(args.incidents, now) if args.incidents else None
    source = source_of(args)
    config, rules, runbooks, registry = load(args)
    replay, simulator, plotted = backtest(
        source,
        rules,
        runbooks,
        config,
        registry,
        start,
        end,
        step,
        chunk=chunk or CHUNK_SECONDS,
        plot=args.png is not None,
    )
    decisions = simulator.decisions
    scores = scores_of(rules, replay.findings, incidents) if incidents is not None else None
    if args.json:
        print(json.dumps(as_json(replay, simulator, start, end, step, scores), indent=2))
    else:
        print(timeline(replay, decisions, start, end, step))
        if simulator.trips:
            for trip in simulator.trips:
                print(f"breaker: {_clock(trip['at'])} {trip['engine']}: {trip['why']}")
        if scores is not None:
            print(scores_table(scores))
    if args.png is not None:
        png(plotted, decisions, args.png, start, end)
        if not args.json:
            print(f"picture: {args.png}")
    return ExitCode.OK


def backtest(
    source: PrometheusRange,
    rules: Sequence[Any],
    runbooks: Any,
    config: Any,
    registry: Any,
    start: float,
    end: float,
    step: float,
    *,
    chunk: float = CHUNK_SECONDS,
    plot: bool = False,
) -> tuple[Replay, Simulator, dict[str, dict[str, list[float | None]]]]:
    major = source.major_version()
    watch = config.breaker.watch_seconds
    replay = Replay(
        rules,
        left_open=major is None or major >= 3,
        signals=Simulator.signals(runbooks) | (set(PLOTTED) if plot else set()),
        series=Simulator.extra_series(),
        history=2 * watch,
    )
    simulator = Simulator(replay, runbooks, config, registry)
    plotted: dict[str, dict[str, list[float | None]]] = {}

    def observe(now: float, events: list[Any]) -> None:
        simulator.observe(now, events)
        if plot:
            for engine in replay.engines()[:MAX_PLOTTED_ENGINES]:
                row = plotted.setdefault("/".join(engine), {"t": []})
                row["t"].append(now)
                for name in PLOTTED:
                    row.setdefault(name, []).append(replay.read(engine, name, now))

    try:
        run(replay, source, start, end, step, chunk=chunk, observer=observe)
    except BacktestError as exc:
        raise BacktestFailed(str(exc)) from None
    return replay, simulator, plotted


# -- output ------------------------------------------------------------------------


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _num(v: Any) -> str:
    if v is None:
        return "not recorded"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def change_text(c: dict[str, Any]) -> str:
    return f"{c['knob']} {_num(c['before'])} -> {_num(c['after'])} ({c['action']})"


def timeline(
    replay: Replay, decisions: Sequence[Decision], start: float, end: float, step: float
) -> str:
    lines = [
        f"backtest {_clock(start)} .. {_clock(end)}, every {step:g} s: "
        f"{replay.evaluations} evaluations of {len(replay.rules)} rules, "
        f"{len(replay.findings)} finding(s)"
    ]
    by_finding = {id(d.finding): d for d in decisions}
    engines = sorted({f.engine for f in replay.findings} | set(replay.engines()))
    for engine in engines:
        found = [f for f in replay.findings if f.engine == engine]
        name = "/".join(engine)
        if not found:
            lines.append(f"{name}: no findings")
            continue
        lines.append(f"{name}:")
        events: list[tuple[float, int, str]] = []
        for f in found:
            d = by_finding.get(id(f))
            head = f"{f.alert} ({f.severity}) fired, value {f.value:.4g}"
            if d is not None and d.runbook:
                head += f": runbook {d.runbook} {d.decision}"
                if d.reason:
                    head += f" ({d.reason})"
            elif d is not None:
                head += f": {d.decision}"
            events.append((f.fired_at, 0, head))
            if d is not None and d.checks:
                checks = ", ".join(f"{k}={_num(v)}" for k, v in d.checks.items())
                events.append((f.fired_at, 1, f"    checks: {checks}"))
            if d is not None and d.changes:
                events.append(
                    (f.fired_at, 2, "    changes: " + "; ".join(map(change_text, d.changes)))
                )
            for note in d.notes if d is not None else []:
                events.append((f.fired_at, 3, f"    note: {note}"))
            if f.resolved_at is not None:
                events.append((f.resolved_at, 4, f"{f.alert} ({f.severity}) resolved"))
            else:
                events.append((end, 4, f"{f.alert} ({f.severity}) still firing at the end"))
        for t, _, text in sorted(events, key=lambda e: (e[0], e[1])):
            lines.append(
                f"  {_clock(t)}  {text}"
                if not text.startswith("    ")
                else f"  {' ' * 20}  {text.strip()}"
            )
    counts = summary(decisions)
    if counts:
        lines.append("decisions: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines)


def as_json(
    replay: Replay,
    simulator: Simulator,
    start: float,
    end: float,
    step: float,
    scores: dict[str, dict[str, Any]] | None,
) -> dict[str, Any]:
    decided = {id(d.finding): d for d in simulator.decisions}
    findings = []
    for f in replay.findings:
        d = decided.get(id(f))
        findings.append(
            d.as_json() if d is not None else Decision(f, f.runbook, "undecided").as_json()
        )
    out: dict[str, Any] = {
        "range": {"from": start, "to": end, "step": step},
        "evaluations": replay.evaluations,
        "engines": ["/".join(e) for e in replay.engines()],
        "findings": findings,
        "summary": summary(simulator.decisions),
        "breaker_trips": simulator.trips,
    }
    if scores is not None:
        out["scores"] = scores
    return out


# -- known incidents: precision and recall ----------------------------------------------


def read_incidents(path: Path, now: float) -> list[dict[str, Any]]:
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read --incidents {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"--incidents {path}: not YAML/JSON: {str(exc).splitlines()[0]}") from None
    if isinstance(raw, dict):
        raw = raw.get("incidents")
    if not isinstance(raw, list):
        raise UsageError(f"--incidents {path}: expected a list of {{engine, start, end}}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not {"engine", "start", "end"} <= set(item):
            raise UsageError(f"--incidents {path}: item {i + 1} needs engine, start and end")
        try:
            start, end = parse_time(str(item["start"]), now), parse_time(str(item["end"]), now)
        except BacktestError as exc:
            raise UsageError(f"--incidents {path}: item {i + 1}: {exc}") from None
        alerts = item.get("alerts")
        out.append(
            {
                "engine": str(item["engine"]),
                "start": start,
                "end": end,
                "alerts": [str(a) for a in alerts] if isinstance(alerts, list) else None,
            }
        )
    return out


def _engine_matches(name: str, f: Finding) -> bool:
    return name in (f.engine[0], f.engine_name)


def _overlaps(incident: dict[str, Any], f: Finding) -> bool:
    resolved = f.resolved_at if f.resolved_at is not None else math.inf
    return (
        _engine_matches(incident["engine"], f)
        and f.pending_at <= incident["end"]
        and (resolved >= incident["start"])
    )


def scores_of(
    rules: Sequence[Any], findings: Sequence[Finding], incidents: Sequence[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per rule: precision (its findings that overlap a known incident on that engine)
    and recall (the incidents, of those that name it or name no alert, it found)."""
    out: dict[str, dict[str, Any]] = {}
    for alert in sorted({r.alert for r in rules}):
        mine = [f for f in findings if f.alert == alert]
        relevant = [i for i in incidents if i["alerts"] is None or alert in i["alerts"]]
        true_pos = sum(1 for f in mine if any(_overlaps(i, f) for i in relevant))
        found = sum(1 for i in relevant if any(_overlaps(i, f) for f in mine))
        out[alert] = {
            "findings": len(mine),
            "true_positives": true_pos,
            "incidents": len(relevant),
            "found": found,
            "precision": true_pos / len(mine) if mine else None,
            "recall": found / len(relevant) if relevant else None,
        }
    return out


def scores_table(scores: dict[str, dict[str, Any]]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.0f}%"

    rows = [["RULE", "FINDINGS", "PRECISION", "INCIDENTS FOUND", "RECALL"]]
    for alert, s in scores.items():
        if not s["findings"] and not s["found"]:
            continue
        rows.append(
            [
                alert,
                str(s["findings"]),
                pct(s["precision"]),
                f"{s['found']}/{s['incidents']}",
                pct(s["recall"]),
            ]
        )
    missed = [a for a, s in scores.items() if not s["findings"] and s["incidents"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    if missed:
        text += f"\nno finding (recall 0 of their incidents): {len(missed)} rule(s)"
    return text


# -- the picture ------------------------------------------------------------------------


def png(
    plotted: dict[str, dict[str, list[float | None]]],
    decisions: Sequence[Decision],
    path: Path,
    start: float,
    end: float,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted(plotted)
    if not engines:
        raise UsageError("no engine has series in the range: nothing to draw")
    fig, axes = plt.subplots(len(engines), 1, figsize=(13, 3.2 * len(engines)), squeeze=False)
    for ax, name in zip((a[0] for a in axes), engines, strict=True):
        row = plotted[name]
        x = [(t - start) / 60 for t in row["t"] if t is not None]

        def series(key: str, scale: float = 1.0, r: dict[str, Any] = row) -> list[float]:
            return [math.nan if v is None else v * scale for v in r[key]]

        ax.plot(x, series("kv_cache_usage", 100), color="tab:red", label="KV cache usage %")
        ax.plot(
            x,
            series("kv_cache_usage_peak", 100),
            color="tab:red",
            lw=0.7,
            alpha=0.5,
            label="KV usage peak %",
        )
        ax.set_ylim(0, 105)
        ax.set_ylabel("%")
        ax.set_title(name, fontsize=10, loc="left")
        ax2 = ax.twinx()
        ax2.plot(x, series("preemptions_per_minute"), color="tab:purple", label="preemptions / min")
        ax2.plot(x, series("requests_running"), color="tab:blue", label="requests running")
        ax2.plot(x, series("requests_waiting"), color="tab:orange", label="requests waiting")
        ax2.step(x, series("max_num_seqs"), where="post", color="tab:brown", label="max_num_seqs")
        ax2.set_ylim(bottom=0)
        for d in decisions:
            f = d.finding
            if f.engine_name != name:
                continue
            right = f.resolved_at if f.resolved_at is not None else end
            colour = "tab:red" if f.severity == "critical" else "tab:orange"
            ax.axvspan((f.fired_at - start) / 60, (right - start) / 60, color=colour, alpha=0.15)
            ax.axvline((f.fired_at - start) / 60, color=colour, lw=1.2, ls="--")
            label = f"{f.alert}: {d.runbook or '-'} {d.decision}"
            ax.annotate(
                label,
                xy=((f.fired_at - start) / 60, 100),
                fontsize=7,
                color=colour,
                va="top",
                ha="left",
                xytext=(3, -3),
                textcoords="offset points",
            )
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
    axes[-1][0].set_xlabel(f"minutes after {_clock(start)}")
    fig.suptitle("runbook backtest: signals and findings", fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=90)
    except OSError as exc:
        raise UsageError(f"cannot write --png {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
    return path
