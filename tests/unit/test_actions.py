"""Adding an action is one edit: `@action` on a function typed with its parameters model.

The toy action below is the whole edit a new action needs; the runbook loader,
the registry and the docs' action table pick it up without another list to
keep in step. Functions the registry cannot take are refused at registration.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field
from vllm_runbook.runbooks.model import actions as A
from vllm_runbook.runbooks.model.actions import (
    ActionDefinitionError,
    ActionParams,
    ActionRegistry,
    DuplicateAction,
    action,
)
from vllm_runbook.runbooks.model.spec import load_runbook_file

from tools import docs as D


class PingEngine(ActionParams):
    """Ping the engine `times` times (a toy)."""

    times: Annotated[int, Field(ge=1, le=5)] = 1


class NotActionParams(BaseModel):
    times: int = 1


RUNBOOK = """\
name: ping
description: a runbook using the toy action
steps:
  - action: ping_engine
    params: {times: %s}
"""


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[ActionRegistry]:
    """The catalog's registry, with whatever a test registers dropped afterwards."""
    registry = A.catalog_registry()
    monkeypatch.setattr(registry, "_actions", dict(registry._actions))
    yield registry


def test_one_decorated_function_is_a_whole_new_action(
    scratch_registry: ActionRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # errors name files relative to the working directory
    assert "ping_engine" not in scratch_registry
    calls: list[tuple[int, Any]] = []

    # The one edit.
    @action(mutating=False)
    def ping_engine(params: PingEngine, ctx: Any) -> str:
        calls.append((params.times, ctx))
        return "pong"

    spec = scratch_registry.get("ping_engine")
    assert (spec.params_model, spec.fn, spec.mutating) == (PingEngine, ping_engine, False)
    assert spec.description == "Ping the engine `times` times (a toy)."

    # The runbook loader validates a step naming it (default registry, no list to edit) ...
    good = tmp_path / "ping.yaml"
    good.write_text(RUNBOOK % 3)
    runbook, problems = load_runbook_file(good)
    assert problems == [] and runbook is not None
    assert [(s.action, s.params) for s in runbook.steps] == [("ping_engine", {"times": 3})]
    # ... and its parameters, with the file's line.
    bad = tmp_path / "bad.yaml"
    bad.write_text(RUNBOOK % 9)
    runbook, problems = load_runbook_file(bad)
    assert runbook is None
    assert [str(p) for p in problems] == [
        "bad.yaml:5: runbook ping: action ping_engine: steps[0].params.times: "
        "Input should be less than or equal to 5"
    ]

    # The docs' action table lists it.
    row = next(r for r in D.gen_actions().splitlines() if r.startswith("| `ping_engine`"))
    assert row == (
        "| `ping_engine` | no | `times`: int ≥ 1, ≤ 5 = `1` "
        "| Ping the engine `times` times (a toy). |"
    )

    # The executor's call path runs it with validated parameters.
    assert scratch_registry.call("ping_engine", {"times": 2}, "ctx") == "pong"
    assert calls == [(2, "ctx")]


def test_the_name_and_description_can_be_given() -> None:
    registry = ActionRegistry()

    @registry.action("ping", mutating=True, description="Ping  it.\n  Twice.")
    def ping_engine(params: PingEngine, ctx: object) -> None:
        """Not this."""

    assert list(registry) == ["ping"]
    assert registry.get("ping").description == "Ping it. Twice."
    assert registry.get("ping").mutating is True


def _untyped(params, ctx):  # type: ignore[no-untyped-def]
    pass


def _no_params() -> None:
    pass


def _keyword_only(*, params: PingEngine) -> None:
    pass


def _plain_model(params: NotActionParams, ctx: object) -> None:
    pass


def _mapping(params: dict[str, Any], ctx: object) -> None:
    pass


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            _untyped,
            "the first parameter 'params' must be typed with the action's parameters "
            "model, a subclass of ActionParams (it has no type)",
        ),
        (_no_params, "an action takes its parameters model as its first parameter"),
        (_keyword_only, "an action takes its parameters model as its first parameter"),
        (_plain_model, "a subclass of ActionParams (it has <class "),
        (_mapping, "a subclass of ActionParams (it has dict[str, typing.Any])"),
    ],
)
def test_a_function_without_a_parameters_model_is_refused(fn: Any, message: str) -> None:
    registry = ActionRegistry()
    with pytest.raises(ActionDefinitionError) as info:
        registry.action(mutating=False)(fn)
    assert str(info.value).startswith(f"{__name__}.{fn.__name__}: ")
    assert message in str(info.value)
    assert len(registry) == 0


def test_a_parameters_model_the_module_cannot_see_is_refused() -> None:
    class Local(ActionParams):
        pass

    def local(params: Local, ctx: object) -> None:
        pass

    with pytest.raises(ActionDefinitionError, match="cannot resolve the type of 'params'"):
        ActionRegistry().register(local, mutating=False)


def test_a_duplicate_name_is_refused(scratch_registry: ActionRegistry) -> None:
    with pytest.raises(DuplicateAction) as info:

        @action(mutating=True)
        def set_policy(params: PingEngine, ctx: object) -> None:
            pass

    assert str(info.value) == (
        "action 'set_policy' is already registered (by "
        "vllm_runbook.runbooks.engine.operations.set_policy); "
        f"{__name__}.test_a_duplicate_name_is_refused.<locals>.set_policy needs another name"
    )
    assert scratch_registry.get("set_policy").params_model.__name__ == "SetPolicy"


def test_a_name_a_runbook_cannot_spell_is_refused() -> None:
    with pytest.raises(ActionDefinitionError, match="action name 'Ping-Engine' is not one"):
        ActionRegistry().register(_plain_model_ok, name="Ping-Engine", mutating=False)


def _plain_model_ok(params: PingEngine, ctx: object) -> None:
    pass


def test_every_catalog_action_is_registered_by_its_module() -> None:
    registry = A.catalog_registry()
    for spec in registry.specs():
        assert spec.fn.__module__ in A.ACTION_MODULES
        assert spec.fn.__name__ == spec.name
        assert issubclass(spec.params_model, ActionParams)
    assert D.gen_actions().count("\n| `") == len(registry)


def test_a_verification_no_step_could_give_a_change_to_is_refused_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """warmup's steps change no knob: a verification there would never be judged, and the
    catalog would promise a verdict the journal never shows."""
    monkeypatch.chdir(tmp_path)
    shipped = Path(__file__).resolve().parents[2] / "runbooks" / "catalog" / "warmup.yaml"
    text = shipped.read_text(encoding="utf-8")
    runbook, problems = load_runbook_file(shipped)
    assert problems == [] and runbook is not None and runbook.verification is None
    bad = tmp_path / "warmup.yaml"
    lines = text.splitlines()
    at = lines.index("guardrails:")
    verification = [
        "verification:",
        "  signal: scheduled_tokens_per_second",
        "  direction: increase",
        "  deadline_seconds: 300",
    ]
    bad.write_text("\n".join(lines[:at] + verification + lines[at:]) + "\n", encoding="utf-8")
    runbook, problems = load_runbook_file(bad)
    assert runbook is None
    assert [str(p) for p in problems] == [
        f"warmup.yaml:{at + 1}: runbook warmup: verification is never judged: no step "
        "changes a knob (remove it)"
    ]
