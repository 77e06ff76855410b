"""What happened around runbook executions: the signal history, a timeline picture, a summary.

The journal keeps what the executor did (checks, knob values before and
after, verification, reverts) but not the engine's signals between those
moments. Whoever watches the engine (the demo does) appends them to a
*signal history*: a JSON-lines file next to the SQLite database
(`runbook.db` → `runbook.signals.jsonl`), one object per line:

    {"kind": "phase",   "t": 1718000000.0, "name": "long-burst"}
    {"kind": "sample",  "t": ..., "engine": "http://127.0.0.1:9360", "phase": "long-burst",
     "rps": 4.0, "kv_hit_ratio": 0.41, "block_fragmentation": 0.03,
     "kv_cache_usage": 0.98, "preemptions": 37, "requests_running": 16,
     "requests_waiting": 3, "max_num_batched_tokens": 512, "max_num_seqs": 16,
     "policy": "priority", "oldest_request_s": 4.2, "oldest_low_priority_s": 0.0}
    {"kind": "request", "t0": ..., "t1": ..., "phase": "steady", "priority": 0,
     "ok": true, "output_tokens": 32}

`t` is Unix time; `engine` is the agent URL as the journal names the
engine; `rps` is requests completed per second and `oldest_request_s` the
age of the oldest request still in flight (`oldest_low_priority_s`: of the
low-priority ones), all seen by the client; a key that is a signal has its name
(`vllm_runbook.rules.signals`: `kv_cache_usage`, `preemptions` the counter's value).
Unknown keys are ignored, so the format only ever grows.

`timeline_png` draws the signals with the executions' events marked;
`phase_rows`, `execution_lines` give the summary. The demo and `runbook
report ID` both use them, on the service's API answers and on the journal
respectively (the same dictionaries: `ExecutionRecord.to_dict()`).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy.engine import make_url
from vllm_runbook.runbooks.run.render import (
    format_check,
    format_guards,
    format_verification,
)
from vllm_runbook.runbooks.store.models import ExecutionStatus

# Seconds of history compared before and after an execution's changes.
EFFECT_WINDOW_S = 20.0


def signals_path_for(db_url: str) -> Path | None:
    """The signal history beside a SQLite database; None for server databases."""
    try:
        url = make_url(db_url)
    except Exception:
        return None
    if not url.drivername.startswith("sqlite") or not url.database or url.database == ":memory:":
        return None
    return Path(url.database).with_suffix(".signals.jsonl")


class SignalLog:
    """Appends records to a signal history (one JSON object per line, flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # writers on several threads

    def write(self, kind: str, **record: Any) -> None:
        line = json.dumps({"kind": kind, **record}, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class History:
    samples: list[dict[str, Any]] = field(default_factory=list)
    phases: list[tuple[float, str]] = field(default_factory=list)  # (start, name)
    requests: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path, engine: str | None = None) -> History:
        """Read a signal history; `engine` keeps only that engine's samples."""
        history = cls()
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                kind = record.get("kind")
                if kind == "sample" and (engine is None or record.get("engine") == engine):
                    history.samples.append(record)
                elif kind == "phase":
                    history.phases.append((float(record["t"]), str(record["name"])))
                elif kind == "request":
                    history.requests.append(record)
        history.samples.sort(key=lambda s: s["t"])
        history.phases.sort()
        return history

    def phase_spans(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of each phase; the last ends at the last sample."""
        end = self.samples[-1]["t"] if self.samples else (self.phases[-1][0] if self.phases else 0)
        spans = []
        for i, (start, name) in enumerate(self.phases):
            stop = self.phases[i + 1][0] if i + 1 < len(self.phases) else max(end, start)
            spans.append((name, start, stop))
        return spans

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if start <= s["t"] <= end]


# --- numbers -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _counter_rate(samples: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Per-second increase of a counter across samples (None: too few)."""
    points = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return max(0.0, points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def phase_rows(history: History) -> list[dict[str, Any]]:
    """Per phase: duration, requests, throughput, latency percentiles, preemptions, peak KV."""
    rows = []
    for name, start, end in history.phase_spans():
        done = [
            r
            for r in history.requests
            if r.get("phase") == name and r.get("ok") and r.get("t1") is not None
        ]
        latencies = [r["t1"] - r["t0"] for r in done]
        seconds = max(end - start, 1e-9)
        finished_in = [r for r in history.requests if r.get("ok") and start <= r["t1"] < end]
        samples = history.between(start, end)
        counts = [s["preemptions"] for s in samples if s.get("preemptions") is not None]
        rows.append(
            {
                "phase": name,
                "seconds": end - start,
                "requests": len(done),
                "failed": sum(
                    1 for r in history.requests if r.get("phase") == name and r["ok"] is False
                ),
                "rps": len(finished_in) / seconds,
                "tokens_per_s": sum(r.get("output_tokens", 0) for r in finished_in) / seconds,
                "p50_s": percentile(latencies, 50),
                "p99_s": percentile(latencies, 99),
                "preemptions": (max(counts) - min(counts)) if counts else None,
                "peak_kv": max(
                    (s["kv_cache_usage"] for s in samples if s.get("kv_cache_usage") is not None),
                    default=None,
                ),
            }
        )
    return rows


def format_phase_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    def sec(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} s"

    lines = [
        f"{'phase':<12}{'time':>7}{'requests':>10}{'req/s':>8}{'tok/s':>8}"
        f"{'P50':>9}{'P99':>9}{'preemptions':>13}{'peak KV':>9}"
    ]
    for r in rows:
        pre = "n/a" if r["preemptions"] is None else f"{r['preemptions']:.0f}"
        kv = "n/a" if r["peak_kv"] is None else f"{100 * r['peak_kv']:.0f}%"
        lines.append(
            f"{r['phase']:<12}{r['seconds']:>6.0f}s{r['requests']:>10d}{r['rps']:>8.1f}"
            f"{r['tokens_per_s']:>8.0f}{sec(r['p50_s']):>9}{sec(r['p99_s']):>9}{pre:>13}{kv:>9}"
        )
    return lines


# --- executions --------------------------------------------------------------------


def ts(value: str | None) -> float | None:
    """Unix time of an ISO timestamp from the journal."""
    return None if value is None else datetime.fromisoformat(value).timestamp()


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _changes(step: Mapping[str, Any]) -> str:
    before, after = step.get("before") or {}, step.get("after") or {}
    return ", ".join(f"{k} {_fmt(before.get(k))} → {_fmt(after.get(k))}" for k in after) or "-"


def applied_steps(execution: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Steps that changed the engine (applied, or applied and since reverted)."""
    return [
        s
        for s in execution.get("steps", [])
        if s["status"] in ("applied", "reverted") and s.get("after") and s.get("before")
    ]


def step_time(step: Mapping[str, Any]) -> float | None:
    """When a step changed the engine: its row is written just before the
    engine is touched (`finished_at` moves again when it is reverted)."""
    return ts(step.get("started_at"))


def action_times(execution: Mapping[str, Any]) -> tuple[float, float] | None:
    """When an execution's first and last change took effect (Unix time)."""
    times = [step_time(s) for s in applied_steps(execution)]
    present = [t for t in times if t is not None]
    return (min(present), max(present)) if present else None


def effect(
    history: History, execution: Mapping[str, Any], until: float | None = None
) -> list[tuple[str, float | None, float | None]]:
    """Key signals over EFFECT_WINDOW_S before the first change and after the last one
    (the after-window stops at `until`, e.g. when the change was reverted)."""
    span = action_times(execution)
    if span is None or not history.samples:
        return []
    first, last = span
    before = history.between(first - EFFECT_WINDOW_S, first)
    end = last + 2 + EFFECT_WINDOW_S
    after = history.between(last + 2, min(end, until) if until else end)
    measures: list[tuple[str, Callable[[list[dict[str, Any]]], float | None]]] = [
        ("preemptions/min", lambda ss: _scaled(_counter_rate(ss, "preemptions"), 60)),
        ("requests waiting", lambda ss: _mean(s.get("requests_waiting") for s in ss)),
        ("completed req/s", lambda ss: _mean(s.get("rps") for s in ss)),
        ("KV usage", lambda ss: _mean(s.get("kv_cache_usage") for s in ss)),
    ]
    if any(s.get("oldest_low_priority_s") for s in before):
        measures.append(
            (
                "oldest low-priority request (s)",
                lambda ss: _mean(s.get("oldest_low_priority_s") for s in ss),
            )
        )
    return [(label, fn(before), fn(after)) for label, fn in measures]


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def execution_lines(
    execution: Mapping[str, Any],
    revert: Mapping[str, Any] | None,
    history: History | None,
    origin: float | None = None,
) -> list[str]:
    """A few lines on one execution: trigger, checks, changes, verification, revert, effect."""

    def when(iso: str | None) -> str:
        t = ts(iso)
        if t is None:
            return "?"
        if origin is not None:
            return f"t+{t - origin:.0f}s"
        return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")

    trigger = execution.get("who", "")
    lines = [
        f"#{execution['id']} {execution['runbook']} on {execution['engine']} "
        f"({trigger}, {execution['trigger']}): {execution['status']}"
    ]
    if execution.get("reason") and execution["status"] in (
        ExecutionStatus.REFUSED,
        ExecutionStatus.REVERTED,
    ):
        lines.append(f"    reason: {execution['reason']}")
    if execution.get("error"):
        lines.append(f"    error: {execution['error']}")
    checks = execution.get("checks") or {}
    if checks:
        lines.append(
            "    checks: " + ", ".join(f"{k} {format_check(v)}" for k, v in checks.items())
        )
    for step in execution.get("steps", []):
        if step["status"] == "skipped":
            note = (step.get("params") or {}).get("note", "")
            lines.append(f"    {when(step['started_at'])} {step['action']}: skipped ({note})")
        elif step.get("after") is not None:
            lines.append(
                f"    {when(step['started_at'])} {step['action']}: "
                f"{_changes(step)} [{step['status']}]"
            )
    verification = execution.get("verification")
    if verification:
        lines.append(f"    verification: {format_verification(verification)}")
        guards = format_guards(verification)
        if guards:
            lines.append(f"    guards: {guards}")
    if revert is not None:
        changes = "; ".join(_changes(s) for s in applied_steps(revert)) or "nothing to change"
        lines.append(
            f"    revert #{revert['id']} at {when(revert.get('finished_at'))} "
            f"({revert['status']}): {changes}"
        )
    if history is not None:
        until = ts(revert["started_at"]) if revert and revert.get("started_at") else None
        rows = effect(history, execution, until)
        span = action_times(execution)
        after_s = None if span is None or until is None else until - (span[1] + 2)
        if rows and all(a is None for _, _, a in rows) and after_s is not None:
            # The revert came before the after-window held a sample: say so, not n/a.
            lines.append(
                f"    measured effect: the after-window was cut by the revert after "
                f"{max(0.0, after_s):.0f} s (too short to measure; {EFFECT_WINDOW_S:.0f} s "
                f"wanted); before the change: "
                + "; ".join(f"{label} {_fmt(b)}" for label, b, _ in rows)
            )
        elif rows:
            cut = (
                f", cut by the revert after {after_s:.0f} s"
                if after_s is not None and after_s < EFFECT_WINDOW_S
                else ""
            )
            lines.append(
                f"    measured effect ({EFFECT_WINDOW_S:.0f} s before the change → after it{cut}): "
                + "; ".join(f"{label} {_fmt(b)} → {_fmt(a)}" for label, b, a in rows)
            )
    return lines


def reverts_of(executions: Iterable[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """The latest revert of each execution, by the reverted execution's id."""
    out: dict[int, Mapping[str, Any]] = {}
    for e in sorted(executions, key=lambda e: e["id"]):
        if e.get("reverts_id") is not None:
            out[int(e["reverts_id"])] = e
    return out


# --- the picture -------------------------------------------------------------------

_PHASE_COLOURS = ("#e8f1fb", "#fdebd3", "#f6e0f2", "#e3f4e1", "#eeeeee")


def _events(executions: Sequence[Mapping[str, Any]]) -> list[tuple[float, str, str]]:
    """(time, colour, label) of every marked moment: fired, changes, verified,
    holding (the alert resolved, the cause not yet gone), reverted."""
    out: list[tuple[float, str, str]] = []
    for e in executions:
        name = f"#{e['id']} {e['runbook']}"
        if e.get("reverts_id") is not None:
            for s in applied_steps(e):
                t = step_time(s)
                if t is not None:
                    out.append((t, "tab:purple", f"revert #{e['reverts_id']}: {_short(s)}"))
            continue
        created = ts(e.get("created_at"))
        if created is not None:
            alert = str(e.get("who", "")).removeprefix("rules:")
            out.append((created, "tab:red", f"{alert} → {name}"))
        if e["status"] == ExecutionStatus.REFUSED:
            continue
        for s in applied_steps(e):
            t = step_time(s)
            if t is not None:
                out.append((t, "tab:blue", f"{name}: {_short(s)}"))
        v = e.get("verification")
        if v and e.get("finished_at"):
            t = ts(e["finished_at"])
            if t is not None:
                out.append((t, "tab:green", f"{name} verified: {v.get('outcome')}"))
        held = ts(e.get("hold_since"))
        if held is not None:  # its alert resolved; the change holds until the cause is gone
            what = "resolved by itself" if e.get("display_status") == "advised" else "holding"
            out.append((held, "tab:orange", f"{name} {what}"))
    return sorted(out)


def _short(step: Mapping[str, Any]) -> str:
    names = {"max_num_batched_tokens": "budget", "max_num_seqs": "seqs", "policy": "policy"}
    before, after = step.get("before") or {}, step.get("after") or {}
    return ", ".join(f"{names.get(k, k)} {before.get(k)}→{after.get(k)}" for k in after)


def timeline_png(
    history: History,
    executions: Sequence[Mapping[str, Any]],
    path: Path,
    *,
    title: str,
    window: tuple[float, float] | None = None,
) -> Path:
    """Draw the key signals over time with the executions' events marked; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = history.samples
    if window is not None:
        samples = [s for s in samples if window[0] <= s["t"] <= window[1]]
    if not samples:
        raise ValueError("no signal samples in the time range: nothing to draw")
    t0, t_end = samples[0]["t"], samples[-1]["t"]
    x = [s["t"] - t0 for s in samples]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [math.nan if s.get(key) is None else float(s[key]) * scale for s in samples]

    preempt_rate = [math.nan]
    for a, b in itertools.pairwise(samples):
        if a.get("preemptions") is None or b.get("preemptions") is None:
            preempt_rate.append(math.nan)
        else:
            dt = max(b["t"] - a["t"], 1e-9)
            preempt_rate.append(max(0.0, b["preemptions"] - a["preemptions"]) / dt)

    fig, axes = plt.subplots(4, 1, figsize=(13, 10.5), sharex=True)
    ax_kv, ax_pre, ax_knobs, ax_client = axes
    ax_kv.plot(x, series("kv_cache_usage", 100), label="KV cache usage %", color="tab:red")
    ax_kv.plot(x, series("kv_hit_ratio", 100), label="prefix hit ratio %", color="tab:green")
    ax_kv.plot(
        x, series("block_fragmentation", 100), label="block fragmentation %", color="tab:gray"
    )
    ax_kv.set_ylim(0, 105)
    ax_kv.set_ylabel("%")
    ax_pre.plot(x, preempt_rate, label="preemptions / s", color="tab:red")
    ax_pre.plot(x, series("requests_waiting"), label="requests waiting", color="tab:orange")
    ax_pre.plot(x, series("requests_running"), label="requests running", color="tab:blue")
    ax_pre.set_ylabel("count")
    ax_knobs.step(
        x, series("max_num_batched_tokens"), where="post", label="token budget", color="tab:blue"
    )
    ax_knobs.set_ylabel("tokens")
    ax_seqs = ax_knobs.twinx()
    ax_seqs.step(x, series("max_num_seqs"), where="post", label="max_num_seqs", color="tab:brown")
    ax_seqs.set_ylabel("sequences")
    ax_seqs.set_ylim(bottom=0)
    ax_knobs.set_ylim(bottom=0)
    # The policy as a band along the bottom of the knob panel.
    for i, s in enumerate(samples):
        if s.get("policy") == "fcfs":
            right = x[i + 1] if i + 1 < len(x) else x[i] + 1
            ax_knobs.axvspan(x[i], right, ymax=0.08, color="tab:olive", alpha=0.6, lw=0)
    ax_knobs.plot([], [], color="tab:olive", lw=6, alpha=0.6, label="policy fcfs (else priority)")
    ax_client.plot(x, series("rps"), label="completed requests / s", color="tab:blue")
    ax_client.plot(
        x,
        series("oldest_request_s"),
        label="oldest request in flight (s)",
        color="tab:purple",
        lw=0.8,
        alpha=0.5,
    )
    if any(s.get("oldest_low_priority_s") for s in samples):
        ax_client.plot(
            x,
            series("oldest_low_priority_s"),
            label="oldest low-priority request in flight (s)",
            color="tab:purple",
            lw=2,
        )
    ax_client.set_ylabel("client")
    ax_client.set_xlabel("seconds")

    for name, start, end in history.phase_spans():
        if end < t0 or start > t_end:
            continue
        colour = _PHASE_COLOURS[[n for n, _, _ in history.phase_spans()].index(name) % 5]
        for ax in axes:
            ax.axvspan(max(start, t0) - t0, min(end, t_end) - t0, color=colour, zorder=0, lw=0)
        ax_kv.text(
            max(start, t0) - t0 + 1, 101, name, fontsize=9, va="bottom", ha="left", clip_on=False
        )

    events = [e for e in _events(executions) if t0 <= e[0] <= t_end]
    span = max(t_end - t0, 1.0)
    for n, (t, colour, label) in enumerate(events):
        for ax in axes:
            ax.axvline(t - t0, color=colour, lw=1.2, ls="--" if colour == "tab:red" else "-")
        right = (t - t0) / span > 0.7  # labels near the right edge hang to the left
        ax_client.annotate(
            label,
            xy=(t - t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3 if right else 3, -10 - 11 * (n % 6)),
            textcoords="offset points",
            fontsize=7,
            color=colour,
            va="top",
            ha="right" if right else "left",
        )
    for ax in (ax_kv, ax_pre):
        ax.legend(loc="upper left", fontsize=8, framealpha=0.8)
    # The event labels hang from the top of this panel: the legend goes below.
    ax_client.legend(loc="lower right", fontsize=8, framealpha=0.8)
    handles, labels = ax_knobs.get_legend_handles_labels()
    h2, l2 = ax_seqs.get_legend_handles_labels()
    ax_knobs.legend(handles + h2, labels + l2, loc="upper left", fontsize=8, framealpha=0.8)
    ax_client.set_xlim(0, max(x[-1], 1))
    fig.suptitle(title)
    fig.text(
        0.01,
        0.005,
        "dashed red: finding fired → runbook chosen; blue: action applied; "
        "green: verification done; purple: revert",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
