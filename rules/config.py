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
    executor:                                 # override every runbook's waits (tests, demos)
      verify_seconds: 10s                     # verification deadline
      condition_seconds: 2s                   # each step's `when: after_seconds`
      healthy_period_seconds: 5s              # between the stages of a stepwise revert

Every key has a default, so no file at all is a valid one-machine setup.
Relative paths are relative to the file. Unknown keys are errors (a typo must
not silently fall back to a default); every problem is reported at once, as
``file:line: message``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args
from urllib.parse import urlsplit

from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.rules.errors import (
    CatalogError,
    ConfigError,
    RuleProblem,
    RuleSyntaxError,
    UnknownParameterError,
)
from vllm_runbook.rules.model import Catalog, Rule, load_catalog
from vllm_runbook.rules.premerge_runbook_names import RUNBOOK_NAMES
from vllm_runbook.rules.scrape import Target
from vllm_runbook.rules.yamlmarks import MarkedDict, MarkedList, load

AutomationMode = Literal["auto", "approve", "notify"]
AUTOMATION_MODES: tuple[str, ...] = get_args(AutomationMode)
DEFAULT_EVALUATION_INTERVAL = 5.0
# The rules leader's lease: a replica that stops renewing it (crash, lost
# database) is replaced within this time; a cycle must take less.
MIN_LEADER_LEASE = 15.0
_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_TOP_KEYS = ("database", "engines", "rules", "automation", "webhook", "executor")
_EXECUTOR_KEYS = ("verify_seconds", "condition_seconds", "healthy_period_seconds")


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


@dataclass(frozen=True)
class ExecutorConfig:
    """Waits that replace every runbook's own (None: the runbook's value).

    For tests and demos on a small engine: a runbook written for production
    waits minutes (verification deadline, `when: after_seconds`, the healthy
    period of a stepwise revert)."""

    verify_seconds: float | None = None
    condition_seconds: float | None = None
    healthy_period_seconds: float | None = None


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
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    leader_lease: float = MIN_LEADER_LEASE  # seconds; default max(15 s, 3 x interval)
    # line of each alert under rules.overrides, to place the catalog's complaints
    override_lines: Mapping[str, int] = field(default_factory=dict, repr=False)

    def load_rules(self) -> list[Rule]:
        """The catalog this file names, bound with its overrides; CatalogError if broken."""
        return self.bind(load_catalog(self.catalog))

    def bind(self, catalog: Catalog) -> list[Rule]:
        """The catalog's rules with this file's overrides; problems located in this file."""
        known = set(catalog.alerts)
        problems: list[RuleProblem] = [
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

    def _locate(self, problem: RuleProblem, alert: str | None) -> RuleProblem:
        # The catalog names bad overrides with file "overrides": point at this file.
        if problem.file != "overrides" or self.path is None:
            return problem
        problem.file = None
        return problem.located(file=str(self.path), line=self.override_lines.get(alert or ""))


def load_config(path: str | Path | None) -> Config:
    """Read and validate a configuration file; None gives the defaults."""
    if path is None:
        return Config()
    path = Path(path)
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([RuleSyntaxError(f"cannot read: {exc.strerror}", file=shown)]) from None
    try:
        doc = load(text, shown)
    except RuleProblem as exc:
        raise ConfigError([exc]) from None
    reader = _Reader(shown, path.parent)
    config = reader.config(doc, path)
    if reader.problems:
        raise ConfigError(reader.problems)
    return config


class _Reader:
    """Validates the document, collecting every problem instead of stopping at the first."""

    def __init__(self, file: str, base: Path) -> None:
        self.file = file
        self.base = base
        self.problems: list[RuleProblem] = []

    def fail(self, msg: str, line: int | None) -> None:
        self.problems.append(RuleSyntaxError(msg, file=self.file, line=line))

    def mapping(self, parent: MarkedDict, key: str) -> MarkedDict | None:
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, MarkedDict):
            self.fail(f"{key} must be a mapping", parent.line_of(key))
            return None
        return value

    def unknown_keys(self, node: MarkedDict, allowed: tuple[str, ...], where: str) -> None:
        for key in node:
            if key not in allowed:
                self.fail(
                    f"unknown key {where}{key!s} (allowed: {', '.join(allowed)})", node.line_of(key)
                )

    def string(
        self, node: MarkedDict, key: str, what: str, *, required: bool = False
    ) -> str | None:
        value = node.get(key)
        if value is None:
            if required:
                self.fail(f"{what} is required", node.line)
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(f"{what} must be a non-empty string, got {value!r}", node.line_of(key))
            return None
        return value.strip()

    def url(self, node: MarkedDict, key: str, what: str, *, required: bool = False) -> str | None:
        value = self.string(node, key, what, required=required)
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self.fail(f"{what} must be an http(s) URL, got {value!r}", node.line_of(key))
            return None
        return value.rstrip("/")

    def duration(self, node: MarkedDict, key: str, what: str) -> float | None:
        if node.get(key) is None:
            return None
        try:
            return parse_duration(node[key])
        except RuleProblem as exc:
            self.fail(f"{what}: {exc.message}", node.line_of(key))
            return None

    def path(self, node: MarkedDict, key: str, what: str) -> Path | None:
        value = self.string(node, key, what)
        return None if value is None else self.base / value

    # -- sections ----------------------------------------------------------------
    def config(self, doc: object, path: Path) -> Config:
        if doc is None:
            return Config(path=path)
        if not isinstance(doc, MarkedDict):
            self.fail("a configuration file is a mapping (database, engines, rules, ...)", 1)
            return Config(path=path)
        self.unknown_keys(doc, _TOP_KEYS, "")
        database = self.string(doc, "database", "database")
        engines = self.engines(doc)
        rules = self.mapping(doc, "rules")
        interval, catalog, overrides, lines = self.rules(rules)
        lease = default_leader_lease(interval)
        if rules is not None and rules.get("leader_lease") is not None:
            lease = self.duration(rules, "leader_lease", "rules.leader_lease") or lease
            if lease < 2 * interval:
                self.fail(
                    f"rules.leader_lease ({lease:g} s) must be at least twice "
                    f"rules.evaluation_interval ({interval:g} s): the leader renews it every cycle",
                    rules.line_of("leader_lease"),
                )
        return Config(
            path=path,
            database=database,
            engines=engines,
            evaluation_interval=interval,
            catalog=catalog,
            overrides=overrides,
            automation=self.automation(self.mapping(doc, "automation")),
            webhook=self.webhook(self.mapping(doc, "webhook")),
            executor=self.executor(self.mapping(doc, "executor")),
            leader_lease=lease,
            override_lines=lines,
        )

    def engines(self, doc: MarkedDict) -> tuple[EngineConfig, ...]:
        raw = doc.get("engines")
        if raw is None:
            return ()
        if not isinstance(raw, MarkedList):
            self.fail(
                "engines must be a list of {name, agent, vllm, labels}", doc.line_of("engines")
            )
            return ()
        out: list[EngineConfig] = []
        seen: dict[str, int] = {}
        for i, item in enumerate(raw):
            where = f"engines[{i}]"
            if not isinstance(item, MarkedDict):
                self.fail(f"{where} must be a mapping with name and agent", raw.line)
                continue
            self.unknown_keys(item, ("name", "agent", "vllm", "labels"), f"{where}.")
            name = self.string(item, "name", f"{where}.name", required=True)
            if name is not None and not _ENGINE_NAME.match(name):
                self.fail(
                    f"{where}.name {name!r}: use letters, digits, _ . : -", item.line_of("name")
                )
                name = None
            if name is not None and name in seen:
                self.fail(
                    f"{where}.name {name!r} already used at line {seen[name]}", item.line_of("name")
                )
                name = None
            elif name is not None:
                seen[name] = item.line_of("name")
            agent = self.url(item, "agent", f"{where}.agent", required=True)
            vllm = self.url(item, "vllm", f"{where}.vllm")
            labels = self.labels(item, where)
            if name is not None and agent is not None:
                out.append(EngineConfig(name, agent, vllm, labels))
        return tuple(out)

    def labels(self, item: MarkedDict, where: str) -> dict[str, str]:
        raw = self.mapping(item, "labels")
        if raw is None:
            return {}
        bad = [k for k, v in raw.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            self.fail(f"{where}.labels: keys and values must be strings ({bad})", raw.line)
            return {}
        return dict(raw)

    def rules(
        self, node: MarkedDict | None
    ) -> tuple[float, Path | None, dict[str, dict[str, object]], dict[str, int]]:
        if node is None:
            return DEFAULT_EVALUATION_INTERVAL, None, {}, {}
        self.unknown_keys(
            node, ("evaluation_interval", "leader_lease", "catalog", "overrides"), "rules."
        )
        interval = DEFAULT_EVALUATION_INTERVAL
        if node.get("evaluation_interval") is not None:
            try:
                interval = parse_duration(node["evaluation_interval"])
            except RuleProblem as exc:
                self.fail(
                    f"rules.evaluation_interval: {exc.message}", node.line_of("evaluation_interval")
                )
        catalog = self.path(node, "catalog", "rules.catalog")
        raw = self.mapping(node, "overrides")
        overrides: dict[str, dict[str, object]] = {}
        lines: dict[str, int] = {}
        for alert, params in (raw or {}).items():
            line = raw.line_of(alert) if raw is not None else None
            if not isinstance(params, MarkedDict):
                self.fail(f"rules.overrides.{alert}: expected {{parameter: value}}", line)
                continue
            overrides[str(alert)] = dict(params)
            lines[str(alert)] = line or 0
        return interval, catalog, overrides, lines

    def automation(self, node: MarkedDict | None) -> Automation:
        if node is None:
            return Automation()
        modes: dict[str, AutomationMode] = {}
        default: AutomationMode = "notify"
        for key, value in node.items():
            line = node.line_of(key)
            if value not in AUTOMATION_MODES:
                self.fail(
                    f"automation.{key}: {value!r} is not one of {', '.join(AUTOMATION_MODES)}",
                    line,
                )
                continue
            if key == "default":
                default = value
            elif key in RUNBOOK_NAMES:
                modes[key] = value
            else:
                self.fail(
                    f"automation: unknown runbook {key!r} (known: {', '.join(RUNBOOK_NAMES)}, "
                    "or default)",
                    line,
                )
        return Automation(modes, default)

    def webhook(self, node: MarkedDict | None) -> WebhookConfig:
        if node is None:
            return WebhookConfig()
        self.unknown_keys(node, ("token_file", "username", "password_file"), "webhook.")
        token_file = self.path(node, "token_file", "webhook.token_file")
        username = self.string(node, "username", "webhook.username")
        password_file = self.path(node, "password_file", "webhook.password_file")
        if token_file is not None and (username or password_file):
            self.fail("webhook: give token_file or username + password_file, not both", node.line)
        elif (username is None) != (password_file is None):
            self.fail("webhook: basic auth needs both username and password_file", node.line)
        return WebhookConfig(token_file, username, password_file)

    def executor(self, node: MarkedDict | None) -> ExecutorConfig:
        if node is None:
            return ExecutorConfig()
        self.unknown_keys(node, _EXECUTOR_KEYS, "executor.")
        waits = {k: self.duration(node, k, f"executor.{k}") for k in _EXECUTOR_KEYS}
        return ExecutorConfig(**waits)
