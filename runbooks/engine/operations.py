"""The catalog's actions, implemented against the engine agent, and the signals they read.

Each action is a parameters model and a function registered with `@action`
(`vllm_runbook.runbooks.model.actions`); `engine_registry()` returns the registry
they fill: actions through the agent, and warm-up through the engine's vLLM
API server (`vllm_runbook.runbooks.engine.warmup`). An action is a plain
function `fn(params, ctx) -> ActionOutcome`: `ctx` carries the agent client,
a fresh `/v1/state`, the dry-run flag and `ctx.begin(before, details)`, which
the executor turns into a journal row *committed before the action touches
the engine* (crash safety: a SIGKILL after `begin` leaves the values to
restore). Mutating actions call `begin` exactly once, right before the
write; an action that finds nothing to change returns `skipped` instead.

`SignalReader` turns `/v1/state` into the signals a runbook may read
(`vllm_runbook.rules.signals`, sources in `vllm_runbook.runbooks.engine.sources`). A
signal that cannot be read on this engine (no GPU, no finished request yet)
reads None and `SignalReader.unavailable` says why: the executor reports it
rather than guessing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

from pydantic import Field
from vllm_runbook.collector.agent_api import (
    KNOBS,
    AgentState,
    ChangeResult,
    DrainingSince,
    SettledSince,
)
from vllm_runbook.rules.slo import SloSpec, series_of, slo_counts
from vllm_runbook.runbooks.engine.client import Agent
from vllm_runbook.runbooks.engine.routing import RouterBinding
from vllm_runbook.runbooks.engine.sources import (
    NO_SLO,
    SLO_BURN_RATE,
    WINDOWED,
    api_signals,
    kv_capacity_seqs,
    signals_from_state,
    since_signals,
    unavailable,
)
from vllm_runbook.runbooks.model.actions import (
    ActionParams,
    ActionRegistry,
    action,
    catalog_registry,
)

# --- signals -----------------------------------------------------------------------


@dataclass
class SignalReader:
    """Reads signals from an engine agent; keeps the last read for rates."""

    client: Agent
    clock: Callable[[], float] = time.monotonic
    # The engine's vLLM API server: its /metrics gives what only it knows.
    api_url: str | None = None
    last_state: AgentState | None = None
    # Signal -> why it could not be read at the latest read.
    unavailable: dict[str, str] = field(default_factory=dict)
    _previous: tuple[float, float] | None = field(default=None, repr=False)
    # The SLO whose burn-rate alert started this execution (signal slo_burn_rate):
    # its (bad, all) counts at the first read after the change took effect.
    slo: SloSpec | None = None
    _slo_mark: tuple[float, float] | None = field(default=None, repr=False)

    def read(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> dict[str, Any]:
        """Fresh signals (raises the client's errors when the agent is down).

        With `since_step` (the step a change took effect from), the windowed
        signals (rates, ratios, percentiles over finished requests) are
        measured from that step on only; `last_since` holds the agent's raw
        answer (None when it kept no mark for that step). `episode_seconds`:
        the span `last_state.episode` covers (the checks' peak and mean;
        default the collector's window)."""
        state = self.client.state(since_step=since_step, episode_seconds=episode_seconds)
        now = self.clock()
        self.last_state = state
        signals = signals_from_state(state)
        scheduled = state.stats.scheduled_tokens_total
        if self._previous is not None:
            then, before = self._previous
            if now > then:
                signals["scheduled_tokens_per_second"] = (scheduled - before) / (now - then)
        self._previous = (now, float(scheduled))
        post_change: dict[str, str] = {}
        if since_step is not None:
            # Windowed signals come only from the change's step on, never from
            # the trailing window (which still holds the time before it).
            since = state.since
            for name in WINDOWED:
                signals[name] = None
            if since is None:
                why = f"the agent kept no measurement from step {since_step}"
                post_change = dict.fromkeys(WINDOWED, why)
            elif isinstance(since, DrainingSince):
                why = (
                    f"not in effect yet: {since.requests_running} running > "
                    f"max_num_seqs {since.max_num_seqs} (draining)"
                )
                post_change = dict.fromkeys(WINDOWED, why)
            else:
                signals.update(since_signals(since))
        api_why = None
        burn_why: dict[str, str] = {}
        if self.api_url:
            text, values, api_unavailable = self._read_api()
            signals.update(values)
            api_why = next(iter(api_unavailable.values()), None)
            if text is not None and self.slo is not None:
                settled = since_step is not None and isinstance(state.since, SettledSince)
                burn, reason = self._burn_rate(text, since_step, settled)
                signals[SLO_BURN_RATE] = burn
                if reason is not None:
                    burn_why[SLO_BURN_RATE] = reason
        if self.slo is None:
            burn_why[SLO_BURN_RATE] = NO_SLO
        self.unavailable = {**unavailable(state, signals, api_why), **burn_why, **post_change}
        return signals

    def _burn_rate(
        self, text: str, since_step: int | None, settled: bool
    ) -> tuple[float | None, str | None]:
        """The SLO's burn rate from the change on: (Δbad / Δall) / (1 - target)
        between the first read after the change took effect and this one."""
        assert self.slo is not None
        counts = slo_counts(self.slo, text)
        if counts is None:
            return None, f"the API server's /metrics has no {series_of(self.slo.objective)}"
        if since_step is None:
            return None, "measured from the change on (before: the alert's burn rate)"
        if not settled:
            return None, "the change is not in effect yet"
        if self._slo_mark is None:
            self._slo_mark = counts
            return None, "the change took effect at this read: measured from it on"
        bad = counts[0] - self._slo_mark[0]
        total = counts[1] - self._slo_mark[1]
        if total <= 0:
            return None, "no request finished since the change took effect"
        return (bad / total) / self.slo.budget, None

    def _read_api(self) -> tuple[str | None, dict[str, Any], dict[str, str]]:
        import httpx

        url = f"{str(self.api_url).rstrip('/')}/metrics"
        try:
            response = httpx.get(url, timeout=self.client.timeout)
            response.raise_for_status()
            return response.text, *api_signals(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            return None, {}, {"http_error_rate": f"cannot read {url}: {exc}"}

    @property
    def settled(self) -> bool:
        """Whether the change asked about at the latest read is in effect."""
        return isinstance(self.last_since, SettledSince)

    @property
    def last_since(self) -> SettledSince | DrainingSince | None:
        return None if self.last_state is None else self.last_state.since


# --- action plumbing ---------------------------------------------------------------


@dataclass
class ActionContext:
    """What an action gets besides its parameters."""

    client: Agent
    # /v1/state read just before this step.
    state: AgentState
    dry_run: bool
    # Record the before-values (and resolved details) in the journal; must be
    # called before the engine is touched. The executor commits it at once.
    begin: Callable[[dict[str, Any], dict[str, Any]], None]
    # The engine's vLLM API server (warm-up requests go there), when known.
    api_url: str | None = None
    # Sleeps (the executor's: a fake clock in tests, the engine lock kept alive).
    wait: Callable[[float], None] = time.sleep
    # Where the engine is routed (drain, undrain, restart: engine/router.py), when known.
    router: RouterBinding | None = None


@dataclass(frozen=True)
class ActionOutcome:
    """What an action did (or, in a dry run, would do)."""

    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    # The engine's first scheduler step with the new values.
    applied_at_step: int | None = None
    # Resolved parameters worth keeping (e.g. the kv_capacity number used).
    details: dict[str, Any] = field(default_factory=dict)
    # Set when there was nothing to do: the step is journaled as skipped.
    skipped: str | None = None
    clamped: tuple[dict[str, Any], ...] = ()


def _set_knobs(
    ctx: ActionContext,
    request: dict[str, Any],
    touched: tuple[str, ...],
    details: dict[str, Any],
    clamp: bool = False,
) -> ActionOutcome:
    """The write path shared by the knob actions: journal, then one POST /v1/knobs."""
    before = _values(ctx.state.knobs, touched)
    if ctx.dry_run:
        result = ctx.client.set_knobs(clamp=clamp, dry_run=True, **request)
        return ActionOutcome(
            before,
            _values(result.would_be or result.after, touched),
            None,
            details,
            clamped=_clamped(result),
        )
    ctx.begin(before, details)
    result = ctx.client.set_knobs(clamp=clamp, **request)
    return ActionOutcome(
        _values(result.before, touched),
        _values(result.after, touched),
        result.effective_from_step,
        details,
        clamped=_clamped(result),
    )


def _values(knobs: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The named knobs' values (as the journal keeps them)."""
    return {k: getattr(knobs, k) for k in names}


def _clamped(result: ChangeResult) -> tuple[dict[str, Any], ...]:
    return tuple(c.model_dump() for c in result.clamped)


# --- the actions -------------------------------------------------------------------
# Each is its parameters model and an `@action` function taking it
# (vllm_runbook.runbooks.model.actions); send_warmup_requests is in
# vllm_runbook.runbooks.engine.warmup.


class ScaleMaxNumBatchedTokens(ActionParams):
    """Multiply the token budget; never above the startup value, never below the floors."""

    factor: Annotated[float, Field(gt=0, le=1)]
    # Stop at the floor (as the docstring promises) rather than fail the step
    # when the factor would cross it; false makes crossing a floor an error.
    clamp: bool = True


@action(mutating=True, knobs=("max_num_batched_tokens",))
def scale_max_num_batched_tokens(
    params: ScaleMaxNumBatchedTokens, ctx: ActionContext
) -> ActionOutcome:
    """Multiply the budget; the agent applies the floors and the startup ceiling."""
    return _set_knobs(
        ctx,
        {"scale_max_num_batched_tokens": params.factor},
        ("max_num_batched_tokens",),
        {},
        clamp=params.clamp,
    )


# Reads of the KV footprint before set_max_num_seqs(kv_capacity) gives up.
KV_CAPACITY_REREADS: Final = 10
KV_CAPACITY_REREAD_SECONDS: Final = 0.2


class SetMaxNumSeqs(ActionParams):
    """Cap running sequences; 'kv_capacity' = what the KV cache holds at the
    current average footprint (computed from the block pool), times headroom."""

    value: Annotated[int, Field(ge=1)] | Literal["kv_capacity"]
    # With 'kv_capacity': admit this fraction of it. When preemption starts
    # the cache is full, so the capacity at the current footprint equals the
    # running count and capping there changes nothing (measured on the tiny
    # CPU model: 37 -> 37 preemptions); running sequences keep growing, so by
    # default admit half (32 -> 16 -> 8 seqs measured 37 -> 12 -> 0).
    headroom: Annotated[float, Field(gt=0, le=1)] = 0.5
    clamp: bool = False


@action(mutating=True, knobs=("max_num_seqs",))
def set_max_num_seqs(params: SetMaxNumSeqs, ctx: ActionContext) -> ActionOutcome:
    """Lower the admission limit, to a number or to the KV capacity now."""
    current = ctx.state.knobs.max_num_seqs
    details: dict[str, Any] = {}
    if params.value == "kv_capacity":
        capacity = kv_capacity_seqs(ctx.state.stats)
        for _ in range(KV_CAPACITY_REREADS):
            if capacity is not None:
                break
            # In a preemption storm a step can preempt every running request
            # (vLLM admits none in a step that preempted): the read between two
            # such steps sees nothing running. Measured on a served CPU engine:
            # that one read skipped the cap and left the storm going.
            ctx.wait(KV_CAPACITY_REREAD_SECONDS)
            ctx.state = ctx.client.state()
            capacity = kv_capacity_seqs(ctx.state.stats)
            current = ctx.state.knobs.max_num_seqs
        details["kv_capacity_seqs"] = capacity
        if capacity is None:
            return ActionOutcome(
                details=details,
                skipped=(
                    "kv_capacity unknown: no running request held KV blocks in "
                    f"{KV_CAPACITY_REREADS + 1} reads over "
                    f"{KV_CAPACITY_REREADS * KV_CAPACITY_REREAD_SECONDS:g} s"
                ),
            )
        if capacity >= current:
            # Never raise the limit: capacity above it means KV is not the bound.
            return ActionOutcome(
                details=details,
                skipped=f"kv_capacity {capacity} >= max_num_seqs {current}: nothing to lower",
            )
        target = max(1, math.floor(capacity * params.headroom))
        details["target"] = target
        if target >= current:
            return ActionOutcome(
                details=details,
                skipped=f"kv_capacity {capacity} x {params.headroom:g} >= max_num_seqs {current}",
            )
    else:
        target = int(params.value)
    if target == current:
        return ActionOutcome(details=details, skipped=f"max_num_seqs is already {current}")
    return _set_knobs(ctx, {"max_num_seqs": target}, ("max_num_seqs",), details, params.clamp)


class SetPolicy(ActionParams):
    policy: Literal["fcfs", "priority", "tiered"]


@action(mutating=True, knobs=("policy",))
def set_policy(params: SetPolicy, ctx: ActionContext) -> ActionOutcome:
    """Switch the scheduling policy: fcfs, priority, or tiered (hot tier first)."""
    if ctx.state.knobs.policy == params.policy:
        return ActionOutcome(skipped=f"policy is already {params.policy}")
    return _set_knobs(ctx, {"policy": params.policy}, ("policy",), {})


class SetAutopilot(ActionParams):
    """Hand max_num_seqs over to the engine's autopilot (or take it back):
    it keeps preemptions near zero at the most sequences the KV cache holds,
    never above the startup value. `target`: its peak KV usage, (0, 1]."""

    enabled: bool = True
    target: Annotated[float, Field(gt=0, le=1)] | None = None


@action(mutating=True, knobs=("autopilot", "autopilot_target", "max_num_seqs"))
def set_autopilot(params: SetAutopilot, ctx: ActionContext) -> ActionOutcome:
    """Switch the autopilot (a revert switches it back: its before-value is
    journaled like a knob's). The details keep where max_num_seqs was when
    it took over."""
    knobs = ctx.state.knobs
    request: dict[str, Any] = {"autopilot": params.enabled}
    touched: tuple[str, ...] = ("autopilot",)
    if params.target is not None and params.target != knobs.autopilot_target:
        request["autopilot_target"] = params.target
        touched += ("autopilot_target",)
    if knobs.autopilot == params.enabled and len(touched) == 1:
        return ActionOutcome(
            skipped=f"the autopilot is already {'on' if params.enabled else 'off'}"
        )
    details = {"max_num_seqs_at_hand_over": knobs.max_num_seqs} if params.enabled else {}
    if params.enabled:
        # The autopilot moves max_num_seqs while on: journal where it was at the
        # hand-over, so a revert puts it back there, not where the autopilot left it.
        touched += ("max_num_seqs",)
    return _set_knobs(ctx, request, touched, details)


class RestoreKnobs(ActionParams):
    """Put every knob back to the engine's startup value."""


@action(mutating=True, knobs=KNOBS)
def restore_knobs(params: RestoreKnobs, ctx: ActionContext) -> ActionOutcome:
    """Every knob back to its startup value (one command, applied atomically)."""
    knobs, startup = ctx.state.knobs, ctx.state.startup
    before = _values(knobs, KNOBS)
    if knobs == startup:
        return ActionOutcome(skipped="every knob is at its startup value")
    if ctx.dry_run:
        return ActionOutcome(before, _values(startup, KNOBS))
    ctx.begin(before, {})
    result = ctx.client.restore()
    return ActionOutcome(
        _values(result.before, KNOBS),
        _values(result.after, KNOBS),
        result.effective_from_step,
    )


class CaptureDiagnostics(ActionParams):
    """Snapshot the engine's state (metrics, block pool, queues) into the journal."""


@action(mutating=False)
def capture_diagnostics(params: CaptureDiagnostics, ctx: ActionContext) -> ActionOutcome:
    """The whole /v1/state (knobs, bounds, stats, queues per tier, the oldest
    waiting requests) into the journal."""
    keys = {"engine", "knobs", "startup", "bounds", "stats", "gpus", "tiers", "queues"}
    snapshot = ctx.state.model_dump(mode="json", include=keys)
    return ActionOutcome(after={"diagnostics": snapshot})


class Advise(ActionParams):
    """Tell the operator something that needs a person (e.g. a restart)."""

    text: Annotated[str, Field(min_length=1)]


@action(mutating=False)
def advise(params: Advise, ctx: ActionContext) -> ActionOutcome:
    return ActionOutcome(after={"advice": " ".join(params.text.split())})


def engine_registry() -> ActionRegistry:
    """The catalog's actions, every one implemented (the registry `@action` fills)."""
    return catalog_registry()
