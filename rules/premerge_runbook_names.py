"""TRANSITIONAL, deleted when `load_config(path, *, runbooks=...)` is merged.

rules/config.py still checks `automation:` keys against this list until the
configuration loader takes the deployed runbook catalog's names (`runbooks=`)
instead; nothing else may import it (tests/unit/test_catalogs_agree.py checks
that it is the shipped runbook catalog's names while it exists).
"""

from __future__ import annotations

RUNBOOK_NAMES: tuple[str, ...] = (
    "oom-pressure",
    "latency-spike",
    "throughput-drop",
    "batch-too-large",
    "kv-hit-low",
    "warmup",
    "memory-leak",
    "restore",
)
