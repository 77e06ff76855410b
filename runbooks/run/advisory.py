"""Advisory mode: an execution that decides and journals, and never touches the engine.

A runbook in advisory mode (`mode: advisory` in its spec, or the service's
configuration for all) runs as an *advised* execution: a dry run of an
alert's or a rule's execution (`dry_run` and trigger `alert`), shown
"advised". It reads the engine, journals the checks, judges every guard (the
breaker's hold, cooldown, rate, blast radius, required guards, nothing to
improve) and journals the steps as `planned` with the values they would set,
computed from the engine's knobs and bounds on `/v1/state`. The agent's
control endpoints (`/v1/knobs`, `/v1/restore`) are never called, not even
with `dry_run`: `AdvisoryAgent` answers the executor's dry runs itself and
refuses any real write. An advised execution holds nothing, reverts nothing
and is watched by no breaker (they read real executions only).
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import ValidationError
from vllm_runbook.collector.agent_api import (
    KNOBS,
    AgentState,
    ChangeResult,
    KnobsCommand,
    command_error,
    knob_target,
)
from vllm_runbook.runbooks.engine.client import Agent, CommandRefused
from vllm_runbook.runbooks.store.models import is_advised

__all__ = ["WOULD_ACT", "WOULD_REFUSE", "AdvisoryAgent", "is_advised", "would_change"]

# The start of an advised execution's `reason`: what the service would have done.
WOULD_ACT: Final = "advisory: would act"
WOULD_REFUSE: Final = "advisory: would be refused"


class AdvisoryAgent:
    """An `Agent` that reads the engine and writes nothing: a dry run's knob
    change is computed here from `/v1/state` (the agent's own check: the
    knobs' bounds, the budget's floor following max_num_seqs, setting
    max_num_seqs turns the autopilot off); a real write is refused."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    @property
    def url(self) -> str:
        return self.agent.url

    @property
    def timeout(self) -> float:
        return self.agent.timeout

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        return self.agent.state(since_step=since_step, episode_seconds=episode_seconds)

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> ChangeResult:
        if not dry_run:
            raise CommandRefused("advisory mode: nothing is changed on the engine")
        body = {k: v for k, v in values.items() if v is not None}
        try:
            command = KnobsCommand.model_validate({**body, "clamp": clamp, "dry_run": True})
        except ValidationError as exc:
            raise CommandRefused(command_error(exc)) from None
        return would_change(self.agent.state(), command.values(), clamp)

    def restore(self, dry_run: bool = False) -> ChangeResult:
        if not dry_run:
            raise CommandRefused("advisory mode: nothing is changed on the engine")
        state = self.agent.state()
        return _answer(state, state.startup.model_dump(), [])


def would_change(state: AgentState, values: dict[str, Any], clamp: bool) -> ChangeResult:
    """The agent's dry-run answer to a knob change, computed from `state` by the
    agent's own rule (`knob_target`), on the bounds `/v1/state` reports.

    One estimate: the budget's floor for a new max_num_seqs. `/v1/state` shows
    the floor at the max_num_seqs in force, the highest of the engine's fixed
    floors and max_num_seqs; a fixed floor at or below max_num_seqs now (e.g.
    speculative draft slots) is not visible there and is taken as 1."""
    before = state.knobs.model_dump()
    clamped: list[dict[str, Any]] = []
    bounds = state.bounds

    def check(knob: str, value: int, target: dict[str, Any], requested: dict[str, Any]) -> int:
        if knob == "max_num_seqs":
            low, high = bounds.max_num_seqs.min, bounds.max_num_seqs.max
        else:
            # The budget's floor is the highest of the engine's fixed floors and
            # max_num_seqs; a floor above max_num_seqs now is a fixed one.
            tokens = bounds.max_num_batched_tokens
            fixed = tokens.min if tokens.min > before["max_num_seqs"] else 1
            low, high = max(fixed, target["max_num_seqs"]), tokens.max
        return _check(knob, value, low, high, clamp, requested, clamped)

    return _answer(state, knob_target(before, values, check), clamped)


def _check(
    knob: str,
    value: int,
    low: int,
    high: int,
    clamp: bool,
    requested: dict[str, Any],
    clamped: list[dict[str, Any]],
) -> int:
    if low <= value <= high:
        return value
    limit = high if value > high else low
    if not clamp:
        via = "" if knob in requested else " (implied by the other change)"
        where = "above the maximum" if value > high else "below the minimum"
        raise CommandRefused(f"{knob}={value}{via} is {where} {limit}")
    clamped.append({"knob": knob, "requested": value, "applied": limit})
    return limit


def _answer(
    state: AgentState, target: dict[str, Any], clamped: list[dict[str, Any]]
) -> ChangeResult:
    before = state.knobs.model_dump()
    return ChangeResult.model_validate(
        {
            "dry_run": True,
            "changes": [
                {"knob": k, "before": before[k], "after": target[k]}
                for k in KNOBS
                if target[k] != before[k]
            ],
            "clamped": clamped,
            "before": before,
            "after": before,
            "would_be": target,
            "effective_from_step": 0,
        }
    )
