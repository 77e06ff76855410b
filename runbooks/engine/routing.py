"""Where an engine is routed: the binding the router actions act on
(engine/router.py) and the action context carries (engine/operations.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterBinding:
    """Where an engine is routed (the inventory's `router:` of one engine)."""

    url: str
    """The router's base URL (its admin API)."""
    worker: str
    """This engine as the router knows it: its vLLM API server URL."""
    fleet: tuple[str, ...] = ()
    """Every worker the inventory puts behind this router (this one included):
    those missing from the router's list are drained."""
    restart: tuple[str, ...] = ()
    """The restart hook: a command (argv), run with VLLM_RUNBOOK_WORKER_URL set;
    empty: no hook."""
