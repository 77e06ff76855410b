"""The deployment's configuration file: its loader, and the sections the rules layer owns.

    engines:                                  # the inventory (default: none)
      - name: llama-0
        agent: http://127.0.0.1:9360          # collector endpoint: metrics + control
        vllm: http://127.0.0.1:8000           # optional: vLLM's API server (/metrics, warm-up)
        labels: {instance: "127.0.0.1:8000"}  # how Alertmanager alerts find this engine
    rules:
      evaluation_interval: 5s
      leader_lease: 15s                       # replicas on one database: one evaluates
      replicas: leader                        # or split: each evaluates its share
      scrape_deadline: 0.5                    # a cycle waits for its targets at most
      scrape_grace: 250ms                     #   0.5 x interval, or 250 ms without an answer
      catalog: my-rules/                      # default: the built-in catalog
      overrides: {VllmLatencySpike: {p99_sla_seconds: 1.0}}
    automation:                               # per runbook: auto | approve | notify
      oom-pressure: auto
      default: notify

Each section is a frozen pydantic model owned by the layer that uses it: this
module owns `engines` (EngineConfig), `rules` (RulesSection) and `automation`
(Automation); the service's sections (database, webhook, page, approvals,
notifications, executor, limits, retention) and the whole file's model,
`Config`, are vllm_runbook.runbooks.model.config's. `RulesConfig` is this layer's
view of the file: its own sections, the others' ignored.

`load_file(model, path)` is the one loader: YAML with line marks
(rules/yamlmarks.py), validated by a top-level model, every problem reported
at once, in file order, as ``file:line: message``. Every key has a default,
so no file at all is a valid one-machine setup. Relative paths are relative to
the file. Unknown keys are errors (a typo must not silently fall back to a
default). Runbook names under `automation` are checked against the names the
caller passes (`runbooks=...`): this layer does not know the runbook catalog.

In the file a duration needs its unit (``10s``); built in Python a number is
seconds (`ExecutorConfig(verify_seconds=10.0)`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    RootModel,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.rules.errors import (
    CONFIGURATION,
    CatalogError,
    Problem,
    SyntaxProblem,
    UnknownParameterError,
)
from vllm_runbook.rules.model import Catalog, Rule, load_catalog
from vllm_runbook.rules.scrape import Target
from vllm_runbook.rules.slo import Slos
from vllm_runbook.rules.yamlmarks import (
    MarkedDict,
    MarkedList,
    file_key,
    load,
    validation_problems,
)

AutomationMode = Literal["auto", "approve", "notify"]
AUTOMATION_MODES: tuple[str, ...] = get_args(AutomationMode)
DEFAULT_EVALUATION_INTERVAL = 5.0
# The rules leader's lease: a replica that stops renewing it (crash, lost
# database) is replaced within this time; a cycle must take less.
MIN_LEADER_LEASE = 15.0
_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def default_leader_lease(evaluation_interval: float) -> float:
    return max(MIN_LEADER_LEASE, 3 * evaluation_interval)


# -- field types, shared by every section ----------------------------------------------
# Validators raise PydanticCustomError whose type says how the message joins the
# key's dotted path: "phrase" -> `PATH message`, "detail" -> `PATH: message`,
# "whole" -> `message` (it names its section itself). yamlmarks adds file:line.


def phrase(message: str) -> PydanticCustomError:
    """An error read after the key's path: ``engines[0].agent must be ...``."""
    return PydanticCustomError("phrase", message)


def detail(message: str) -> PydanticCustomError:
    """An error read after the key's path and a colon: ``webhook: give ...``."""
    return PydanticCustomError("detail", message)


def _from_file(info: ValidationInfo) -> bool:
    return "file" in (info.context or {})


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise phrase(f"must be a non-empty string, got {value!r}")
    return value.strip()


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise phrase(f"must be an http(s) URL, got {value!r}")
    return value.rstrip("/")


def _duration(value: object, info: ValidationInfo) -> float:
    if not _from_file(info) and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)  # built in Python: seconds
    try:
        return parse_duration(value)
    except Problem as exc:
        raise detail(exc.message) from None


def positive(value: float) -> float:
    if value <= 0:
        raise phrase("must be positive")
    return value


def _path(value: object) -> object:
    return value if isinstance(value, Path) else _text(value)


def _relative_to_file(value: Path, info: ValidationInfo) -> Path:
    base: Path | None = (info.context or {}).get("base")
    return value if base is None else base / value


Text = Annotated[str, BeforeValidator(_text)]
Url = Annotated[str, BeforeValidator(_text), AfterValidator(_url)]
Duration = Annotated[float, BeforeValidator(_duration)]
PositiveDuration = Annotated[float, BeforeValidator(_duration), AfterValidator(positive)]
# A file named in the configuration: relative to the configuration file.
RelativePath = Annotated[Path, BeforeValidator(_path), AfterValidator(_relative_to_file)]


class Section(BaseModel):
    """A mapping of the file: unknown keys are errors; `key:` with no value is the default.

    A field whose key in the file differs from its name (`timeout` for
    `timeout_seconds`) has that key as its validation alias: the file uses
    the key, Python the name."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    @model_validator(mode="before")
    @classmethod
    def _absent_if_null(cls, data: Any) -> Any:
        if isinstance(data, Mapping):  # an unknown key stays, to be reported
            keys = {file_key(name, f) for name, f in cls.model_fields.items()}
            return {k: v for k, v in data.items() if v is not None or k not in keys}
        return data


# -- engines ---------------------------------------------------------------------------


def _engine_name(value: str) -> str:
    if not _ENGINE_NAME.match(value):
        raise phrase(f"{value!r}: use letters, digits, _ . : -")
    return value


def _labels(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise phrase("must be a mapping")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise detail(f"keys and values must be strings ({bad})")
    return dict(value)


class RouterConfig(Section):
    """The router in front of an engine (vllm-router's admin API): where the
    drain, undrain and restart actions act (runbooks/engine/router.py)."""

    url: Url
    """The router's base URL; the engine is its worker by its `vllm:` URL."""
    restart: tuple[str, ...] = ()
    """The restart hook: a command as a list of arguments (run with
    VLLM_RUNBOOK_WORKER_URL set), e.g. a `kubectl rollout restart`; empty: none."""


class EngineConfig(Section):
    """One engine of the inventory."""

    name: Annotated[str, BeforeValidator(_text), AfterValidator(_engine_name)]
    """The inventory name: the `instance` label of everything scraped from it."""
    agent: Url
    """The collector agent's base URL (no trailing slash): metrics and control."""
    vllm: Url | None = None
    """vLLM's API server base URL: its /metrics, warm-up requests."""
    labels: Annotated[dict[str, str], BeforeValidator(_labels)] = Field(default_factory=dict)
    """How Alertmanager alerts find this engine."""
    router: RouterConfig | None = None
    """The router in front of it (needs `vllm:`, its worker URL there)."""

    def targets(self) -> list[Target]:
        """What the embedded evaluator scrapes for this engine."""
        urls = [self.agent] + ([self.vllm] if self.vllm else [])
        return [Target(f"{u}/metrics", self.name) for u in urls]


def _unique_names(value: Any, handler: Any) -> tuple[EngineConfig, ...]:
    """Engine names are unique: checked even when other engine entries are broken."""
    errors: list[InitErrorDetails] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value if isinstance(value, MarkedList) else ()):
        raw = item.get("name") if isinstance(item, MarkedDict) else None
        if not isinstance(raw, str) or not _ENGINE_NAME.match(name := raw.strip()):
            continue  # the name's own validation reports it
        if name in seen:
            dup = phrase(f"{name!r} already used at line {seen[name]}")
            errors.append({"type": dup, "loc": (i, "name"), "input": raw})
        else:
            seen[name] = item.line_of("name")
    try:
        engines: tuple[EngineConfig, ...] = handler(value)
    except ValidationError as exc:
        errors += [
            {"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": e["input"]}
            for e in exc.errors()
        ]
    if errors:
        raise ValidationError.from_exception_data("engines", errors)
    return engines


Engines = Annotated[tuple[EngineConfig, ...], WrapValidator(_unique_names)]


# -- automation ------------------------------------------------------------------------


def _mode(value: object) -> object:
    if value not in AUTOMATION_MODES:
        raise detail(f"{value!r} is not one of {', '.join(AUTOMATION_MODES)}")
    return value


def _runbook_key(name: str, info: ValidationInfo) -> str:
    known: Collection[str] | None = (info.context or {}).get("runbooks")
    if name == "default" or known is None or name in known:
        return name
    raise PydanticCustomError(
        "whole",
        f"automation: unknown runbook {name!r} (known: {', '.join(sorted(known))}, or default)",
    )


RunbookKey = Annotated[str, BeforeValidator(str), AfterValidator(_runbook_key)]
Mode = Annotated[AutomationMode, BeforeValidator(_mode)]


class Automation(RootModel[dict[RunbookKey, Mode]]):
    """What happens when an incident of a runbook fires, as written: runbook -> mode,
    and `default` for the others (default: notify, record and notify only)."""

    model_config = ConfigDict(frozen=True)
    root: dict[RunbookKey, Mode] = Field(default_factory=dict)

    @property
    def default(self) -> AutomationMode:
        return self.root.get("default", "notify")

    @property
    def modes(self) -> dict[str, AutomationMode]:
        """The runbooks named, without `default`."""
        return {name: mode for name, mode in self.root.items() if name != "default"}

    def mode(self, runbook: str | None) -> AutomationMode:
        if runbook is None:
            return "notify"  # diagnose-only alerts have nothing to run
        return self.modes.get(runbook, self.default)


# -- rules -----------------------------------------------------------------------------


def _override(value: object) -> dict[str, object]:
    if not isinstance(value, Mapping):
        raise detail("expected {parameter: value}")
    return dict(value)


class RulesSection(Section):
    """The embedded evaluator: its cadence, its leader lease and its catalog."""

    evaluation_interval: Duration = DEFAULT_EVALUATION_INTERVAL
    leader_lease: float = Field(default=None, validate_default=True)
    """Seconds; default max(15 s, 3 x evaluation_interval)."""
    replicas: Literal["leader", "split"] = "leader"
    """Replicas on one database: `leader`, one evaluates every engine; `split`, each
    its share (rendezvous hashing over the live replicas' leases)."""
    scrape_deadline: float = Field(default=0.5, gt=0, le=1)
    """Fraction of evaluation_interval after which a cycle stops waiting for the
    targets still in flight: they are late, their answers ingested by the next
    cycle (rules/scrape.py)."""
    scrape_grace: Duration = Field(default=0.25, gt=0)
    """Seconds: once every target is asked, a cycle stops waiting after this long
    without an answer (one longer than the deadline: wait until the deadline)."""
    catalog: RelativePath | None = None
    """None: the built-in catalog."""
    overrides: dict[
        Annotated[str, BeforeValidator(str)],  # an alert name YAML read as a number
        Annotated[dict[str, object], BeforeValidator(_override)],
    ] = Field(default_factory=dict)
    # Where each alert under `overrides` was written (file, line): the catalog's
    # complaints about an override point there. Set by the loader's validation.
    _override_lines: dict[str, int] = PrivateAttr(default_factory=dict)
    _file: str | None = PrivateAttr(default=None)

    @field_validator("leader_lease", mode="before")
    @classmethod
    def _renewed_in_time(cls, value: object, info: ValidationInfo) -> float:
        interval = info.data.get("evaluation_interval")
        if value is None:
            return default_leader_lease(interval or DEFAULT_EVALUATION_INTERVAL)
        lease = _duration(value, info)
        if interval is not None and lease < 2 * interval:
            raise phrase(
                f"({lease:g} s) must be at least twice rules.evaluation_interval "
                f"({interval:g} s): the leader renews it every cycle"
            )
        return lease

    @model_validator(mode="wrap")
    @classmethod
    def _remember_lines(cls, data: Any, handler: Any, info: ValidationInfo) -> RulesSection:
        section: RulesSection = handler(data)
        raw = data.get("overrides") if isinstance(data, Mapping) else None
        if isinstance(raw, MarkedDict) and raw and _from_file(info):
            section._file = (info.context or {})["file"]
            section._override_lines = {str(a): line for a, line in raw.key_lines.items()}
        return section

    def load_rules(self) -> list[Rule]:
        """The catalog this section names, bound with its overrides; CatalogError if broken."""
        return self.bind(load_catalog(self.catalog))

    def bind(self, catalog: Catalog) -> list[Rule]:
        """The catalog's rules with these overrides; problems located in the file."""
        known = set(catalog.alerts)
        problems: list[Problem] = [
            self._locate(
                UnknownParameterError(f"override for unknown alert {a!r}", file="overrides"), a
            )
            for a in self.overrides
            if a not in known
        ]
        try:
            rules = catalog.bind({a: v for a, v in self.overrides.items() if a in known})
        except CatalogError as exc:
            problems = [self._locate(p, p.rule) for p in exc.problems] + problems
        if problems:
            raise CatalogError(problems)
        return rules

    def _locate(self, problem: Problem, alert: str | None) -> Problem:
        # The catalog names bad overrides with file "overrides": point at this file.
        if problem.file != "overrides" or self._file is None:
            return problem
        problem.file = None
        return problem.located(file=self._file, line=self._override_lines.get(alert or ""))


class RulesConfig(Section):
    """This layer's view of the configuration file: its sections; the service's are
    ignored here (vllm_runbook.runbooks.model.config.Config validates the whole file)."""

    model_config = ConfigDict(extra="ignore")

    engines: Engines = ()
    rules: RulesSection = Field(default_factory=RulesSection)
    automation: Automation = Field(default_factory=Automation)
    slos: Slos = ()


# -- the loader ------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def load_file(model: type[M], path: str | Path | None, **context: object) -> M:
    """Read a configuration file and validate it as `model`; None gives the defaults.

    `context` reaches the validators (`runbooks`: the names `automation` may
    use). Raises CatalogError (what: configuration) with every problem, each
    ``file:line: message``, in file order."""
    if path is None:
        return model()
    path = Path(path)
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        problem = SyntaxProblem(f"cannot read: {exc.strerror}", file=shown)
        raise CatalogError([problem], what=CONFIGURATION) from None
    try:
        doc = load(text, shown)
    except Problem as exc:
        raise CatalogError([exc], what=CONFIGURATION) from None
    if doc is None:
        return model()
    if not isinstance(doc, MarkedDict):
        msg = "a configuration file is a mapping (database, engines, rules, ...)"
        raise CatalogError([SyntaxProblem(msg, file=shown, line=1)], what=CONFIGURATION)
    try:
        return model.model_validate(
            doc,
            context={**context, "file": shown, "base": path.parent},
            by_alias=True,
            by_name=False,  # the file spells its keys one way
        )
    except ValidationError as exc:
        problems = validation_problems(exc, doc, shown, wording="schema", model=model)
        problems.sort(key=lambda p: p.line or 0)  # file order, whichever check found it
        raise CatalogError(problems, what=CONFIGURATION) from None
