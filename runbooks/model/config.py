"""The deployment's configuration file, whole: the service's sections and `Config`.

    database: sqlite:///runbook.db            # default: the store's own default
    engines: [...]                            # the rules layer's sections:
    discovery:                                # engines found, not listed (service/discovery.py)
      refresh_interval: 30s
      prometheus:                             # its active targets of these jobs / labels
        url: http://prometheus.monitoring:9090
        jobs: [vllm-runbook-agents]
        match: {namespace: "llm-.*"}          # label: regex (anchored, like =~)
        bearer_token_file: secrets/prom-token # or username + password_file; ca_file
      file_sd: [engines/*.json]               # Prometheus' file_sd format (JSON or YAML)
      vllm_port: 8000                         # vLLM's API server beside each agent
      agent_tokens:                           # the agents' bearer tokens (files)
        file: secrets/agent-token             # the fleet's token
        by_label:                             # first match wins, before `file`
          - {match: {namespace: team-a}, file: secrets/team-a-token}
    rules: {...}                              #   vllm_runbook.rules.config
    automation: {...}
    mode: act                                 # or advisory: journal and notify, change nothing
    webhook:
      token_file: secrets/webhook-token       # or username + password_file (basic auth)
      token_name: alertmanager                # who an answer with the token is recorded as
    page:
      hosts: [runbook.internal]               # more names the page answers to (Host)
    approvals:
      timeout: 15m                            # an unanswered approval is then refused
    notifications:                            # execution events (runbooks/service/notify.py)
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
      hold_seconds: 10s                       # a fix holds this long after its alert resolved
    limits:                                   # what `runbook serve` takes from a client
      webhook_body: 4MiB                      # a larger delivery: 413
      header_timeout: 10s                     # a request's head must arrive within this
      body_timeout: 30s                       # and its body within this after the head
      keep_alive: 5s                          # an idle connection is closed after this
      max_connections: 100                    # beyond: 503 (Alertmanager retries)
    breaker:                                  # the circuit breaker (runbooks/service/breaker.py)
      watch: 10m                              # each change is watched this long after it
      preemption_rate: 0.01                   # trip above 1 % preemptions per finished request
      error_rate: 0.005                       # trip above 0.5 % errors per finished request
      p99_sla: 2s                             # trip when the P99 end-to-end latency exceeds it
      min_finished: 100                       # the rates' denominator is at least this
      cooldown: 10m                           # no automatic change on a tripped engine meanwhile
      interval: 5s                            # how often the watched changes are measured
    retention:                                # stored Alertmanager deliveries
      max_age: 7d                             # older ones are deleted
      max_size: 256MiB                        # and the oldest beyond this total
      interval: 10m                           # how often the service prunes

Each section is a frozen pydantic model, used as it is validated. Where a key
of the file and the attribute differ (`timeout` -> `timeout_seconds`), the
key is the field's validation alias. The loader, the shared field types and
the error wording are the rules layer's (vllm_runbook.rules.config).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from vllm_runbook.rules.config import (
    Automation,
    Duration,
    Engines,
    PositiveDuration,
    RelativePath,
    RulesSection,
    Section,
    Text,
    Url,
    detail,
    load_file,
    phrase,
)
from vllm_runbook.rules.model import Catalog, Rule
from vllm_runbook.rules.slo import Slos
from vllm_runbook.runbooks.model.spec import Runbook, RunMode

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


def _size(value: object) -> int:
    """Bytes: a positive integer, or one with a unit (``4MiB``, ``256MB``, ``64KiB``)."""
    match = None
    if isinstance(value, int) and not isinstance(value, bool):
        match = _SIZE.match(str(value))
    elif isinstance(value, str):
        match = _SIZE.match(value.strip())
    if match is None:
        raise detail(f"bad size {value!r}: expected bytes, or e.g. '64KiB', '4MiB', '256MB'")
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size <= 0:
        raise phrase("must be positive")
    return size


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
        raise detail(f"{value!r} is not a host name (no scheme, port or path: runbook.example)")
    return name


def _receiver_type(value: object) -> object:
    if value not in RECEIVER_TYPES:
        raise detail(f"{value!r} is not one of {', '.join(RECEIVER_TYPES)}")
    return value


HostName = Annotated[Text, AfterValidator(_host)]
Size = Annotated[int, BeforeValidator(_size)]


class WebhookConfig(Section):
    """How Alertmanager's deliveries (and the page's answers) authenticate."""

    token_file: RelativePath | None = None
    username: Text | None = None
    password_file: RelativePath | None = None
    token_name: Text = "webhook token"
    """The journal's `decided_by` for answers with the token."""

    @model_validator(mode="after")
    def _one_scheme(self) -> WebhookConfig:
        if self.token_file is not None and (self.username or self.password_file):
            raise detail("give token_file or username + password_file, not both")
        if (self.username is None) != (self.password_file is None):
            raise detail("basic auth needs both username and password_file")
        if "token_name" in self.model_fields_set and self.username is not None:
            raise detail("token_name names the token; with basic auth the user name is recorded")
        return self


class PageConfig(Section):
    """Names (Host) the on-call page answers to beyond loopback, the bind
    address and the host of notifications.page_url."""

    hosts: tuple[HostName, ...] = ()


class ApprovalsConfig(Section):
    timeout_seconds: PositiveDuration = Field(
        default=DEFAULT_APPROVAL_TIMEOUT, validation_alias="timeout"
    )
    """An unanswered approval is refused after this."""


class ReceiverConfig(Section):
    """Where execution events go: `webhook` (JSON) or `slack` (incoming webhook)."""

    name: Text
    type: Annotated[ReceiverType, BeforeValidator(_receiver_type)]
    url: Url
    token_file: RelativePath | None = None
    """Sent as a bearer token."""


class NotificationsConfig(Section):
    receivers: tuple[ReceiverConfig, ...] = ()
    retries: Annotated[int, Field(ge=0, le=20, strict=True)] = 4
    """After the first attempt."""
    backoff_seconds: Duration = Field(default=1.0, validation_alias="backoff")
    """Before the first retry, doubled each time."""
    timeout_seconds: PositiveDuration = Field(default=5.0, validation_alias="timeout")
    """Per attempt."""
    claim_lease_seconds: Duration = Field(default=30.0, validation_alias="claim_lease")
    """How long a replica's claim on a queued notification lasts unrenewed:
    another replica sends it again once a dead replica's claim lapsed."""
    page_url: Url | None = None
    """Links in messages (None: none)."""

    @model_validator(mode="after")
    def _unique_receivers(self) -> NotificationsConfig:
        names = [r.name for r in self.receivers]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise detail(f"receiver names must be unique ({', '.join(dup)})")
        # The claim is renewed every quarter lease, between attempts: one
        # attempt (connect, send, read: up to ~3 timeouts) must fit in the rest.
        if self.claim_lease_seconds < 4 * self.timeout_seconds:
            raise detail(
                f"claim_lease ({self.claim_lease_seconds:g} s) must be at least "
                f"4 x timeout ({self.timeout_seconds:g} s)"
            )
        return self


class ExecutorConfig(Section):
    """Waits that replace every runbook's own (None: the runbook's value).

    For tests and demos on a small engine: a runbook written for production
    waits minutes (verification deadline, `when: after_seconds`, the healthy
    period of a stepwise revert)."""

    verify_seconds: Duration | None = None
    condition_seconds: Duration | None = None
    healthy_period_seconds: Duration | None = None
    hold_seconds: Duration | None = None
    """Each runbook's `revert.hold_seconds`: how long a fix holds after its
    alert resolved (its `until` conditions that long on end) before the revert."""


class LimitsConfig(Section):
    """What `runbook serve` takes from a client before it refuses or hangs up
    (runbooks/service/limits.py; docs/service.md, "Limits, timeouts and retention")."""

    webhook_body_bytes: Size = Field(default=4 * MIB, validation_alias="webhook_body")
    header_timeout_seconds: PositiveDuration = Field(
        default=10.0, validation_alias="header_timeout"
    )
    body_timeout_seconds: PositiveDuration = Field(default=30.0, validation_alias="body_timeout")
    keep_alive_seconds: PositiveDuration = Field(default=5.0, validation_alias="keep_alive")
    max_connections: Annotated[int, Field(ge=1, strict=True)] = 100
    # One client's open connections; None: half of max_connections (at least 1).
    max_client_connections: Annotated[int, Field(ge=1, strict=True)] | None = None

    @property
    def client_connections(self) -> int:
        """The most connections one client address may hold open at once."""
        if self.max_client_connections is not None:
            return self.max_client_connections
        return max(1, self.max_connections // 2)


class RetentionConfig(Section):
    """How long stored Alertmanager deliveries (webhook_events) are kept."""

    max_age_seconds: PositiveDuration = Field(default=7 * 86400.0, validation_alias="max_age")
    max_bytes: Size = Field(default=256 * MIB, validation_alias="max_size")
    interval_seconds: PositiveDuration = Field(default=600.0, validation_alias="interval")


def _label_regex(value: object) -> dict[str, re.Pattern[str]]:
    if not isinstance(value, dict):
        raise phrase("must be a mapping of label name to regular expression")
    out: dict[str, re.Pattern[str]] = {}
    for key, pattern in value.items():
        if not isinstance(key, str) or not isinstance(pattern, str):
            raise detail(f"label {key!r}: name and regular expression must be strings")
        try:
            out[key] = re.compile(f"(?:{pattern})")
        except re.error as exc:
            raise detail(f"label {key!r}: bad regular expression {pattern!r} ({exc})") from None
    return out


LabelMatch = Annotated[dict[str, re.Pattern[str]], BeforeValidator(_label_regex)]


def label_matches(match: dict[str, re.Pattern[str]], labels: dict[str, str]) -> bool:
    """Every matcher holds on the whole value (Prometheus' `=~`; absent = "")."""
    return all(p.fullmatch(labels.get(k, "")) is not None for k, p in match.items())


class PrometheusDiscovery(Section):
    """Engines = a Prometheus' active scrape targets of `jobs` (any, if empty)
    whose labels match `match`; at least one of the two is given."""

    url: Url
    jobs: tuple[Text, ...] = ()
    match: LabelMatch = Field(default_factory=dict)
    bearer_token_file: RelativePath | None = None
    username: Text | None = None
    password_file: RelativePath | None = None
    ca_file: RelativePath | None = None
    timeout_seconds: PositiveDuration = Field(default=10.0, validation_alias="timeout")

    @model_validator(mode="after")
    def _selects(self) -> PrometheusDiscovery:
        if not self.jobs and not self.match:
            raise detail("name the agents' scrape jobs (jobs) or label matchers (match)")
        if self.bearer_token_file is not None and (self.username or self.password_file):
            raise detail("give bearer_token_file or username + password_file, not both")
        if (self.username is None) != (self.password_file is None):
            raise detail("basic auth needs both username and password_file")
        return self


class TokenByLabel(Section):
    match: LabelMatch
    file: RelativePath


class AgentTokens(Section):
    """The agents' bearer tokens, from files (Kubernetes Secrets mounted as files):
    the first `by_label` entry whose matchers hold on the engine's labels, else `file`."""

    file: RelativePath | None = None
    by_label: tuple[TokenByLabel, ...] = ()


class DiscoveryConfig(Section):
    refresh_interval_seconds: PositiveDuration = Field(
        default=30.0, validation_alias="refresh_interval"
    )
    prometheus: PrometheusDiscovery | None = None
    file_sd: tuple[RelativePath, ...] = ()
    """Files (glob patterns) in Prometheus' file_sd format."""
    vllm_port: Annotated[int, Field(ge=1, le=65535, strict=True)] | None = None
    """vLLM's API server: this port on the agent's host (None: not known)."""
    agent_tokens: AgentTokens = Field(default_factory=AgentTokens)

    @property
    def enabled(self) -> bool:
        return self.prometheus is not None or bool(self.file_sd)


class BreakerConfig(Section):
    """The reports' circuit breaker (runbooks/service/breaker.py): every change a
    runbook, the autopilot or another automatic tuner makes is watched for
    `watch` after it took effect, against absolute limits."""

    enabled: bool = True
    watch_seconds: PositiveDuration = Field(default=600.0, validation_alias="watch")
    """How long after a change it is watched."""
    preemption_rate: Annotated[float, Field(gt=0, le=1)] = 0.01
    """Preemptions (the engine's OOM answer) per finished request above which it trips."""
    error_rate: Annotated[float, Field(gt=0, le=1)] = 0.005
    """Requests finished with an error per finished request above which it trips."""
    p99_sla_seconds: PositiveDuration | None = Field(default=None, validation_alias="p99_sla")
    """The P99 end-to-end latency above which it trips (None: no SLA, not judged)."""
    min_finished: Annotated[int, Field(ge=1, strict=True)] = 100
    """The rates' denominator is at least this many requests (a storm that
    finishes nothing still trips; one preemption among the first few
    requests does not), and the P99 is judged only over this many."""
    cooldown_seconds: Duration = Field(default=600.0, validation_alias="cooldown")
    """After a trip, automatic executions on that engine are refused this long."""
    interval_seconds: PositiveDuration = Field(default=5.0, validation_alias="interval")
    """How often the watched changes are measured."""


class Config(Section):
    """The whole file: the rules layer's sections and the service's."""

    database: Text | None = None
    """None: the store decides ($RUNBOOK_DB_URL, then SQLite)."""
    engines: Engines = ()
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    rules: RulesSection = Field(default_factory=RulesSection)
    automation: Automation = Field(default_factory=Automation)
    mode: RunMode = "act"
    """advisory: every runbook's executions are advice (journaled, notified,
    nothing changed on an engine; runbooks/run/advisory.py); act: each runbook's own `mode`."""
    slos: Slos = ()
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    approvals: ApprovalsConfig = Field(default_factory=ApprovalsConfig)
    notifications: NotificationsConfig = Field(default_factory=NotificationsConfig)
    page: PageConfig = Field(default_factory=PageConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)

    # The rules section, as the service reads it.
    @property
    def evaluation_interval(self) -> float:
        return self.rules.evaluation_interval

    @property
    def leader_lease(self) -> float:
        return self.rules.leader_lease

    @property
    def catalog(self) -> Path | None:
        return self.rules.catalog

    @property
    def overrides(self) -> dict[str, dict[str, object]]:
        return self.rules.overrides

    def advisory(self, runbooks: Mapping[str, Runbook]) -> frozenset[str]:
        """The runbooks whose executions are advice: all in advisory mode, else
        those whose spec says `mode: advisory`."""
        return frozenset(
            name
            for name, spec in runbooks.items()
            if self.mode == "advisory" or spec.mode == "advisory"
        )

    def load_rules(self) -> list[Rule]:
        return self.rules.load_rules()

    def bind(self, catalog: Catalog) -> list[Rule]:
        return self.rules.bind(catalog)


def load_config(path: str | Path | None, *, runbooks: Collection[str] | None = None) -> Config:
    """Read and validate the whole configuration file; None gives the defaults.

    `runbooks`: the runbook names the automation section may name; None
    accepts any name. CatalogError (rules.errors) with every problem."""
    return load_file(Config, path, runbooks=runbooks)
