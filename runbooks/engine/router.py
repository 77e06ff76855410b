"""The engine's router: take an engine out of rotation, put it back, restart it.

A stuck engine answers `/health` with 200, so the router keeps sending it
traffic; the remediation is at the router. The router here is vllm-router
(vLLM's router, derived from SGLang's), whose admin API registers and
removes workers at runtime (verified against vllm-router 0.1.17's binary):

    GET  /list_workers             {"urls": [URL, ...]}
    GET  /workers                  {"workers": [{"url", "model_id", "is_healthy", ...}]}
    POST /add_worker?url=URL       200 "Successfully added worker: URL"
    POST /remove_worker?url=URL    200 "Successfully removed worker: URL"

A worker is the engine's vLLM API server URL (the inventory's `vllm:`).
Removing a worker stops new requests to it; requests already proxied to it
go on and are answered when the engine answers them.

The actions (registered like every other, model/actions.py):

    drain            remove the engine from the router, then wait (bounded) for
                     its in-flight requests to finish; refused when it is the
                     last healthy engine of its model at the router, or when
                     `max_drained` engines of the router's fleet are out already
    undrain          add it back (after checking its /health)
    restart_engine   run the configured restart hook (a command), then wait for
                     /health; skipped where no hook is configured
    wait_for_progress  wait until the engine makes progress again (the
                     collector's engine_stalled is 0 and steps move, or it idles)

`drain` journals `{"routed": true}` as its before-value: `undo_drain`
(called by a revert, run/revert.py) puts such an engine back.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import httpx
from pydantic import Field
from vllm_runbook.runbooks.engine.client import normalize_url
from vllm_runbook.runbooks.engine.operations import ActionContext, ActionOutcome
from vllm_runbook.runbooks.engine.routing import RouterBinding
from vllm_runbook.runbooks.model.actions import ActionError, ActionParams, action

if TYPE_CHECKING:
    from vllm_runbook.rules.config import EngineConfig

__all__ = [
    "Drain",
    "RestartEngine",
    "RouterBinding",
    "RouterError",
    "Undrain",
    "VllmRouter",
    "WaitForProgress",
    "drain",
    "restart_engine",
    "router_bindings",
    "undo_drain",
    "undrain",
    "wait_for_progress",
]


class RouterError(ActionError):
    """The router refused, could not be reached, or a guard refused the action."""


@dataclass
class VllmRouter:
    """vllm-router's admin API."""

    url: str
    timeout: float = 10.0
    transport: httpx.BaseTransport | None = field(default=None, repr=False)

    def _call(self, method: str, path: str, **params: str) -> httpx.Response:
        try:
            with httpx.Client(timeout=self.timeout, transport=self.transport) as client:
                response = client.request(method, self.url.rstrip("/") + path, params=params)
        except httpx.HTTPError as exc:
            raise RouterError(f"router {self.url} unreachable: {exc}") from None
        if response.status_code != 200:
            text = " ".join(response.text.split())[:200]
            raise RouterError(f"router {self.url}{path}: HTTP {response.status_code}: {text}")
        return response

    def workers(self) -> list[str]:
        """The workers in rotation."""
        try:
            return [str(u) for u in self._call("GET", "/list_workers").json()["urls"]]
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.url}/list_workers: not a worker list") from None

    def health(self) -> dict[str, tuple[bool, str]]:
        """Worker -> (healthy as the router sees it, its model id or "unknown")."""
        try:
            rows = self._call("GET", "/workers").json()["workers"]
            return {
                str(w["url"]): (bool(w.get("is_healthy", True)), str(w.get("model_id", "unknown")))
                for w in rows
            }
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.url}/workers: not a worker list") from None

    def add(self, worker: str) -> None:
        self._call("POST", "/add_worker", url=worker)

    def remove(self, worker: str) -> None:
        self._call("POST", "/remove_worker", url=worker)


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


NO_ROUTER = "no router configured for this engine (inventory `router:`)"


def _in_flight(ctx: ActionContext) -> int:
    """Requests the engine holds now (the agent's live queues, not vLLM's gauges,
    which keep the last step's values while the engine is stuck)."""
    stats = ctx.client.state().stats
    return int(stats.requests_running + stats.requests_waiting)


# --- drain ------------------------------------------------------------------------


class Drain(ActionParams):
    """Stop routing to this engine at its router, then wait up to `wait_seconds`
    for its in-flight requests to finish. Never the last healthy engine of its
    model; never more than `max_drained` engines of the router's fleet out at once."""

    wait_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0
    max_drained: Annotated[int, Field(ge=1)] = 1
    # Drain only where a restart follows (memory-leak: a drain without a restart
    # would only move traffic back and forth).
    only_with_restart_hook: bool = False


@action(mutating=True)
def drain(params: Drain, ctx: ActionContext) -> ActionOutcome:
    binding = ctx.router
    if binding is None:
        return ActionOutcome(skipped=NO_ROUTER)
    if params.only_with_restart_hook and not binding.restart:
        return ActionOutcome(skipped="no restart hook configured (router.restart)")
    router = VllmRouter(binding.url)
    routed = router.workers()
    if not any(_same(w, binding.worker) for w in routed):
        return ActionOutcome(skipped=f"{binding.worker} is not in rotation at {binding.url}")
    health = router.health()
    model = next((m for w, (_, m) in health.items() if _same(w, binding.worker)), "unknown")
    others = [
        w
        for w, (healthy, m) in health.items()
        if healthy and not _same(w, binding.worker) and (m == model or "unknown" in (m, model))
    ]
    if not others:
        raise RouterError(
            f"refused: {binding.worker} is the last healthy engine of model {model} "
            f"at {binding.url}; draining it would leave the model unserved"
        )
    drained = [w for w in binding.fleet if not any(_same(w, r) for r in routed)]
    if len(drained) >= params.max_drained:
        raise RouterError(
            f"refused: {len(drained)} engine(s) of this router's fleet are drained already "
            f"({', '.join(drained)}); at most {params.max_drained} at once"
        )
    plan = {"router": binding.url, "worker": binding.worker, "serving": len(others)}
    before = {"routed": True}
    if ctx.dry_run:
        return ActionOutcome(before, {"routed": False}, details=plan)
    ctx.begin(before, plan)
    started = time.monotonic()
    router.remove(binding.worker)
    removed_after = round(time.monotonic() - started, 3)
    in_flight = _in_flight(ctx)
    at_drain = in_flight
    deadline = started + params.wait_seconds
    while in_flight and time.monotonic() < deadline:
        ctx.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        in_flight = _in_flight(ctx)
    after = {
        "routed": False,
        "removed_after_seconds": removed_after,
        "in_flight_at_drain": at_drain,
        # Still in the engine at the bound: a stuck engine answers them once it recovers.
        "in_flight_left": in_flight,
        "drain_seconds": round(time.monotonic() - started, 3),
    }
    return ActionOutcome(before, after, details=plan)


# --- undrain ------------------------------------------------------------------------


class Undrain(ActionParams):
    """Route to this engine again (its /health must answer 200 first)."""


def _healthy(worker: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(worker.rstrip("/") + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def undo_drain(binding: RouterBinding) -> bool:
    """Put a drained engine back; False when it was in rotation already."""
    router = VllmRouter(binding.url)
    if any(_same(w, binding.worker) for w in router.workers()):
        return False
    router.add(binding.worker)
    return True


@action(mutating=True)
def undrain(params: Undrain, ctx: ActionContext) -> ActionOutcome:
    binding = ctx.router
    if binding is None:
        return ActionOutcome(skipped=NO_ROUTER)
    router = VllmRouter(binding.url)
    if any(_same(w, binding.worker) for w in router.workers()):
        return ActionOutcome(skipped=f"{binding.worker} is in rotation at {binding.url}")
    if not _healthy(binding.worker):
        raise RouterError(f"{binding.worker}/health does not answer 200: left drained")
    before = {"routed": False}
    plan = {"router": binding.url, "worker": binding.worker}
    if ctx.dry_run:
        return ActionOutcome(before, {"routed": True}, details=plan)
    ctx.begin(before, plan)
    router.add(binding.worker)
    return ActionOutcome(before, {"routed": True}, details=plan)


# --- restart ------------------------------------------------------------------------


class RestartEngine(ActionParams):
    """Run the engine's restart hook (the inventory's `router.restart` command)
    and wait up to `timeout_seconds` for its /health; skipped where none is set."""

    timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 600.0


def run_hook(
    command: Sequence[str], worker: str, timeout: float, run: Callable[..., Any] = subprocess.run
) -> None:
    env = {**os.environ, "VLLM_RUNBOOK_WORKER_URL": worker}
    try:
        done = run(list(command), env=env, timeout=timeout, capture_output=True, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RouterError(f"restart hook {command[0]!r} failed: {exc}") from None
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout or "").split())[-200:]
        raise RouterError(f"restart hook {command[0]!r} exited {done.returncode}: {tail}")


@action(mutating=True)
def restart_engine(params: RestartEngine, ctx: ActionContext) -> ActionOutcome:
    """Nothing to revert: a restart's before-value says only that it ran."""
    binding = ctx.router
    if binding is None:
        return ActionOutcome(skipped=NO_ROUTER)
    if not binding.restart:
        return ActionOutcome(skipped="no restart hook configured (router.restart)")
    plan = {"hook": list(binding.restart), "worker": binding.worker}
    before = {"restarted": False}
    if ctx.dry_run:
        return ActionOutcome(before, {"restarted": True}, details=plan)
    ctx.begin(before, plan)
    started = time.monotonic()
    run_hook(binding.restart, binding.worker, params.timeout_seconds)
    while not _healthy(binding.worker):
        if time.monotonic() - started > params.timeout_seconds:
            raise RouterError(
                f"{binding.worker}/health did not answer 200 within {params.timeout_seconds:g} s"
            )
        ctx.wait(1.0)
    seconds = round(time.monotonic() - started, 3)
    return ActionOutcome(before, {"restarted": True, "seconds": seconds}, details=plan)


# --- wait for progress ----------------------------------------------------------------


class WaitForProgress(ActionParams):
    """Wait up to `timeout_seconds` until the engine makes progress again: the
    collector's engine_stalled is 0 and its scheduler steps move (or it idles)."""

    timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 300.0


@action(mutating=False)
def wait_for_progress(params: WaitForProgress, ctx: ActionContext) -> ActionOutcome:
    started = time.monotonic()
    first = ctx.client.state().stats
    while True:
        stats = ctx.client.state().stats
        idle = stats.requests_running + stats.requests_waiting == 0
        if not stats.engine_stalled and (idle or stats.steps_total > first.steps_total):
            waited = round(time.monotonic() - started, 3)
            return ActionOutcome(
                after={
                    "progress": {
                        "waited_seconds": waited,
                        "steps": int(stats.steps_total - first.steps_total),
                        "idle": idle,
                    }
                }
            )
        if time.monotonic() - started > params.timeout_seconds:
            raise RouterError(
                f"no progress within {params.timeout_seconds:g} s "
                f"(stall reason: {stats.stall_reason or 'none'}): the engine stays drained"
            )
        ctx.wait(0.5)


def router_bindings(engines: Sequence[EngineConfig]) -> dict[str, RouterBinding]:
    """Agent URL -> its router binding, for the inventory's engines that have a
    router and a `vllm:` URL; each router's fleet is every such engine behind it."""
    routed = [e for e in engines if e.router is not None and e.vllm]
    fleets: dict[str, list[str]] = {}
    for e in routed:
        assert e.router is not None and e.vllm
        fleets.setdefault(e.router.url, []).append(e.vllm)
    bindings: dict[str, RouterBinding] = {}
    for e in routed:
        assert e.router is not None and e.vllm
        bindings[normalize_url(e.agent)] = RouterBinding(
            e.router.url, e.vllm, tuple(fleets[e.router.url]), tuple(e.router.restart)
        )
    return bindings
