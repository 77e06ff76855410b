"""Rule model: YAML rule files -> validated, parameter-bound rules.

A rule file is ``{rules: [RULE, ...]}``; the group of a rule is its file's
stem. Each rule declares `parameters` with defaults; ``$name`` in the
condition and `for`, and ``{{ $params.name }}`` in templates, refer to them.
A deployment overrides them with ``{AlertName: {param: value}}``.
A rule's `runbook` (None = diagnose only) names a runbook of the catalog it is
deployed with: the caller passes that catalog's names (`runbooks=`); this
package owns no list of them.
Every problem is collected and raised as one CatalogError; nothing is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from vllm_runbook.rules import condition as C
from vllm_runbook.rules import template
from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.rules.errors import (
    CatalogError,
    DuplicateRuleError,
    Problem,
    SyntaxProblem,
    UnknownParameterError,
    UnknownRunbookError,
)
from vllm_runbook.rules.parse import ConditionParser
from vllm_runbook.rules.yamlmarks import MarkedDict, load, validation_problems

CATALOG_DIR = Path(__file__).parent / "catalog"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Labels the rule may not set: they identify the engine or are set by us.
_RESERVED_LABELS = {"alertname", "severity", "runbook", "instance", "model_name", "engine"}

Overrides = Mapping[str, Mapping[str, object]]
ParamValue = float | int | str


class RuleSpec(BaseModel):
    """One rule as written (parameters unbound)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    alert: str = Field(pattern=_IDENT.pattern)
    severity: Literal["info", "warning", "critical"]
    summary: str
    description: str
    runbook: str | None  # required key: write `runbook: null` for diagnose-only rules
    for_: ParamValue = Field(alias="for")
    labels: dict[str, str] = Field(default_factory=dict)
    parameters: dict[str, ParamValue] = Field(default_factory=dict)
    condition: dict[str, object]

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        bad = sorted(set(labels) & _RESERVED_LABELS) + [k for k in labels if not _IDENT.match(k)]
        if bad:
            raise ValueError(f"labels may not set {bad}")
        return labels

    @field_validator("parameters")
    @classmethod
    def _params(cls, params: dict[str, ParamValue]) -> dict[str, ParamValue]:
        bad = [k for k in params if not _IDENT.match(k)]
        if bad:
            raise ValueError(f"bad parameter names {bad}")
        return params


@dataclass(frozen=True)
class Rule:
    """A rule with its parameters bound: what both backends compile."""

    alert: str
    severity: str
    summary: str  # Prometheus template, $params already substituted
    description: str
    runbook: str | None
    for_seconds: float
    labels: Mapping[str, str]
    params: Mapping[str, ParamValue]
    condition: C.Condition
    group: str
    file: str
    line: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.alert, self.severity)

    @property
    def alert_labels(self) -> dict[str, str]:
        """Labels every alert of this rule carries besides the engine's."""
        out = dict(self.labels)
        out["severity"] = self.severity
        if self.runbook:
            out["runbook"] = self.runbook
        return out


@dataclass
class LocatedSpec:
    spec: RuleSpec
    file: str
    line: int
    raw: MarkedDict = field(repr=False)


@dataclass
class Catalog:
    """Every rule spec of a catalog; `bind` applies a deployment's overrides."""

    specs: list[LocatedSpec]

    @property
    def alerts(self) -> list[str]:
        return sorted({s.spec.alert for s in self.specs})

    def bind(self, overrides: Overrides | None = None) -> list[Rule]:
        overrides = overrides or {}
        problems: list[Problem] = _check_overrides(self.specs, overrides)
        rules: list[Rule] = []
        for located in self.specs:
            try:
                rules.append(_bind(located, overrides.get(located.spec.alert, {})))
            except Problem as exc:
                problems.append(exc.located(file=located.file, rule=located.spec.alert))
        if problems:
            raise CatalogError(problems)
        return rules


def load_catalog(
    path: str | Path | None = None,
    *,
    display_root: Path | None = None,
    runbooks: Collection[str] | None = None,
) -> Catalog:
    """Read a rule directory (every *.yaml, sorted) or one file; validate with defaults.

    With `runbooks` (the names of the runbook catalog the rules are deployed
    with) each rule's `runbook` must be one of them; None checks no name.
    """
    root = Path(path) if path is not None else CATALOG_DIR
    files = sorted(root.glob("*.yaml")) if root.is_dir() else [root]
    if not files:
        raise CatalogError([SyntaxProblem("no *.yaml rule files", file=str(root))])
    problems: list[Problem] = []
    specs: list[LocatedSpec] = []
    for f in files:
        shown = _display(f, display_root)
        try:
            loaded, found = _load_file(f, shown, runbooks)
            specs.extend(loaded)
            problems.extend(found)
        except Problem as exc:
            problems.append(exc.located(file=shown))
        except OSError as exc:
            problems.append(SyntaxProblem(f"cannot read: {exc.strerror}", file=shown))
    problems.extend(_duplicates(specs))
    try:
        Catalog(specs).bind()  # parse every condition with its defaults now
    except CatalogError as exc:
        problems.extend(exc.problems)
    if problems:
        raise CatalogError(problems)
    return Catalog(specs)


def _display(f: Path, root: Path | None) -> str:
    """A path for messages: relative to `root` (default: the current directory) when possible."""
    base = (root or Path.cwd()).resolve()
    try:
        return str(f.resolve().relative_to(base))
    except ValueError:
        return str(f)


def _load_file(
    path: Path, shown: str, runbooks: Collection[str] | None
) -> tuple[list[LocatedSpec], list[Problem]]:
    """The file's valid specs and the problems of the others (checked further later)."""
    doc = load(path.read_text(encoding="utf-8"), shown)
    if (
        not isinstance(doc, MarkedDict)
        or set(doc) != {"rules"}
        or not isinstance(doc["rules"], list)
    ):
        raise SyntaxProblem(
            "a rule file is a mapping with one key, rules: [ ... ]", line=getattr(doc, "line", 1)
        )
    problems: list[Problem] = []
    out: list[LocatedSpec] = []
    for raw in doc["rules"]:
        line = getattr(raw, "line", doc.line)
        name = raw.get("alert") if isinstance(raw, MarkedDict) else None
        if not isinstance(raw, MarkedDict):
            problems.append(SyntaxProblem("a rule must be a mapping", file=shown, line=line))
            continue
        try:
            spec = RuleSpec.model_validate(raw)
        except ValidationError as exc:
            rule = name if isinstance(name, str) else None
            problems.extend(validation_problems(exc, raw, shown, rule=rule))
            continue
        if runbooks is not None and spec.runbook is not None and spec.runbook not in runbooks:
            problems.append(
                UnknownRunbookError(
                    f"unknown runbook {spec.runbook!r} (known: {', '.join(runbooks) or 'none'}; "
                    "or null for diagnose-only)",
                    file=shown,
                    line=raw.line_of("runbook"),
                    rule=name,
                )
            )
            continue
        out.append(LocatedSpec(spec, shown, line, raw))
    return out, problems


def _duplicates(specs: list[LocatedSpec]) -> list[Problem]:
    seen: dict[tuple[str, str], LocatedSpec] = {}
    out: list[Problem] = []
    for s in specs:
        key = (s.spec.alert, s.spec.severity)
        if key in seen:
            first = seen[key]
            out.append(
                DuplicateRuleError(
                    f"alert {key[0]} with severity {key[1]} already defined at "
                    f"{first.file}:{first.line}",
                    file=s.file,
                    line=s.line,
                    rule=key[0],
                )
            )
        else:
            seen[key] = s
    return out


def _check_overrides(specs: list[LocatedSpec], overrides: Overrides) -> list[Problem]:
    params: dict[str, set[str]] = {}
    for s in specs:
        params.setdefault(s.spec.alert, set()).update(s.spec.parameters)
    out: list[Problem] = []
    for alert, values in overrides.items():
        if alert not in params:
            out.append(
                UnknownParameterError(f"override for unknown alert {alert!r}", file="overrides")
            )
            continue
        if not isinstance(values, Mapping):
            out.append(SyntaxProblem("overrides are {param: value}", file="overrides", rule=alert))
            continue
        for name in values:
            if name not in params[alert]:
                out.append(
                    UnknownParameterError(
                        f"override of unknown parameter {name!r} "
                        f"(has: {', '.join(sorted(params[alert]))})",
                        file="overrides",
                        rule=alert,
                    )
                )
    return out


def _bind(located: LocatedSpec, override: Mapping[str, object]) -> Rule:
    spec, raw = located.spec, located.raw
    params: dict[str, ParamValue] = dict(spec.parameters)
    for name, value in override.items():
        if name in params:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise SyntaxProblem(
                    f"override {name}: expected a number or a duration, got {value!r}"
                )
            params[name] = value
    for_value = ConditionParser(params, raw.line_of("for")).value(spec.for_)
    for_seconds = _for_seconds(for_value, raw.line_of("for"))
    parser = ConditionParser(params, raw.line_of("condition"), for_seconds)
    condition = parser.condition(raw["condition"])
    for key in ("summary", "description"):
        try:
            template.check(getattr(spec, key), params)
        except Problem as exc:
            raise exc.located(line=raw.line_of(key)) from None
    return Rule(
        alert=spec.alert,
        severity=spec.severity,
        summary=template.bind_params(spec.summary, params),
        description=template.bind_params(spec.description, params),
        runbook=spec.runbook,
        for_seconds=for_seconds,
        labels=dict(spec.labels),
        params=params,
        condition=condition,
        group=Path(located.file).stem,
        file=located.file,
        line=located.line,
    )


def _for_seconds(value: object, line: int) -> float:
    if value in ("0", "0s", 0):
        return 0.0  # `for: 0s` means fire at once; parse_duration insists on positive windows
    try:
        return parse_duration(value)
    except Problem as exc:
        raise exc.located(line=line) from None
