"""Human reports and notification texts, rendered from Jinja2 templates.

Templates live in `runbooks/templates/*.j2` and are rendered in a
`SandboxedEnvironment`: alert labels and annotations come from whoever can
post to Alertmanager, and notification templates may later come from the
operator's config. The context holds only plain data (dicts, lists, strings,
numbers: `ExecutionRecord.to_dict()` and stringified labels), never live
objects, so there is nothing behind an attribute to reach; the sandbox
refuses private and dunder attributes on top of that. Values are inserted as
text and never evaluated, so `{{ ''.__class__ }}` in a label stays literal.
Autoescape is off: the output is plain text, not HTML (the page's template is
autoescaped HTML, service/page.py). A notification is escaped for its
receiver instead: every `{{ value }}` becomes one line (control characters,
line and bidi-override characters replaced by a space; capped), and for Slack
`&`, `<`, `>` become entities, so an alert label can add no line, mention
(`<!channel>`) or link (`<https://…|Approve>`) to the message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from jinja2 import FileSystemLoader, StrictUndefined
from jinja2.sandbox import SandboxedEnvironment
from vllm_runbook.runbooks.store import ExecutionRecord

TEMPLATES_DIR: Final = Path(__file__).resolve().parent.parent / "templates"
REPORT_TEMPLATE: Final = "report.txt.j2"
NOTIFICATION_TEMPLATE: Final = "notification.txt.j2"
# C0/C1 controls (newlines, tabs, escapes), line/paragraph separators and the
# bidi embeddings/overrides/isolates that reorder what a reader sees.
_NOT_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]+")
MAX_VALUE_CHARS: Final = 1000  # per value in a notification; the journal keeps it whole
PLAIN: Final = "plain"  # the webhook receiver's `text`
SLACK: Final = "slack"  # Slack's `text` (mrkdwn: entities for & < >)


def format_value(value: Any) -> str:
    """Compact, stable text for a knob or signal value."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def format_signal(name: str, value: Any) -> str:
    """A signal's value for people: a `*_time` signal (Unix seconds) as a UTC clock time."""
    if name.endswith("_time") and isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC).strftime("%H:%M:%S.%f")[:-3] + " UTC"
    return format_value(value)


def format_guards(verification: Mapping[str, Any]) -> str:
    """`oom_rate 0.5 → 0 (ok); error_rate unavailable: before: why`: each guard
    with its before and after, or why it could not be read."""
    parts = []
    for guard, row in (verification.get("guards") or {}).items():
        if not isinstance(row, Mapping):
            continue
        outcome = str(row.get("outcome", "-"))
        if row.get("required"):
            guard = f"{guard} (required)"
        if outcome.startswith("unavailable"):
            parts.append(f"{guard} {outcome}")
        else:
            before = format_signal(guard, row.get("before"))
            after = format_signal(guard, row.get("after"))
            parts.append(f"{guard} {before} → {after} ({outcome})")
    return "; ".join(parts)


def format_verification(v: Mapping[str, Any], parenthesized: bool = False) -> str:
    """`signal before → after: outcome [after: from step N, over S s]`; a side
    not read shows `unavailable` and the outcome says why (`unverified: …`)."""
    signal = str(v.get("signal", ""))
    sides = [
        "unavailable" if v.get(k) is None else format_signal(signal, v.get(k))
        for k in ("before", "after")
    ]
    outcome = f" ({v.get('outcome')})" if parenthesized else f": {v.get('outcome')}"
    where = []
    if v.get("from_step") is not None:
        where.append(f"after: from step {v['from_step']}")
    if isinstance(v.get("measured_seconds"), int | float):
        where.append(f"over {v['measured_seconds']:.0f} s")
    tail = f" [{', '.join(where)}]" if where else ""
    pilot = v.get("autopilot")
    if isinstance(pilot, Mapping) and pilot.get("max_num_seqs") is not None:
        # Handed over: where the autopilot had it when the run was judged.
        tail += f"; autopilot at max_num_seqs {pilot['max_num_seqs']}"
    slo = v.get("slo")
    if isinstance(slo, Mapping):
        # An SLO's alert started it: before is the rate that alert fired at.
        tail += f"; SLO {slo.get('name')}: before = the {slo.get('alert_burn_rate')}x alert's rate"
    return f"{signal} {sides[0]} → {sides[1]}{outcome}{tail}"


def _check_now(check: Mapping[str, Any]) -> str:
    if check.get("value") is None and check.get("unavailable"):
        return f"unavailable: {check['unavailable']}"
    return format_signal(str(check.get("signal", "")), check.get("value"))


def format_episode_span(episode: Mapping[str, Any]) -> str:
    """`over 312 s (95 one-second samples)`: the span a check's peak and mean cover."""
    text = f"over {format_value(episode.get('seconds'))} s"
    if isinstance(episode.get("kept_seconds"), int | float):
        text += f" (samples reach back {episode['kept_seconds']:.0f} s)"
    return text


def format_check(check: Mapping[str, Any]) -> str:
    """A check's value now, or `unavailable: why`; with the episode's peak and mean
    beside it where the journal has them (`0 now; peak 812, mean 430 over 312 s`),
    or why they could not be read: a reading between two waves is never alone."""
    episode = check.get("episode")
    if not isinstance(episode, Mapping) and not check.get("episode_unavailable"):
        return _check_now(check)  # a knob, a windowed rate, a journal from before
    if check.get("value") is None and check.get("unavailable"):
        now = f"unavailable now: {check['unavailable']}"
    else:
        now = _check_now(check) + " now"
    if not isinstance(episode, Mapping):
        return f"{now}; peak/mean unavailable: {check['episode_unavailable']}"
    signal = str(check.get("signal", ""))
    peak = format_signal(signal, episode.get("peak"))
    mean = format_signal(signal, episode.get("mean"))
    return f"{now}; peak {peak}, mean {mean} {format_episode_span(episode)}"


def format_table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    cells = [[str(h) for h in headers], *[[format_value(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def format_warmup(w: Mapping[str, Any]) -> str:
    """A warm-up step's result: what was sent and what came back."""
    shape = f"{w.get('prompt_tokens')}+{w.get('output_tokens')} tokens"
    if not w.get("sent"):
        return f"would send {w.get('requests')} requests of {shape} to {w.get('api')}"
    text = (
        f"sent {w['sent']} requests of {shape} to {w.get('api')}: "
        f"{w.get('succeeded')} ok, {w.get('failed')} failed in {format_value(w.get('seconds'))} s"
    )
    if w.get("first_error"):
        text += f" (first error: {w['first_error']})"
    return text


def format_change(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str:
    """`knob: before → after` for every knob either side mentions."""
    before, after = before or {}, after or {}
    if not before and isinstance(after.get("warmup"), Mapping):
        return format_warmup(after["warmup"])
    keys = list(before) + [k for k in after if k not in before]
    if not keys:
        return "-"
    return ", ".join(
        f"{k}: {format_value(before.get(k))} → {format_value(after.get(k))}" for k in keys
    )


def one_line(value: object) -> str:
    """`value` as one line of text: controls and separators become a space, capped."""
    text = _NOT_ONE_LINE.sub(" ", str(value))
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def slack_escape(text: str) -> str:
    """Slack's escaping of message text: its only control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# What a notification's every `{{ value }}` goes through, per receiver format.
NOTIFICATION_ESCAPES: Final[dict[str, Callable[[object], str]]] = {
    PLAIN: one_line,
    SLACK: lambda value: slack_escape(one_line(value)),
}


def make_environment(
    loader_dir: Path = TEMPLATES_DIR, finalize: Callable[[object], str] | None = None
) -> SandboxedEnvironment:
    """`finalize`: applied to every `{{ value }}` (a notification's escaping)."""
    env = SandboxedEnvironment(
        loader=FileSystemLoader(str(loader_dir)),
        autoescape=False,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=finalize,
    )
    env.filters["value"] = format_value
    env.filters["signal"] = lambda value, name: format_signal(str(name), value)
    env.filters["table"] = format_table
    env.filters["change"] = format_change
    return env


_ENV: SandboxedEnvironment | None = None
_NOTIFICATION_ENVS: dict[str, SandboxedEnvironment] = {}


def _environment() -> SandboxedEnvironment:
    global _ENV
    if _ENV is None:
        _ENV = make_environment()
    return _ENV


def _notification_environment(receiver_format: str) -> SandboxedEnvironment:
    env = _NOTIFICATION_ENVS.get(receiver_format)
    if env is None:
        env = make_environment(finalize=NOTIFICATION_ESCAPES[receiver_format])
        _NOTIFICATION_ENVS[receiver_format] = env
    return env


def untrusted_text(mapping: Mapping[Any, Any] | None) -> dict[str, str]:
    """Alert labels/annotations as plain str → str (no objects reach a template)."""
    return {str(k): str(v) for k, v in (mapping or {}).items()}


def _context(execution: ExecutionRecord | Mapping[str, Any]) -> dict[str, Any]:
    data = execution.to_dict() if isinstance(execution, ExecutionRecord) else dict(execution)
    checks = data.get("checks") or {}
    data["check_rows"] = [
        (
            name,
            (c or {}).get("value")
            if (c or {}).get("value") is not None or not (c or {}).get("unavailable")
            else f"unavailable: {c['unavailable']}",
            (c or {}).get("signal", ""),
            (c or {}).get("description", ""),
        )
        if isinstance(c, Mapping)
        else (name, c, "", "")
        for name, c in checks.items()
    ]
    data["check_episode"] = episode_view(checks)
    # A notification lists the checks once they carry the episode (journals from
    # before it: none, as before).
    data["check_lines"] = (
        [
            (name, format_check(c if isinstance(c, Mapping) else {"value": c}))
            for name, c in checks.items()
        ]
        if data["check_episode"]["rows"]
        else []
    )
    v = data.get("verification") or {}
    data["guard_rows"] = [
        (
            guard,
            format_signal(guard, (row or {}).get("before")),
            format_signal(guard, (row or {}).get("after")),
            (row or {}).get("outcome", "-")
            + (" (required)" if (row or {}).get("required") else ""),
        )
        for guard, row in (v.get("guards") or {}).items()
        if isinstance(row, Mapping)
    ]
    data["step_rows"] = [
        (s["ordinal"], s["action"], s["status"], format_change(s["before"], s["after"]), s["error"])
        for s in data.get("steps") or []
    ]
    return data


def episode_view(checks: Mapping[str, Any] | None) -> dict[str, Any]:
    """The checks with their peak and mean, for the report and the page: `rows`
    (check, now, peak, mean, signal, description), `span` (what the peaks and means
    cover) and `notes` (why some could not be read, once per reason). Journals from
    before the episode have none: `rows` is empty and a template keeps its plain table."""
    rows: list[tuple[Any, ...]] = []
    span: str | None = None
    unread: dict[str, list[str]] = {}
    for name, c in (checks or {}).items():
        c = c if isinstance(c, Mapping) else {"value": c}
        signal = str(c.get("signal", ""))
        episode = c.get("episode")
        peak = mean = None
        if isinstance(episode, Mapping):
            peak, mean = (format_signal(signal, episode.get(k)) for k in ("peak", "mean"))
            span = span or format_episode_span(episode)
        elif c.get("episode_unavailable"):
            unread.setdefault(str(c["episode_unavailable"]), []).append(str(name))
        rows.append((name, _check_now(c), peak, mean, signal, c.get("description", "")))
    if span is None and not unread:
        rows = []
    notes = [f"{', '.join(names)}: {why}" for why, names in unread.items()]
    return {"rows": rows, "span": span, "notes": notes}


def render_report(execution: ExecutionRecord | Mapping[str, Any]) -> str:
    """The human report of one execution: checks, before → after per step, verification."""
    return _environment().get_template(REPORT_TEMPLATE).render(e=_context(execution))


def render_notification(
    execution: ExecutionRecord | Mapping[str, Any],
    *,
    alert_name: str | None = None,
    labels: Mapping[Any, Any] | None = None,
    annotations: Mapping[Any, Any] | None = None,
    event: str | None = None,
    link: str | None = None,
    receiver_format: str = PLAIN,
    key: str | None = None,
) -> str:
    """A short text for chat/pager about an execution and the alert behind it;
    `event` (e.g. "awaiting approval") replaces the status in the first line.
    `receiver_format`: PLAIN or SLACK, how each value is escaped (module doc);
    `key` (the event's, the same in every delivery of it) ends the text."""
    return (
        _notification_environment(receiver_format)
        .get_template(NOTIFICATION_TEMPLATE)
        .render(
            e=_context(execution),
            alert_name=None if alert_name is None else str(alert_name),
            labels=untrusted_text(labels),
            annotations=untrusted_text(annotations),
            event=event,
            link=link,
            key=key,
        )
    )


def render_string(source: str, **context: Any) -> str:
    """Render an operator-supplied template string in the same sandbox."""
    return _environment().from_string(source).render(**context)
