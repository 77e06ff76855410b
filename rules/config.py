"""The deployment's configuration file, shared by the rules engine, the service and the demo.

    database: sqlite:///runbook.db            # default: the store's own default
    engines:                                  # the inventory (default: none)
      - name: llama-0
        agent: http://127.0.0.1:9360          # collector endpoint: metrics + control
        vllm: http://127.0.0.1:8000           # optional: vLLM's API server (/metrics, warm-up)
        labels: {instance: "127.0.0.1:8000"}  # how Alertmanager alerts find this engine
    rules:
      evaluation_interval: 5s
      leader_lease: 15s                       # replicas on one database: one evaluates
      catalog: my-rules/                      # default: the built-in catalog
      overrides: {VllmLatencySpike: {p99_sla_seconds: 1.0}}
    automation:                               # per runbook: auto | approve | notify
      oom-pressure: auto
      default: notify
    webhook:
      token_file: secrets/webhook-token       # or username + password_file (basic auth)
      token_name: alertmanager                # who an answer with the token is recorded as
    page:
      hosts: [runbook.internal]               # more names the page answers to (Host)
    approvals:
      timeout: 15m                            # an unanswered approval is then refused
    notifications:                            # execution events to on-call (runbooks/notify.py)
      receivers:
        - {name: ops, type: webhook, url: http://hooks.internal/runbook}  # token_file: optional
        - {name: chat, type: slack, url: https://hooks.slack.com/services/...}
      retries: 4                              # after the first attempt
      backoff: 1s                             # before the first retry, doubled each time
      timeout: 5s                             # per attempt
      claim_lease: 30s                        # a dead replica's claims are sent again after it
      page_url: http://runbook.internal:8080  # links in messages (default: none)
    executor:                                 # override every runbook's waits (tests, demos)
      verify_seconds: 10s                     # verification deadline
      condition_seconds: 2s                   # each step's `when: after_seconds`
      healthy_period_seconds: 5s              # between the stages of a stepwise revert
    limits:                                   # what `runbook serve` takes from a client
      webhook_body: 4MiB                      # a larger delivery: 413
      header_timeout: 10s                     # a request's head must arrive within this
      body_timeout: 30s                       # and its body within this after the head
      keep_alive: 5s                          # an idle connection is closed after this
      max_connections: 100                    # beyond: 503 (Alertmanager retries)
    retention:                                # stored Alertmanager deliveries
      max_age: 7d                             # older ones are deleted
      max_size: 256MiB                        # and the oldest beyond this total
      interval: 10m                           # how often the service prunes

Every key has a default, so no file at all is a valid one-machine setup.
Relative paths are relative to the file. Unknown keys are errors (a typo must
not silently fall back to a default); every problem is reported at once, in
file order, as ``file:line: message``. The schema is the pydantic models below
(one per section); `vllm_runbook.rules.yamlmarks.validation_problems` turns each of
their errors into that line.
Runbook names under `automation` are checked against the names the caller
passes (`load_config(path, runbooks=...)`): this layer does not know the
runbook catalog.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
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
from vllm_runbook.rules.yamlmarks import MarkedDict, MarkedList, load, validation_problems

AutomationMode = Literal["auto", "approve", "notify"]
AUTOMATION_MODES: tuple[str, ...] = get_args(AutomationMode)
DEFAULT_EVALUATION_INTERVAL = 5.0
# The rules leader's lease: a replica that stops renewing it (crash, lost
# database) is replaced within this time; a cycle must take less.
MIN_LEADER_LEASE = 15.0
_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
ReceiverType = Literal["webhook", "slack"]
RECEIVER_TYPES: tuple[str, ...] = get_args(ReceiverType)
DEFAULT_APPROVAL_TIMEOUT = 15 * 60.0
KIB, MIB, GIB = 1024, 1024**2, 1024**3
_SIZE = re.compile(r"^(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": KIB,
    "MiB": MIB,
    "GiB": GIB,
}


@dataclass(frozen=True)
class EngineConfig:
    name: str  # the inventory name: the `instance` label of everything scraped from it
    agent: str  # collector agent base URL (no trailing slash)
    vllm: str | None = None  # vLLM API server base URL: its /metrics, warm-up requests
    labels: Mapping[str, str] = field(default_factory=dict)

    def targets(self) -> list[Target]:
        """What the embedded evaluator scrapes for this engine."""
        urls = [self.agent] + ([self.vllm] if self.vllm else [])
        return [Target(f"{u}/metrics", self.name) for u in urls]


@dataclass(frozen=True)
class Automation:
    """What happens when an incident of a runbook fires (default: record and notify)."""

    modes: Mapping[str, AutomationMode] = field(default_factory=dict)
    default: AutomationMode = "notify"

    def mode(self, runbook: str | None) -> AutomationMode:
        if runbook is None:
            return "notify"  # diagnose-only alerts have nothing to run
        return self.modes.get(runbook, self.default)


@dataclass(frozen=True)
class WebhookConfig:
    token_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None
    token_name: str = "webhook token"  # the journal's `decided_by` for answers with the token


@dataclass(frozen=True)
class PageConfig:
    """Names (Host) the on-call page answers to beyond loopback, the bind
    address and the host of notifications.page_url."""

    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ApprovalsConfig:
    timeout_seconds: float = DEFAULT_APPROVAL_TIMEOUT


@dataclass(frozen=True)
class ReceiverConfig:
    """Where execution events go: `webhook` (JSON) or `slack` (incoming webhook)."""

    name: str
    type: str
    url: str
    token_file: Path | None = None  # sent as a bearer token


@dataclass(frozen=True)
class NotificationsConfig:
    receivers: tuple[ReceiverConfig, ...] = ()
    retries: int = 4
    backoff_seconds: float = 1.0
    timeout_seconds: float = 5.0
    page_url: str | None = None
    # How long a replica's claim on a queued notification lasts unrenewed:
    # another replica sends it again once a dead replica's claim lapsed.
    claim_lease_seconds: float = 30.0


@dataclass(frozen=True)
class ExecutorConfig:
    """Waits that replace every runbook's own (None: the runbook's value).

    For tests and demos on a small engine: a runbook written for production
    waits minutes (verification deadline, `when: after_seconds`, the healthy
    period of a stepwise revert)."""

    verify_seconds: float | None = None
    condition_seconds: float | None = None
    healthy_period_seconds: float | None = None


@dataclass(frozen=True)
class LimitsConfig:
    """What `runbook serve` takes from a client before it refuses or hangs up
    (runbooks/service/limits.py; docs/service.md, "Limits, timeouts and retention")."""

    webhook_body_bytes: int = 4 * MIB
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    keep_alive_seconds: float = 5.0
    max_connections: int = 100


@dataclass(frozen=True)
class RetentionConfig:
    """How long stored Alertmanager deliveries (webhook_events) are kept."""

    max_age_seconds: float = 7 * 86400.0
    max_bytes: int = 256 * MIB
    interval_seconds: float = 600.0


def default_leader_lease(evaluation_interval: float) -> float:
    return max(MIN_LEADER_LEASE, 3 * evaluation_interval)


@dataclass(frozen=True)
class Config:
    path: Path | None = None  # None: built from defaults, no file
    database: str | None = None  # None: the store decides ($RUNBOOK_DB_URL, then SQLite)
    engines: tuple[EngineConfig, ...] = ()
    evaluation_interval: float = DEFAULT_EVALUATION_INTERVAL
    catalog: Path | None = None  # None: the built-in catalog
    overrides: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    automation: Automation = field(default_factory=Automation)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    page: PageConfig = field(default_factory=PageConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    approvals: ApprovalsConfig = field(default_factory=ApprovalsConfig)
    notifications: NotificationsConfig = field(default_factory=NotificationsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    leader_lease: float = MIN_LEADER_LEASE  # seconds; default max(15 s, 3 x interval)
    # line of each alert under rules.overrides, to place the catalog's complaints
    override_lines: Mapping[str, int] = field(default_factory=dict, repr=False)

    def load_rules(self) -> list[Rule]:
        """The catalog this file names, bound with its overrides; CatalogError if broken."""
        return self.bind(load_catalog(self.catalog))

    def bind(self, catalog: Catalog) -> list[Rule]:
        """The catalog's rules with this file's overrides; problems located in this file."""
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
        if problem.file != "overrides" or self.path is None:
            return problem
        problem.file = None
        return problem.located(file=str(self.path), line=self.override_lines.get(alert or ""))


def load_config(path: str | Path | None, *, runbooks: Collection[str] | None = None) -> Config:
    """Read and validate a configuration file; None gives the defaults.

    `runbooks`: the runbook names the automation section may name (the caller
    knows the runbook catalog, this layer does not); None accepts any name."""
    if path is None:
        return Config()
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
        return Config(path=path)
    if not isinstance(doc, MarkedDict):
        msg = "a configuration file is a mapping (database, engines, rules, ...)"
        raise CatalogError([SyntaxProblem(msg, file=shown, line=1)], what=CONFIGURATION)
    try:
        model = _File.model_validate(doc, context={"runbooks": runbooks})
    except ValidationError as exc:
        problems = validation_problems(exc, doc, shown, wording="schema", model=_File)
        problems.sort(key=lambda p: p.line or 0)  # file order, whichever check found it
        raise CatalogError(problems, what=CONFIGURATION) from None
    return _build(model, doc, path)


# -- the file's schema -----------------------------------------------------------------
# Validators raise PydanticCustomError whose type says how the message joins the
# key's dotted path: "phrase" -> `PATH message`, "detail" -> `PATH: message`,
# "whole" -> `message` (it names its section itself). yamlmarks adds file:line.


def _phrase(message: str) -> PydanticCustomError:
    return PydanticCustomError("phrase", message)


def _detail(message: str) -> PydanticCustomError:
    return PydanticCustomError("detail", message)


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _phrase(f"must be a non-empty string, got {value!r}")
    return value.strip()


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _phrase(f"must be an http(s) URL, got {value!r}")
    return value.rstrip("/")


def _engine_name(value: str) -> str:
    if not _ENGINE_NAME.match(value):
        raise _phrase(f"{value!r}: use letters, digits, _ . : -")
    return value


def _duration(value: object) -> float:
    try:
        return parse_duration(value)
    except Problem as exc:
        raise _detail(exc.message) from None


def _size(value: object) -> int:
    """Bytes: a positive integer, or one with a unit (``4MiB``, ``256MB``, ``64KiB``)."""
    match = None
    if isinstance(value, int) and not isinstance(value, bool):
        match = _SIZE.match(str(value))
    elif isinstance(value, str):
        match = _SIZE.match(value.strip())
    if match is None:
        raise _detail(f"bad size {value!r}: expected bytes, or e.g. '64KiB', '4MiB', '256MB'")
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size <= 0:
        raise _phrase("must be positive")
    return size


def _labels(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise _phrase("must be a mapping")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise _detail(f"keys and values must be strings ({bad})")
    return dict(value)


def _mode(value: object) -> object:
    if value not in AUTOMATION_MODES:
        raise _detail(f"{value!r} is not one of {', '.join(AUTOMATION_MODES)}")
    return value


def _runbook_key(name: str, info: ValidationInfo) -> str:
    known: Collection[str] | None = (info.context or {}).get("runbooks")
    if name == "default" or known is None or name in known:
        return name
    raise PydanticCustomError(
        "whole",
        f"automation: unknown runbook {name!r} (known: {', '.join(sorted(known))}, or default)",
    )


def _override(value: object) -> dict[str, object]:
    if not isinstance(value, Mapping):
        raise _detail("expected {parameter: value}")
    return dict(value)


_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host(value: str) -> str:
    name = value.strip().lower().removeprefix("[").removesuffix("]")
    if not (_is_ip(name) or _HOST_NAME.match(name)):
        raise _detail(f"{value!r} is not a host name (no scheme, port or path: runbook.example)")
    return name


Text = Annotated[str, BeforeValidator(_text)]
HostName = Annotated[str, BeforeValidator(_text), AfterValidator(_host)]
Url = Annotated[str, BeforeValidator(_text), AfterValidator(_url)]
Duration = Annotated[float, BeforeValidator(_duration)]


class _Section(BaseModel):
    """A mapping of the file: unknown keys are errors; `key:` with no value is the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _absent_if_null(cls, data: Any) -> Any:
        if isinstance(data, Mapping):  # an unknown key stays, to be reported
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class _Engine(_Section):
    name: Annotated[str, BeforeValidator(_text), AfterValidator(_engine_name)]
    agent: Url
    vllm: Url | None = None
    labels: Annotated[dict[str, str], BeforeValidator(_labels)] = Field(default_factory=dict)


def _unique_names(value: Any, handler: Any) -> list[_Engine]:
    """Engine names are unique: checked even when other engine entries are broken."""
    errors: list[InitErrorDetails] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value if isinstance(value, MarkedList) else ()):
        raw = item.get("name") if isinstance(item, MarkedDict) else None
        if not isinstance(raw, str) or not _ENGINE_NAME.match(name := raw.strip()):
            continue  # the name's own validation reports it
        if name in seen:
            dup = _phrase(f"{name!r} already used at line {seen[name]}")
            errors.append({"type": dup, "loc": (i, "name"), "input": raw})
        else:
            seen[name] = item.line_of("name")
    try:
        engines: list[_Engine] = handler(value)
    except ValidationError as exc:
        errors += [
            {"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": e["input"]}
            for e in exc.errors()
        ]
    if errors:
        raise ValidationError.from_exception_data("engines", errors)
    return engines


class _Rules(_Section):
    evaluation_interval: Duration = DEFAULT_EVALUATION_INTERVAL
    leader_lease: Duration | None = None
    catalog: Text | None = None
    overrides: dict[
        Annotated[str, BeforeValidator(str)],  # an alert name YAML read as a number
        Annotated[dict[str, object], BeforeValidator(_override)],
    ] = Field(default_factory=dict)

    @field_validator("leader_lease")
    @classmethod
    def _renewed_in_time(cls, lease: float | None, info: ValidationInfo) -> float | None:
        interval = info.data.get("evaluation_interval")
        if lease is not None and interval is not None and lease < 2 * interval:
            raise _phrase(
                f"({lease:g} s) must be at least twice rules.evaluation_interval "
                f"({interval:g} s): the leader renews it every cycle"
            )
        return lease


class _Webhook(_Section):
    token_file: Text | None = None
    username: Text | None = None
    password_file: Text | None = None
    token_name: Text | None = None

    @model_validator(mode="after")
    def _one_scheme(self) -> _Webhook:
        if self.token_file is not None and (self.username or self.password_file):
            raise _detail("give token_file or username + password_file, not both")
        if (self.username is None) != (self.password_file is None):
            raise _detail("basic auth needs both username and password_file")
        if self.token_name is not None and self.username is not None:
            raise _detail("token_name names the token; with basic auth the user name is recorded")
        return self


class _Page(_Section):
    hosts: list[HostName] = Field(default_factory=list)


class _Executor(_Section):
    verify_seconds: Duration | None = None
    condition_seconds: Duration | None = None
    healthy_period_seconds: Duration | None = None


def _positive(value: float) -> float:
    if value <= 0:
        raise _phrase("must be positive")
    return value


def _receiver_type(value: object) -> object:
    if value not in RECEIVER_TYPES:
        raise _detail(f"{value!r} is not one of {', '.join(RECEIVER_TYPES)}")
    return value


class _Approvals(_Section):
    timeout: Annotated[float, BeforeValidator(_duration), AfterValidator(_positive)] = (
        DEFAULT_APPROVAL_TIMEOUT
    )


class _Receiver(_Section):
    name: Text
    type: Annotated[ReceiverType, BeforeValidator(_receiver_type)]
    url: Url
    token_file: Text | None = None


class _Notifications(_Section):
    receivers: list[_Receiver] = Field(default_factory=list)
    retries: Annotated[int, Field(ge=0, le=20, strict=True)] = 4
    backoff: Duration = 1.0
    timeout: Annotated[float, BeforeValidator(_duration), AfterValidator(_positive)] = 5.0
    claim_lease: Duration = 30.0
    page_url: Url | None = None

    @model_validator(mode="after")
    def _unique_receivers(self) -> _Notifications:
        names = [r.name for r in self.receivers]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise _detail(f"receiver names must be unique ({', '.join(dup)})")
        # The claim is renewed every quarter lease, between attempts: one
        # attempt (connect, send, read: up to ~3 timeouts) must fit in the rest.
        if self.claim_lease < 4 * self.timeout:
            raise _detail(
                f"claim_lease ({self.claim_lease:g} s) must be at least "
                f"4 x timeout ({self.timeout:g} s)"
            )
        return self


PositiveDuration = Annotated[float, BeforeValidator(_duration), AfterValidator(_positive)]
Size = Annotated[int, BeforeValidator(_size)]


class _Limits(_Section):
    webhook_body: Size = LimitsConfig.webhook_body_bytes
    header_timeout: PositiveDuration = LimitsConfig.header_timeout_seconds
    body_timeout: PositiveDuration = LimitsConfig.body_timeout_seconds
    keep_alive: PositiveDuration = LimitsConfig.keep_alive_seconds
    max_connections: Annotated[int, Field(ge=1, strict=True)] = LimitsConfig.max_connections


class _Retention(_Section):
    max_age: PositiveDuration = RetentionConfig.max_age_seconds
    max_size: Size = RetentionConfig.max_bytes
    interval: PositiveDuration = RetentionConfig.interval_seconds


class _File(_Section):
    database: Text | None = None
    engines: Annotated[list[_Engine], WrapValidator(_unique_names)] = Field(default_factory=list)
    rules: _Rules = Field(default_factory=_Rules)
    automation: dict[
        Annotated[str, BeforeValidator(str), AfterValidator(_runbook_key)],
        Annotated[AutomationMode, BeforeValidator(_mode)],
    ] = Field(default_factory=dict)
    webhook: _Webhook = Field(default_factory=_Webhook)
    executor: _Executor = Field(default_factory=_Executor)
    approvals: _Approvals = Field(default_factory=_Approvals)
    notifications: _Notifications = Field(default_factory=_Notifications)
    page: _Page = Field(default_factory=_Page)
    limits: _Limits = Field(default_factory=_Limits)
    retention: _Retention = Field(default_factory=_Retention)


def _build(model: _File, doc: MarkedDict, path: Path) -> Config:
    """The validated file as the Config the rest of the code uses."""
    base = path.parent
    rules, hook = model.rules, model.webhook
    modes = dict(model.automation)
    default = modes.pop("default", "notify")
    raw_rules = doc.get("rules")
    raw_overrides = raw_rules.get("overrides") if isinstance(raw_rules, MarkedDict) else None
    lines = raw_overrides.key_lines if isinstance(raw_overrides, MarkedDict) else {}
    return Config(
        path=path,
        database=model.database,
        engines=tuple(EngineConfig(e.name, e.agent, e.vllm, e.labels) for e in model.engines),
        evaluation_interval=rules.evaluation_interval,
        catalog=None if rules.catalog is None else base / rules.catalog,
        overrides=rules.overrides,
        automation=Automation(modes, default),
        webhook=WebhookConfig(
            None if hook.token_file is None else base / hook.token_file,
            hook.username,
            None if hook.password_file is None else base / hook.password_file,
            hook.token_name or WebhookConfig.token_name,
        ),
        page=PageConfig(tuple(model.page.hosts)),
        executor=ExecutorConfig(**model.executor.model_dump()),
        approvals=ApprovalsConfig(model.approvals.timeout),
        notifications=NotificationsConfig(
            tuple(
                ReceiverConfig(
                    r.name, r.type, r.url, None if r.token_file is None else base / r.token_file
                )
                for r in model.notifications.receivers
            ),
            model.notifications.retries,
            model.notifications.backoff,
            model.notifications.timeout,
            model.notifications.page_url,
            model.notifications.claim_lease,
        ),
        limits=LimitsConfig(
            model.limits.webhook_body,
            model.limits.header_timeout,
            model.limits.body_timeout,
            model.limits.keep_alive,
            model.limits.max_connections,
        ),
        retention=RetentionConfig(
            model.retention.max_age, model.retention.max_size, model.retention.interval
        ),
        leader_lease=rules.leader_lease or default_leader_lease(rules.evaluation_interval),
        override_lines={str(a): line for a, line in lines.items()},
    )
