"""The action registry: which actions a runbook may name, and their parameters.

Adding an action is one edit: a parameters model and a function that takes
it, decorated with `@action`, in one of `ACTION_MODULES`::

    class SetPolicy(ActionParams):
        policy: Literal["fcfs", "priority", "tiered"]


    @action(mutating=True)
    def set_policy(params: SetPolicy, ctx: ActionContext) -> ActionOutcome: ...

The decorator reads the parameters model from the type of the function's
first parameter (a subclass of `ActionParams`: strict about unknown keys,
frozen), names the action after the function unless `name=` says otherwise,
and adds it to the registry. The runbook loader validates every step's
parameters against that model (a typo fails at load time, not mid-incident),
the executor calls the function, and the docs' action table lists it: all of
them read the registry, none keeps a list of its own.

A function whose first parameter is not typed with a parameters model, a
name a runbook could not spell, and a name registered twice are refused when
the module is imported, with an error naming the function.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict

ActionFn = Callable[..., Any]
F = TypeVar("F", bound=ActionFn)

# The modules whose `@action` functions make up the catalog's actions.
ACTION_MODULES: Final = (
    "vllm_runbook.runbooks.engine.operations",
    "vllm_runbook.runbooks.engine.warmup",
    "vllm_runbook.runbooks.engine.block_size",
    "vllm_runbook.runbooks.engine.router",
)

# What a runbook step's `action:` may be (vllm_runbook.runbooks.model.spec `Identifier`).
_NAME: Final = re.compile(r"^[a-z][a-z0-9_]*$")


class ActionError(Exception):
    """Base of the registry's errors (and of the actions' own failures)."""


class DuplicateAction(ActionError):
    pass


class ActionDefinitionError(ActionError, TypeError):
    """An action function the registry cannot take (raised at registration)."""


class UnknownAction(ActionError, KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown action {self.name!r}"


class ActionParams(BaseModel):
    """Base of every action's parameters: strict about unknown keys and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    params_model: type[ActionParams]
    fn: ActionFn
    # Changes engine state (records before/after, can be reverted); read-only
    # actions (advice, diagnostics) are safe in any mode.
    mutating: bool
    description: str
    # The engine knobs it may change (what a circuit breaker's hold on those
    # knobs refuses); empty for an action that changes none.
    knobs: tuple[str, ...] = ()


def _qualname(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def params_model_of(fn: ActionFn) -> type[ActionParams]:
    """The parameters model an action function takes: its first parameter's type.

    Only that annotation is resolved (in the function's module), so the others
    may name types imported for type checking only."""
    where = _qualname(fn)
    if not callable(fn):
        raise ActionDefinitionError(f"{where}: an action must be a function")
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ActionDefinitionError(f"{where}: cannot read its signature: {exc}") from None
    first = parameters[0] if parameters else None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        raise ActionDefinitionError(
            f"{where}: an action takes its parameters model as its first parameter, "
            "e.g. `def my_action(params: MyParams, ctx: ActionContext)`"
        )
    annotation = first.annotation
    if isinstance(annotation, str):
        holder = type("_Params", (), {"__annotations__": {first.name: annotation}})
        try:
            annotation = typing.get_type_hints(holder, globalns=getattr(fn, "__globals__", None))[
                first.name
            ]
        except NameError as exc:
            raise ActionDefinitionError(
                f"{where}: cannot resolve the type of {first.name!r} ({exc})"
            ) from None
    if not (isinstance(annotation, type) and issubclass(annotation, ActionParams)):
        shown = "no type" if annotation is inspect.Parameter.empty else repr(annotation)
        raise ActionDefinitionError(
            f"{where}: the first parameter {first.name!r} must be typed with the action's "
            f"parameters model, a subclass of ActionParams (it has {shown})"
        )
    return annotation


class ActionRegistry:
    """Named actions with typed parameters; no name can be registered twice."""

    def __init__(self) -> None:
        self._actions: dict[str, ActionSpec] = {}

    def register(
        self,
        fn: ActionFn,
        *,
        name: str | None = None,
        mutating: bool,
        description: str | None = None,
        knobs: tuple[str, ...] = (),
    ) -> ActionSpec:
        """Add an action; its parameters model is the type of `fn`'s first parameter.

        The name defaults to the function's; the description to the model's
        docstring, else the function's."""
        params_model = params_model_of(fn)
        name = name if name is not None else getattr(fn, "__name__", "")
        if not _NAME.match(name):
            raise ActionDefinitionError(
                f"{_qualname(fn)}: action name {name!r} is not one a runbook can name "
                "(lower case letters, digits and _, starting with a letter)"
            )
        if name in self._actions:
            first = _qualname(self._actions[name].fn)
            raise DuplicateAction(
                f"action {name!r} is already registered (by {first}); "
                f"{_qualname(fn)} needs another name"
            )
        if description is None:
            description = params_model.__doc__ or (inspect.getdoc(fn) or "").split("\n\n")[0]
        spec = ActionSpec(
            name, params_model, fn, mutating, " ".join(description.split()), tuple(knobs)
        )
        self._actions[name] = spec
        return spec

    def action(
        self,
        name: str | None = None,
        *,
        mutating: bool,
        description: str | None = None,
        knobs: tuple[str, ...] = (),
    ) -> Callable[[F], F]:
        """Decorator form of `register`: returns the function unchanged."""

        def decorate(fn: F) -> F:
            self.register(fn, name=name, mutating=mutating, description=description, knobs=knobs)
            return fn

        return decorate

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

    def specs(self) -> list[ActionSpec]:
        """Every action, by name."""
        return [self._actions[name] for name in self]

    def validate(self, name: str, params: Mapping[str, Any] | None) -> ActionParams:
        """Parameters as the action's model; raises UnknownAction or pydantic's ValidationError."""
        return self.get(name).params_model.model_validate(dict(params or {}))

    def call(
        self, name: str, params: Mapping[str, Any] | ActionParams, *args: Any, **kw: Any
    ) -> Any:
        """Run an action with validated parameters (extra args go to its function)."""
        spec = self.get(name)
        model = params if isinstance(params, ActionParams) else self.validate(name, params)
        return spec.fn(model, *args, **kw)


# The catalog's actions: filled by `@action` as ACTION_MODULES are imported.
ACTIONS: Final = ActionRegistry()


def action(
    name: str | None = None,
    *,
    mutating: bool,
    description: str | None = None,
    knobs: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """Register the decorated function as one of the catalog's actions.

    `mutating`: whether it changes the engine (journaled before/after,
    reverted); said at every action, never assumed. `knobs`: the engine
    knobs it may change."""
    return ACTIONS.action(name, mutating=mutating, description=description, knobs=knobs)


def catalog_registry() -> ActionRegistry:
    """The catalog's actions (imports ACTION_MODULES, whose decorators fill it)."""
    for module in ACTION_MODULES:
        importlib.import_module(module)
    return ACTIONS
