"""The action registry: which actions a runbook may name, and their parameters.

Runbook YAML names actions; this registry is the explicit list of them, each
with a pydantic model for its parameters (validated when the catalog loads,
so a typo fails at load time, not mid-incident) and the function that does
the work. `declared_registry()` declares every action the catalog uses with
its parameter model and *no* implementation: the functions that talk to the
engine are attached later with `implement(name, fn)` by the executor's
wiring. Calling a declared-only action raises `ActionNotImplemented` rather
than pretending to have acted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

ActionFn = Callable[..., Any]


class ActionError(Exception):
    """Base of the registry's errors."""


class DuplicateAction(ActionError):
    pass


class UnknownAction(ActionError, KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown action {self.name!r}"


class ActionNotImplemented(ActionError, NotImplementedError):
    pass


class ActionParams(BaseModel):
    """Base of every action's parameters: strict about unknown keys and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- parameter models of the catalog's actions ----------------------------------


class ScaleMaxNumBatchedTokens(ActionParams):
    """Multiply the token budget; never above the startup value, never below the floors."""

    factor: Annotated[float, Field(gt=0, le=1)]
    # Stop at the floor (as the docstring promises) rather than fail the step
    # when the factor would cross it; false makes crossing a floor an error.
    clamp: bool = True


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


class SetPolicy(ActionParams):
    policy: Literal["fcfs", "priority", "tiered"]


class SetAutopilot(ActionParams):
    """Hand max_num_seqs over to the engine's autopilot (or take it back):
    it keeps preemptions near zero at the most sequences the KV cache holds,
    never above the startup value. `target`: its peak KV usage, (0, 1]."""

    enabled: bool = True
    target: Annotated[float, Field(gt=0, le=1)] | None = None


class RestoreKnobs(ActionParams):
    """Put every knob back to the engine's startup value."""


class SendWarmupRequests(ActionParams):
    """Send `count` completions of `prompt_tokens` prompt tokens to the engine's
    vLLM API server (needs its URL: the inventory's `vllm:`, or `--vllm`)."""

    count: Annotated[int, Field(ge=1, le=10_000)]
    prompt_tokens: Annotated[int, Field(ge=1)]
    output_tokens: Annotated[int, Field(ge=1, le=4096)] = 16
    # At most this many in flight: warm-up must not become the overload it prevents.
    concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 120.0


class CaptureDiagnostics(ActionParams):
    """Snapshot the engine's state (metrics, block pool, queues) into the journal."""


class Advise(ActionParams):
    """Tell the operator something that needs a person (e.g. a restart)."""

    text: Annotated[str, Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    params_model: type[ActionParams]
    fn: ActionFn | None
    # Changes engine state (records before/after, can be reverted); read-only
    # actions (advice, diagnostics) are safe in any mode.
    mutating: bool
    description: str

    @property
    def implemented(self) -> bool:
        return self.fn is not None


class ActionRegistry:
    """Named actions with typed parameters; no name can be registered twice."""

    def __init__(self) -> None:
        self._actions: dict[str, ActionSpec] = {}

    def register(
        self,
        name: str,
        fn: ActionFn | None,
        params_model: type[ActionParams],
        *,
        mutating: bool = False,
        description: str | None = None,
    ) -> ActionSpec:
        """Add an action. `fn=None` declares it (name + params) without an implementation."""
        if name in self._actions:
            raise DuplicateAction(f"action {name!r} is already registered")
        if not (isinstance(params_model, type) and issubclass(params_model, BaseModel)):
            raise TypeError(f"action {name!r}: params_model must be a pydantic model class")
        doc = description if description is not None else (params_model.__doc__ or "")
        spec = ActionSpec(name, params_model, fn, mutating, " ".join(doc.split()))
        self._actions[name] = spec
        return spec

    def implement(self, name: str, fn: ActionFn) -> ActionSpec:
        """Attach the implementation to a declared action (once)."""
        spec = self.get(name)
        if spec.fn is not None:
            raise DuplicateAction(f"action {name!r} already has an implementation")
        implemented = ActionSpec(name, spec.params_model, fn, spec.mutating, spec.description)
        self._actions[name] = implemented
        return implemented

    def get(self, name: str) -> ActionSpec:
        try:
            return self._actions[name]
        except KeyError:
            raise UnknownAction(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._actions

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._actions))

    def __len__(self) -> int:
        return len(self._actions)

    def validate(self, name: str, params: Mapping[str, Any] | None) -> ActionParams:
        """Parameters as the action's model; raises UnknownAction or pydantic's ValidationError."""
        return self.get(name).params_model.model_validate(dict(params or {}))

    def call(
        self, name: str, params: Mapping[str, Any] | ActionParams, *args: Any, **kw: Any
    ) -> Any:
        """Run an action with validated parameters (extra args go to its function)."""
        spec = self.get(name)
        if spec.fn is None:
            raise ActionNotImplemented(f"action {name!r} is declared but has no implementation")
        model = params if isinstance(params, ActionParams) else self.validate(name, params)
        return spec.fn(model, *args, **kw)


CATALOG_ACTIONS: Final[tuple[tuple[str, type[ActionParams], bool], ...]] = (
    ("scale_max_num_batched_tokens", ScaleMaxNumBatchedTokens, True),
    ("set_max_num_seqs", SetMaxNumSeqs, True),
    ("set_policy", SetPolicy, True),
    ("set_autopilot", SetAutopilot, True),
    ("restore_knobs", RestoreKnobs, True),
    ("send_warmup_requests", SendWarmupRequests, False),
    ("capture_diagnostics", CaptureDiagnostics, False),
    ("advise", Advise, False),
)


def declared_registry() -> ActionRegistry:
    """A fresh registry declaring every catalog action, none implemented yet."""
    registry = ActionRegistry()
    for name, params_model, mutating in CATALOG_ACTIONS:
        registry.register(name, None, params_model, mutating=mutating)
    return registry
