"""`runbook status`, `set` and `restore`: read and change live engines' knobs.

Errors are raised (UsageError, the engine client's errors) and mapped to an
exit code by the CLI's one `main`; `set` and `restore` on several engines
report each engine's error and end with the worst code.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from vllm_runbook.collector.agent_api import (
    POLICIES,
    AgentState,
    AutopilotState,
    ChangeResult,
    Stats,
)
from vllm_runbook.collector.autopilot import parse_switch, parse_target
from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.argtypes import positive_seconds
from vllm_runbook.runbooks.operate.cli.errors import UsageError

DEFAULT_TIMEOUT = 35.0  # a knob change may wait up to 30 s for a step boundary


# -- engines -----------------------------------------------------------------


def read_engines_file(path: str) -> list[str]:
    """One URL per line (# comments), or the config's YAML `engines:` list."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read engines file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"engines file {path} is not UTF-8 text") from None
    if path.endswith((".yaml", ".yml")):
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else path
            raise UsageError(f"{where}: invalid YAML") from None
        engines = data.get("engines") if isinstance(data, dict) else data
        if not isinstance(engines, list):
            raise UsageError(f"{path}: expected an `engines:` list")
        urls = []
        for i, e in enumerate(engines):
            url = e.get("agent") if isinstance(e, dict) else e
            if not isinstance(url, str):
                raise UsageError(f"{path}: engines[{i}] has no `agent` URL")
            urls.append(url)
        return urls
    return [s for line in text.splitlines() if (s := line.split("#", 1)[0].strip())]


def engine_urls(args: argparse.Namespace) -> list[str]:
    urls = list(args.engine or [])
    if args.engines_file:
        urls += read_engines_file(args.engines_file)
    if not urls:
        raise UsageError("give --engine URL (repeatable) or --engines-file FILE")
    return urls


# -- the service's inventory ---------------------------------------------------


def cmd_engines(args: argparse.Namespace) -> int:
    """GET /api/engines of a running service: the static and the discovered engines."""
    import os
    import time

    import httpx

    token = args.token or os.environ.get("RUNBOOK_READ_TOKEN", "").strip() or None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = args.service.rstrip("/") + "/api/engines"
    try:
        response = httpx.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise UsageError(f"service {args.service} unreachable: {exc}") from None
    if response.status_code != 200:
        raise UsageError(f"service {args.service}: HTTP {response.status_code} for /api/engines")
    from pydantic import ValidationError
    from vllm_runbook.runbooks.service.api import Engines

    try:
        rows = response.json()
    except ValueError:
        raise UsageError(f"service {args.service}: /api/engines is not JSON") from None
    try:
        engines = Engines.model_validate(rows).root
    except ValidationError as exc:
        raise UsageError(
            f"service {args.service}: /api/engines is not an inventory "
            f"({exc.error_count()} error(s), first: {exc.errors()[0]['msg']})"
        ) from None
    if args.json:
        print(json.dumps(rows, indent=2))
        return ExitCode.OK
    now = time.time()
    table = [("NAME", "SOURCE", "AGENT", "VLLM", "LAST SEEN", "LABELS")]
    for e in engines:
        labels = ",".join(f"{k}={v}" for k, v in sorted(e.labels.items()))
        seen = f"{max(0.0, now - e.last_seen):.0f} s ago"
        table.append((e.name, e.source, e.agent, e.vllm or "-", seen, labels or "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return ExitCode.OK


# -- formatting ----------------------------------------------------------------


def _fmt(value: Any, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.3g}" if kind != "int" else f"{value:.0f}"
    return str(value)


STATUS_SIGNALS = [
    ("kv hit ratio (window)", "kv_hit_ratio", "pct"),
    ("block fragmentation", "block_fragmentation", "pct"),
    ("padding ratio", "padding_ratio", "pct"),
    ("length padding", "length_padding_ratio", "pct"),
    ("KV cache usage", "kv_cache_usage", "pct"),
    ("KV blocks used / free", None, ""),
    ("requests running", "requests_running", "int"),
    ("requests waiting", "requests_waiting", "int"),
    ("preemptions / min", "preemptions_per_minute", ""),
    ("preemptions total", "preemptions_total", "int"),
    ("budget fill (last step)", "budget_fill", "pct"),
]


def format_status(url: str, state: AgentState) -> str:
    e, knobs, startup = state.engine, state.knobs, state.startup
    bounds, stats = state.bounds.model_dump(), state.stats
    up = "up" if state.collector_up else "DISABLED"
    lines = [
        f"engine {url}  model {e.model_name}  dp rank {e.engine}  "
        f"step {e.step}  vLLM {e.vllm_version}  collector {up}",
        f"  {'knob':<24} {'effective':>10} {'startup':>10}  allowed",
    ]
    allowed_values = {"policy": " | ".join(POLICIES), "autopilot": "on | off"}
    for knob in ("max_num_batched_tokens", "max_num_seqs", "policy", "autopilot"):
        b = bounds.get(knob)
        allowed = f"{b['min']}..{b['max']}" if b else allowed_values[knob]
        now, then = getattr(knobs, knob), getattr(startup, knob)
        mark = " *" if now != then else ""
        show = _onoff if knob == "autopilot" else str
        lines.append(f"  {knob:<24} {show(now)!s:>10} {show(then)!s:>10}  {allowed}{mark}")
    lines.append(format_autopilot(state.autopilot))
    lines.append(format_warmup(stats))
    lines.append(f"  {'signal':<24} {'value':>10}")
    for label, key, kind in STATUS_SIGNALS:
        if key is None:
            value = f"{_fmt(stats.kv_blocks_used, 'int')} / {_fmt(stats.kv_blocks_free, 'int')}"
        else:
            value = _fmt(getattr(stats, key), kind)
        lines.append(f"  {label:<24} {value:>10}")
    if knobs != startup:
        lines.append("  * changed at runtime; `runbook restore --engine URL` restores")
    return "\n".join(lines)


def _onoff(value: Any) -> str:
    return "on" if value is True else "off" if value is False else _fmt(value)


def format_warmup(stats: Stats) -> str:
    """One line: the warm-up at engine start (VLLM_RUNBOOK_WARMUP) and how far it got."""
    planned = stats.warmup_requests_planned
    if not planned:
        return "  warm-up at start: none (VLLM_RUNBOOK_WARMUP off, or skipped: see the engine log)"
    how = "done" if stats.warmup_done >= 1 else "not finished (the engine started cold)"
    return (
        f"  warm-up at start: {how}: {stats.warmup_requests_done}/{planned} requests, "
        f"{stats.warmup_steps} steps, {stats.warmup_tokens} tokens in "
        f"{stats.warmup_seconds:.2f} s"
    )


def format_autopilot(pilot: AutopilotState) -> str:
    """One line: the autopilot's band, where it is and what it did last."""
    band = f"peak KV target {pilot.target:.2f}..{pilot.high:.2f}"
    text = f"  autopilot {_onoff(pilot.enabled)}: {band}, ceiling {pilot.ceiling}"
    text += f", changes up {pilot.changes.up} / down {pilot.changes.down}"
    last = pilot.last_change
    if last:
        text += f"; last: max_num_seqs {last.max_num_seqs} ({last.reason}, step {last.step})"
    if pilot.error:
        text += f"; turned off after an error: {pilot.error}"
    return text


def format_change(url: str, result: ChangeResult) -> str:
    verb = "would change" if result.dry_run else "changed"
    if not result.changes:
        return f"{url}: nothing to change"
    parts = [f"{c.knob} {c.before} → {c.after}" for c in result.changes]
    step = "" if result.dry_run else f" (from step {result.effective_from_step})"
    text = f"{url}: {verb} {', '.join(parts)}{step}"
    for c in result.clamped:
        text += f"\n  clamped {c.knob}: asked {c.requested}, applied {c.applied}"
    return text


# -- commands --------------------------------------------------------------------


def parse_assignments(items: Sequence[str]) -> dict[str, Any]:
    """`max_num_batched_tokens=256`, `max_num_batched_tokens=x0.5`, `policy=fcfs`."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise UsageError(f"expected KNOB=VALUE, got {item!r}")
        if key == "policy":
            values["policy"] = raw
        elif key == "autopilot":
            try:
                values["autopilot"] = parse_switch(raw)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        elif key == "autopilot_target":
            try:
                values["autopilot_target"] = parse_target(raw)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        elif key in ("max_num_batched_tokens", "max_num_seqs"):
            if key == "max_num_batched_tokens" and raw.startswith("x"):
                try:
                    values["scale_max_num_batched_tokens"] = float(raw[1:])
                except ValueError:
                    raise UsageError(f"bad scale {raw!r}: use e.g. x0.5") from None
                continue
            try:
                values[key] = int(raw)
            except ValueError:
                raise UsageError(f"{key} must be an integer, got {raw!r}") from None
        else:
            raise UsageError(
                f"unknown knob {key!r}: max_num_batched_tokens, max_num_seqs, policy, "
                "autopilot, autopilot_target"
            )
    if not values:
        raise UsageError("nothing to set: give KNOB=VALUE")
    return values


def cmd_status(args: argparse.Namespace) -> int:
    states = []
    for url in engine_urls(args):
        client = EngineClient(url, args.token, timeout=args.timeout)
        states.append((client.url, client.state()))
    if args.json:
        as_json = [{"url": u, **s.model_dump(mode="json")} for u, s in states]
        print(json.dumps(as_json, indent=2, sort_keys=True))
    else:
        print("\n\n".join(format_status(u, s) for u, s in states))
    return ExitCode.OK


def _each_engine(args: argparse.Namespace, action: Any) -> int:
    code, results = ExitCode.OK, []
    for url in engine_urls(args):
        try:
            client = EngineClient(url, args.token, timeout=args.timeout)
            result = action(client)
        except EngineClientError as exc:
            print(f"runbook: error: {exc}", file=sys.stderr)
            code = max(code, exc.exit_code)
            continue
        results.append({"url": client.url, **result.model_dump(mode="json")})
        if not args.json:
            print(format_change(client.url, result))
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    return code


def cmd_set(args: argparse.Namespace) -> int:
    values = parse_assignments(args.assignments)
    return _each_engine(
        args, lambda c: c.set_knobs(clamp=args.clamp, dry_run=args.dry_run, **values)
    )


def cmd_restore(args: argparse.Namespace) -> int:
    return _each_engine(args, lambda c: c.restore(dry_run=args.dry_run))


def add_subcommands(sub: Any) -> None:
    """Mount `status`, `set` and `restore` on the `runbook` command's subparsers."""

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--engine",
            action="append",
            metavar="URL",
            help="engine agent URL (repeatable), e.g. http://127.0.0.1:9360",
        )
        p.add_argument(
            "--engines-file",
            metavar="FILE",
            help="file of engine URLs (one per line) or the YAML config",
        )
        p.add_argument(
            "--token",
            help="agent token (default: VLLM_RUNBOOK_TOKEN, or the token a local agent stored)",
        )
        p.add_argument(
            "--timeout",
            type=positive_seconds,
            default=DEFAULT_TIMEOUT,
            metavar="S",
            help=f"seconds to wait for each engine's answer (default {DEFAULT_TIMEOUT:g})",
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "engines",
        help="the inventory of a running `runbook serve`: each engine, its source, last seen",
    )
    p.add_argument(
        "--service",
        default="http://127.0.0.1:8080",
        metavar="URL",
        help="the service's URL (default http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--token",
        help="read token or webhook token (default: RUNBOOK_READ_TOKEN; loopback needs none)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("status", help="knobs and key signals of engines")
    engine_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("set", help="change knobs on live engines (experts)")
    engine_args(p)
    p.add_argument(
        "assignments",
        nargs="+",
        metavar="KNOB=VALUE",
        help="max_num_batched_tokens=N|xF, max_num_seqs=N, policy=fcfs|priority|tiered, "
        "autopilot=on|off, autopilot_target=F (peak KV usage, 0 < F <= 1)",
    )
    p.add_argument("--dry-run", action="store_true", help="show the change, apply nothing")
    p.add_argument(
        "--clamp", action="store_true", help="clamp out-of-bounds values instead of refusing them"
    )
    p.set_defaults(func=cmd_set)

    p = sub.add_parser(
        "restore", help="restore every knob to its startup value (the autopilot turns off)"
    )
    engine_args(p)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_restore)
