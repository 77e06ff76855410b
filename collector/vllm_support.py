"""The vLLM versions the collector is tested with: the compatibility
matrix's last recorded run (vllm_matrix.json, written by `make compat
--write`, see docs/install.md).

`TESTED_VLLM` is the (major, minor) range of the versions that run was green
for. Reading the file never fails: a missing or broken one gives an empty
range, and every vLLM then only logs the out-of-range warning (the collector
still fails open wherever the scheduler differs).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm_runbook.collector")

MATRIX_FILE = Path(__file__).with_name("vllm_matrix.json")
MinorRange = tuple[tuple[int, int], tuple[int, int]]
EMPTY: MinorRange = ((0, 0), (-1, -1))  # low > high: nothing is in it


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; (-1, -1) when it has none."""
    try:
        major, minor_ = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return (-1, -1)
    return (major, minor_)


def load_matrix(path: Path = MATRIX_FILE) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("versions"), list):
            raise ValueError("no versions list")
        return data
    except Exception as exc:
        logger.warning("vllm-runbook: cannot read the tested vLLM versions (%s): %s", path, exc)
        return {"versions": []}


def tested_range(matrix: dict[str, Any]) -> MinorRange:
    """The lowest and highest minor the matrix was green for (EMPTY if none)."""
    green = sorted(
        minor(str(v.get("vllm", "")))
        for v in matrix.get("versions", [])
        if isinstance(v, dict) and v.get("green") is True
    )
    green = [m for m in green if m >= (0, 0)]
    return (green[0], green[-1]) if green else EMPTY


TESTED_VLLM: MinorRange = tested_range(load_matrix())


def describe(tested: MinorRange) -> str:
    """'0.30-0.33' (or 'none' for an empty range)."""
    low, high = tested
    if low > high:
        return "none"
    return f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"
