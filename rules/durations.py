"""Prometheus durations (``30s``, ``5m``, ``1h30m``, ``500ms``) to seconds and back."""

from __future__ import annotations

import re

from vllm_runbook.rules.errors import DurationError

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
# Units in descending size, each at most once, like Prometheus' own parser.
_DURATION = re.compile(
    r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$"
)
_ORDER = ("y", "w", "d", "h", "m", "s", "ms")


def parse_duration(text: object) -> float:
    """Seconds in `text`; raises DurationError (no location: the caller adds it)."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise DurationError(f"bad duration {text!r}: expected a string like '30s', '5m', '1h'")
    if isinstance(text, int | float):
        # A bare number is ambiguous (seconds? minutes?): Prometheus rejects it too.
        raise DurationError(f"bad duration {text!r}: give a unit, e.g. '{text}s'")
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None:
        raise DurationError(f"bad duration {text!r}: expected e.g. '30s', '5m', '1h30m'")
    seconds = sum(int(g) * _UNITS[u] for g, u in zip(match.groups(), _ORDER, strict=True) if g)
    if seconds <= 0:
        raise DurationError(f"bad duration {text!r}: must be positive")
    return float(seconds)


def format_duration(seconds: float) -> str:
    """The shortest exact Prometheus spelling of `seconds` (``90`` -> ``1m30s``).

    The one duration formatter: PromQL windows and `for:` (Prometheus parses
    them back, so exact to the millisecond), and times shown to people (the
    executor's refusals round up to whole seconds first: ``9m58s``)."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    out = []
    for unit in ("h", "m", "s"):
        size = int(_UNITS[unit] * 1000)
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    if ms:
        out.append(f"{ms}ms")
    return "".join(out)
