"""Runbook definitions: the pydantic models and the YAML catalog loader.

A runbook is data: the alerts that trigger it, the checks shown before
acting, typed steps (actions from `vllm_runbook.runbooks.model.actions`), the verification that
must succeed, the revert policy and the guardrails. The shipped catalog lives
in `runbooks/catalog/*.yaml`, one runbook per file.

Loading is strict (unknown keys, unknown actions, bad parameters, duplicate
keys and duplicate names all fail) and every error names the file, the line
and the runbook, e.g.
`runbooks/catalog/oom-pressure.yaml:14: runbook oom-pressure: unknown action 'halve'`:
the YAML node marks are kept beside the data so a pydantic error location
maps back to the line it came from.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from vllm_runbook.rules.errors import RUNBOOK_CATALOG, CatalogError, Problem, SyntaxProblem
from vllm_runbook.rules.signals import READABLE, RENAMED, SIGNALS, unknown_signal
from vllm_runbook.rules.yamlmarks import MarkedDict, load, locate, validation_problems
from vllm_runbook.runbooks.model.actions import ActionRegistry, UnknownAction, catalog_registry

CATALOG_DIR: Final = Path(__file__).resolve().parent.parent / "catalog"

Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$", max_length=64)]
Identifier = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _known_signal(value: str) -> str:
    # The one registry of signals (vllm_runbook.rules.signals): what a runbook may
    # read from the engine. A renamed signal's message says its new name.
    why = unknown_signal(value, readable=True)
    if why is not None:
        unknown = value not in SIGNALS and value not in RENAMED
        known = f" (known: {', '.join(sorted(READABLE))})" if unknown else ""
        raise ValueError(why + known)
    return value


class Check(_Strict):
    """A diagnostic gathered and shown before any step runs."""

    name: Identifier
    description: str
    signal: str

    _signal = field_validator("signal")(_known_signal)


class Condition(_Strict):
    """Run a step only if a signal is still above/below a threshold after a wait."""

    signal: str
    above: float | None = None
    below: float | None = None
    after_seconds: Annotated[int, Field(ge=0)] = 0

    _signal = field_validator("signal")(_known_signal)

    @model_validator(mode="after")
    def _one_bound(self) -> Condition:
        if (self.above is None) == (self.below is None):
            raise ValueError("a condition needs exactly one of 'above' or 'below'")
        return self


class StepSpec(_Strict):
    """One action with its parameters (validated against the action registry at load)."""

    action: Identifier
    params: dict[str, Any] = Field(default_factory=dict)
    when: Condition | None = None
    description: str | None = None


class Verification(_Strict):
    """What must happen after the change, measured only after it took effect.

    `effect: relative` (the default): "improved" needs the signal to move
    `improve_by` of its before-value the expected way (0.8 with `decrease`:
    after <= 20 % of before); a move within `tolerance` of before is "no
    measurable change"; beyond it the wrong way, "worse".
    `effect: starving_served` (for `starving_waiting`): the requests that
    were starving when the change took effect (the oldest waiting for their
    first schedule, 8 at most) are what the fix is for: "improved" once every
    one of them has been scheduled; "no measurable change" when some still
    wait at the deadline, which is derived from the engine's drain rate
    before the change (3x the time it takes to admit that many requests, at
    least 10 s, at most `deadline_seconds`). Never "worse": a request once
    scheduled stays scheduled.
    """

    signal: str
    direction: Literal["decrease", "increase"]
    deadline_seconds: Annotated[int, Field(gt=0)]
    effect: Literal["relative", "starving_served"] = "relative"
    improve_by: Annotated[float, Field(gt=0, le=1)] = 0.2
    tolerance: Annotated[float, Field(ge=0, lt=1)] = 0.1
    # Circuit breaker: if any of these got worse after acting, roll back.
    rollback_if_worse: tuple[str, ...] = ()
    # Guards that must be readable on the engine: otherwise the run is refused
    # before any change.
    required_guards: tuple[str, ...] = ()

    _signal = field_validator("signal")(_known_signal)

    @field_validator("rollback_if_worse", "required_guards")
    @classmethod
    def _known_signals(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_known_signal(v) for v in values)

    @model_validator(mode="after")
    def _required_are_guards(self) -> Verification:
        extra = [g for g in self.required_guards if g not in self.rollback_if_worse]
        if extra:
            raise ValueError(f"required_guards not in rollback_if_worse: {', '.join(extra)}")
        if self.effect == "starving_served" and self.direction != "decrease":
            raise ValueError("effect starving_served needs direction decrease")
        return self


# How long a fix holds after its alert resolved before its first revert stage
# (and, where the runbook says so, its cause conditions held that long).
DEFAULT_HOLD_SECONDS: Final = 60


class RevertPolicy(_Strict):
    """When and how an execution's changes are undone.

    With `on_resolve`, the alert's resolution does not revert at once: the
    execution holds its changes ("holding") until `hold_seconds` have passed
    since the resolution *and* every `until` condition (the cause's signals,
    where the fix itself ends the symptom) has held for `hold_seconds` on end.
    After each revert its trigger is watched for `watch_seconds` (the
    verification's deadline when unset): a finding back inside it makes the
    revert premature (re-applied, journaled, notified, counted); a second one
    holds the fix for a person.
    """

    # Revert when the triggering alert resolves (after the hold).
    on_resolve: bool = False
    hold_seconds: Annotated[int, Field(ge=0)] = DEFAULT_HOLD_SECONDS
    until: tuple[Condition, ...] = ()
    watch_seconds: Annotated[int, Field(ge=0)] | None = None
    # Restore in stages: fractions of the way back to the before-values,
    # e.g. [0.5, 1.0] = halfway, then all the way, each after a healthy period.
    stepwise: tuple[Annotated[float, Field(gt=0, le=1)], ...] = ()
    healthy_period_seconds: Annotated[int, Field(ge=0)] = 0

    @field_validator("stepwise")
    @classmethod
    def _increasing_to_one(cls, fractions: tuple[float, ...]) -> tuple[float, ...]:
        if fractions and (
            any(b <= a for a, b in itertools.pairwise(fractions)) or fractions[-1] != 1.0
        ):
            raise ValueError("stepwise fractions must increase strictly and end at 1.0")
        return fractions


# Whether the service acts on a finding or only advises (runbooks/run/advisory.py):
# a runbook's own `mode`, and the configuration's for every runbook.
RunMode = Literal["act", "advisory"]


class Guardrails(_Strict):
    cooldown_seconds: Annotated[int, Field(ge=0)] = 300
    max_runs_per_hour: Annotated[int, Field(ge=1)] = 3
    requires_approval: bool = False
    max_concurrent_engines: Annotated[int, Field(ge=1)] = 1


class Runbook(_Strict):
    name: Name
    description: str
    triggers: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    # The condition the runbook fixes, read with the checks: unless every one
    # holds, the run is refused before any change with "nothing to improve"
    # (no failure: the trigger fired, but what it reported is gone or below
    # the threshold now). A run whose steps would change nothing is refused so too.
    acts_only_if: tuple[Condition, ...] = ()
    steps: Annotated[tuple[StepSpec, ...], Field(min_length=1)]
    verification: Verification | None = None
    revert: RevertPolicy = RevertPolicy()
    guardrails: Guardrails = Guardrails()
    # advisory: the service journals and notifies what this runbook would do
    # (an "advised" execution) and changes nothing; the configuration's
    # `mode: advisory` does so for every runbook.
    mode: RunMode = "act"

    @field_validator("triggers")
    @classmethod
    def _known_alerts(cls, triggers: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # The alert names of the rule catalog the runbooks are loaded with
        # (validation context "alerts"); without one no name is checked.
        alerts = (info.context or {}).get("alerts")
        if alerts is not None:
            for alert in triggers:
                if alert not in alerts:
                    raise ValueError(f"unknown alert {alert!r}")
        return triggers

    @field_validator("acts_only_if")
    @classmethod
    def _read_now(cls, conditions: tuple[Condition, ...]) -> tuple[Condition, ...]:
        if any(c.after_seconds for c in conditions):
            raise ValueError("acts_only_if is read with the checks: no after_seconds")
        return conditions

    @field_validator("checks")
    @classmethod
    def _unique_checks(cls, checks: tuple[Check, ...]) -> tuple[Check, ...]:
        names = [c.name for c in checks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate check name(s): {', '.join(duplicates)}")
        return checks


# --- loading -------------------------------------------------------------------


def _display(path: Path) -> str:
    # Relative to the working directory when inside it: short and clickable.
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def load_runbook_file(
    path: Path,
    registry: ActionRegistry | None = None,
    *,
    alerts: Collection[str] | None = None,
) -> tuple[Runbook | None, list[Problem]]:
    """Parse and validate one runbook file; returns (runbook or None, problems).

    With `alerts` (the rule catalog's alert names) every trigger must be one of them.
    """
    registry = registry if registry is not None else catalog_registry()
    shown = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return None, [SyntaxProblem(f"cannot read: {e}", file=shown)]
    try:
        data = load(text, shown)
    except Problem as e:
        return None, [e]
    if not isinstance(data, MarkedDict):
        return None, [SyntaxProblem("a runbook file must be a mapping", file=shown, line=1)]
    name = data.get("name") if isinstance(data.get("name"), str) else path.stem

    problems: list[Problem] = []
    try:
        context = {"alerts": alerts} if alerts is not None else None
        runbook: Runbook | None = Runbook.model_validate(data, context=context)
    except ValidationError as e:
        runbook = None
        problems += validation_problems(e, data, shown, runbook=name)
    # Actions are checked even when other fields failed, so one run shows all.
    steps = data.get("steps")
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict) or not isinstance(step.get("action"), str):
            continue
        try:
            registry.validate(step["action"], step.get("params") or {})
        except UnknownAction as e:
            line = locate(data, ("steps", i, "action"))[1]
            problems.append(SyntaxProblem(str(e), file=shown, line=line, runbook=name))
        except ValidationError as e:
            at = ("steps", i, "params")
            prefix = f"action {step['action']}: "
            problems += validation_problems(e, data, shown, at=at, prefix=prefix, runbook=name)
    # A change is what a verification judges: with no step that changes a knob
    # it would never run, and the catalog would promise a verdict.
    if (
        runbook is not None
        and runbook.verification is not None
        and not problems
        and not any(registry.get(s.action).mutating for s in runbook.steps)
    ):
        line = locate(data, ("verification",))[1]
        problems.append(
            SyntaxProblem(
                "verification is never judged: no step changes a knob (remove it)",
                file=shown,
                line=line,
                runbook=name,
            )
        )
    return (runbook if not problems else None), problems


class Catalog(Mapping[str, Runbook]):
    """Runbooks by name, with the file each came from."""

    def __init__(self, runbooks: Mapping[str, Runbook], sources: Mapping[str, Path]) -> None:
        self._runbooks = dict(sorted(runbooks.items()))
        self.sources = dict(sources)

    def __getitem__(self, name: str) -> Runbook:
        return self._runbooks[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runbooks)

    def __len__(self) -> int:
        return len(self._runbooks)

    def for_alert(self, alert: str) -> list[Runbook]:
        return [r for r in self._runbooks.values() if alert in r.triggers]


def load_catalog(
    directories: Iterable[Path] | None = None,
    registry: ActionRegistry | None = None,
    *,
    alerts: Collection[str] | None = None,
) -> Catalog:
    """Load every `*.yaml` / `*.yml` runbook under the directories (default: the shipped one).

    With `alerts` (the alert names of the rule catalog the runbooks are loaded
    with) each trigger must name one of them; None checks no trigger name
    (vllm_runbook.runbooks.model.catalogs loads both catalogs together).
    Raises CatalogError listing every problem in every file.
    """
    registry = registry if registry is not None else catalog_registry()
    runbooks: dict[str, Runbook] = {}
    sources: dict[str, Path] = {}
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    for directory in directories if directories is not None else [CATALOG_DIR]:
        if not directory.is_dir():
            problems.append(SyntaxProblem("not a directory", file=_display(directory)))
            continue
        files = sorted(p for p in directory.iterdir() if p.suffix in {".yaml", ".yml"})
        for path in files:
            runbook, file_problems = load_runbook_file(path, registry, alerts=alerts)
            problems.extend(file_problems)
            if runbook is None:
                continue
            if runbook.name in runbooks:
                first = sources[runbook.name]
                problems.append(
                    Problem(
                        f"duplicate runbook name (first defined in "
                        f"{_display(first)}:{lines[runbook.name]})",
                        file=_display(path),
                        line=_name_line(path),
                        runbook=runbook.name,
                    )
                )
                continue
            runbooks[runbook.name] = runbook
            sources[runbook.name] = path
            lines[runbook.name] = _name_line(path) or 1
    if problems:
        raise CatalogError(problems, what=RUNBOOK_CATALOG)
    return Catalog(runbooks, sources)


def _name_line(path: Path) -> int | None:
    doc = load(path.read_text(encoding="utf-8"), _display(path))
    return doc.key_lines.get("name") if isinstance(doc, MarkedDict) else None
