"""Durations: the one parser and the one formatter (PromQL, refusal messages, rule tests)."""

from __future__ import annotations

import pytest
from vllm_runbook.rules.durations import format_duration, parse_duration
from vllm_runbook.rules.errors import DurationError


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-3, "0s"),
        (0.0004, "0s"),  # below the millisecond Prometheus resolves
        (0.5, "500ms"),
        (1, "1s"),
        (59, "59s"),
        (61, "1m1s"),
        (90, "1m30s"),
        (1.5, "1s500ms"),
        (600, "10m"),
        (3600, "1h"),
        (3725, "1h2m5s"),
        (86400, "24h"),  # hours are the largest unit written
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.001, 0.5, 1, 59, 61, 90, 1.5, 600, 3725, 86400, 90061.25])
def test_format_then_parse_is_exact(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), (" 2d ", 172800.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (10, "bad duration 10: give a unit, e.g. '10s'"),
        (True, "bad duration True: expected a string like '30s', '5m', '1h'"),
        ("5 minutes", "bad duration '5 minutes': expected e.g. '30s', '5m', '1h30m'"),
        ("1m1h", "bad duration '1m1h': expected e.g. '30s', '5m', '1h30m'"),
        ("0s", "bad duration '0s': must be positive"),
        ("", "bad duration '': expected e.g. '30s', '5m', '1h30m'"),
    ],
)
def test_bad_durations(value: object, message: str) -> None:
    with pytest.raises(DurationError) as info:
        parse_duration(value)
    assert info.value.message == message
