"""Argument types shared by the `runbook` commands: numbers checked at the door.

argparse turns an `ArgumentTypeError` into `argument --NAME: MESSAGE`, which
`main` prints as one line with exit code USAGE. Non-finite values (nan, inf)
are refused like negative ones: a NaN compares false with every bound and
would slip through a plain `value < 0` check.
"""

from __future__ import annotations

import argparse
import math


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def non_negative_seconds(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value
