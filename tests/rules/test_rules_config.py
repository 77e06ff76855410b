"""The configuration file: docs/rules.md's example (less its SLOs), defaults, located errors.

The whole file is vllm_runbook.runbooks.model.config's `Config`; the rules layer
loads its own sections (`RulesConfig`) with the same loader."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from vllm_runbook.rules import config as rules_config
from vllm_runbook.rules.config import Automation, EngineConfig, RulesConfig
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scrape import Target
from vllm_runbook.runbooks.model.config import (
    Config,
    ExecutorConfig,
    LimitsConfig,
    RetentionConfig,
    WebhookConfig,
    load_config,
)

FULL = """\
database: postgresql+psycopg://runbook@db/runbook
engines:
  - name: llama-0
    agent: http://127.0.0.1:9360/
    vllm: http://127.0.0.1:8000
    labels: {instance: "127.0.0.1:8000"}
  - name: llama-1
    agent: http://127.0.0.1:9361
rules:
  evaluation_interval: 500ms
  overrides: {VllmLatencySpike: {p99_sla_seconds: 0.5}}
automation:
  oom-pressure: auto
  latency-spike: approve
  default: notify
webhook:
  token_file: secrets/token
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# The runbook catalog is the caller's (runbooks/): these tests pass one of their own.
RUNBOOKS = ("oom-pressure", "latency-spike", "warmup")


def problems(path: Path, runbooks: tuple[str, ...] | None = RUNBOOKS) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_config(path, runbooks=runbooks)
    assert info.value.what == "configuration"
    return [str(p) for p in info.value.problems]


def test_no_file_is_all_defaults() -> None:
    config = load_config(None)
    assert config == Config()
    assert (config.database, config.engines, config.evaluation_interval) == (None, (), 5.0)
    assert config.automation.mode("oom-pressure") == "notify"
    assert config.webhook == WebhookConfig()
    assert len(config.load_rules()) == 25  # the built-in catalog, seed defaults


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    assert load_config(path) == Config()


def test_the_full_sketch(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    config = load_config(path)
    assert config.database == "postgresql+psycopg://runbook@db/runbook"
    assert config.engines == (
        EngineConfig(
            name="llama-0",
            agent="http://127.0.0.1:9360",
            vllm="http://127.0.0.1:8000",
            labels={"instance": "127.0.0.1:8000"},
        ),
        EngineConfig(name="llama-1", agent="http://127.0.0.1:9361"),
    )
    assert config.engines[0].targets() == [
        Target("http://127.0.0.1:9360/metrics", "llama-0"),
        Target("http://127.0.0.1:8000/metrics", "llama-0"),
    ]
    assert config.evaluation_interval == 0.5
    assert config.overrides == {"VllmLatencySpike": {"p99_sla_seconds": 0.5}}
    assert config.automation == Automation(
        {"oom-pressure": "auto", "latency-spike": "approve", "default": "notify"}
    )
    assert config.automation.modes == {"oom-pressure": "auto", "latency-spike": "approve"}
    assert [
        config.automation.mode(r) for r in ("oom-pressure", "latency-spike", "warmup", None)
    ] == [
        "auto",
        "approve",
        "notify",
        "notify",
    ]
    assert config.webhook == WebhookConfig(token_file=tmp_path / "secrets/token")
    [spike] = [r for r in config.load_rules() if r.alert == "VllmLatencySpike"]
    assert spike.params["p99_sla_seconds"] == 0.5


def test_default_mode_applies_to_unlisted_runbooks(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "automation: {default: approve, warmup: notify}\n"))
    assert config.automation.mode("oom-pressure") == "approve"
    assert config.automation.mode("warmup") == "notify"
    assert config.automation.mode(None) == "notify"  # diagnose-only alerts run nothing


def test_every_problem_named_with_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        databse: x
        engines:
          - name: llama-0
            agent: localhost:9360
          - name: llama-0
            agent: http://h:1
            labels: {instance: 8000}
          - agent: http://h:2
        rules:
          evaluation_interval: 5 minutes
        automation:
          oom-pressure: yes-please
          no-such-runbook: auto
        webhook:
          token_file: t
          username: u
        """,
    )
    assert problems(path) == [
        f"{path}:1: unknown key databse (allowed: database, engines, discovery, rules, "
        "automation, mode, slos, webhook, executor, approvals, notifications, page, limits, "
        "retention, breaker)",
        f"{path}:4: engines[0].agent must be an http(s) URL, got 'localhost:9360'",
        f"{path}:5: engines[1].name 'llama-0' already used at line 3",
        f"{path}:7: engines[1].labels: keys and values must be strings (['instance'])",
        f"{path}:8: engines[2].name is required",
        f"{path}:10: rules.evaluation_interval: bad duration '5 minutes': expected e.g. '30s', "
        "'5m', '1h30m'",
        f"{path}:12: automation.oom-pressure: 'yes-please' is not one of auto, approve, notify",
        f"{path}:13: automation: unknown runbook 'no-such-runbook' (known: latency-spike, "
        "oom-pressure, warmup, or default)",
        f"{path}:15: webhook: give token_file or username + password_file, not both",
    ]


def test_automation_names_checked_only_against_a_given_catalog(tmp_path: Path) -> None:
    path = write(tmp_path, "automation: {my-own-runbook: auto, default: approve}\n")
    automation = load_config(path).automation
    assert (automation.modes, automation.default) == ({"my-own-runbook": "auto"}, "approve")
    assert problems(path) == [
        f"{path}:1: automation: unknown runbook 'my-own-runbook' (known: latency-spike, "
        "oom-pressure, warmup, or default)"
    ]
    assert problems(path, runbooks=()) == [
        f"{path}:1: automation: unknown runbook 'my-own-runbook' (known: , or default)"
    ]
    assert load_config(path, runbooks={"my-own-runbook"}).automation.mode("my-own-runbook") == (
        "auto"
    )


def test_executor_waits_and_leader_lease(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        rules: {evaluation_interval: 500ms, leader_lease: 3s}
        executor: {verify_seconds: 10s, condition_seconds: 1500ms}
        """,
    )
    config = load_config(path)
    assert config.executor == ExecutorConfig(verify_seconds=10.0, condition_seconds=1.5)
    assert config.leader_lease == 3.0
    # Default lease: three evaluation intervals, at least 15 s.
    assert load_config(write(tmp_path, "rules: {evaluation_interval: 10s}\n")).leader_lease == 30.0
    assert load_config(None).leader_lease == 15.0
    assert load_config(None).executor == ExecutorConfig()
    path = write(
        tmp_path,
        """\
        rules: {evaluation_interval: 2s, leader_lease: 3s}
        executor:
          verify_seconds: 10
          healthy_period: 5s
        """,
    )
    assert problems(path) == [  # in file order
        f"{path}:1: rules.leader_lease (3 s) must be at least twice rules.evaluation_interval "
        "(2 s): the leader renews it every cycle",
        f"{path}:3: executor.verify_seconds: bad duration 10: give a unit, e.g. '10s'",
        f"{path}:4: unknown key executor.healthy_period (allowed: verify_seconds, "
        "condition_seconds, healthy_period_seconds, hold_seconds)",
    ]


def test_invalid_yaml_and_wrong_shapes(tmp_path: Path) -> None:
    path = write(tmp_path, "rules: [\n")
    [line] = problems(path)
    assert line.startswith(f"{path}:2: invalid YAML")
    path = write(tmp_path, "- 1\n")
    assert problems(path) == [
        f"{path}:1: a configuration file is a mapping (database, engines, rules, ...)"
    ]
    path = write(tmp_path, "engines: {name: x}\nrules: 5\nwebhook: {username: u}\n")
    assert problems(path) == [
        f"{path}:1: engines must be a list of {{name, agent, vllm, labels, router}}",
        f"{path}:2: rules must be a mapping",
        f"{path}:3: webhook: basic auth needs both username and password_file",
    ]
    with pytest.raises(CatalogError) as info:
        load_config(tmp_path / "missing.yaml")
    assert str(info.value) == f"{tmp_path / 'missing.yaml'}: cannot read: No such file or directory"


def test_shapes_and_values_inside_sections(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        database: 5
        engines:
          - 7
          - name: "bad name"
            agent: http://h:1
            port: 80
          - {name: ok, agent: "  ", labels: [a]}
        rules:
          catalog: ""
          overrides:
            VllmOOMPressure: 3
        automation: [oom-pressure]
        webhook:
          username: u
        executor:
          condition_seconds:
        """,
    )
    assert problems(path) == [
        f"{path}:1: database must be a non-empty string, got 5",
        f"{path}:3: engines[0] must be a mapping with name and agent",
        f"{path}:4: engines[1].name 'bad name': use letters, digits, _ . : -",
        f"{path}:6: unknown key engines[1].port (allowed: name, agent, vllm, labels, router)",
        f"{path}:7: engines[2].agent must be a non-empty string, got '  '",
        f"{path}:7: engines[2].labels must be a mapping",
        f"{path}:9: rules.catalog must be a non-empty string, got ''",
        f"{path}:11: rules.overrides.VllmOOMPressure: expected {{parameter: value}}",
        f"{path}:12: automation must be a mapping",
        f"{path}:14: webhook: basic auth needs both username and password_file",
    ]


def test_duplicate_names_found_besides_other_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        engines:
          - {name: a, agent: http://h:1}
          - {name: " a ", agent: nope}
          - {name: b, agent: http://h:3, vllm: ftp://h}
          - {name: a, agent: http://h:4}
        """,
    )
    assert problems(path) == [
        f"{path}:3: engines[1].name 'a' already used at line 2",
        f"{path}:3: engines[1].agent must be an http(s) URL, got 'nope'",
        f"{path}:4: engines[2].vllm must be an http(s) URL, got 'ftp://h'",
        f"{path}:5: engines[3].name 'a' already used at line 2",
    ]


def test_null_values_are_the_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        database:
        engines:
        rules: {evaluation_interval: null, catalog: null}
        automation:
        webhook:
        executor: {verify_seconds: null}
        """,
    )
    assert load_config(path) == Config()
    path = write(tmp_path, "databse:\nrules: {catalgo: null}\n")
    assert problems(path) == [  # a misspelt key is an error even with no value
        f"{path}:1: unknown key databse (allowed: database, engines, discovery, rules, "
        "automation, mode, slos, webhook, executor, approvals, notifications, page, limits, "
        "retention, breaker)",
        f"{path}:2: unknown key rules.catalgo (allowed: evaluation_interval, leader_lease, "
        "replicas, scrape_deadline, scrape_grace, catalog, overrides)",
    ]


def test_override_problems_point_into_the_config_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        rules:
          overrides:
            VllmOOMPressure: {for: 2s}
            VllmLatencySpike: {p99_sla: 0.5}
            VllmNope: {x: 1}
        """,
    )
    config = load_config(path)
    with pytest.raises(CatalogError) as info:
        config.bind(load_catalog())
    assert [str(p) for p in info.value.problems] == [
        f"{path}:4: rule VllmLatencySpike: override of unknown parameter 'p99_sla' (has: "
        "earlier, earlier_rise, for, p99_sla_seconds, queue_rise, window)",
        f"{path}:5: override for unknown alert 'VllmNope'",
    ]


def test_catalog_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    path = write(tmp_path, "rules: {catalog: mine}\n")
    config = load_config(path)
    assert config.catalog == tmp_path / "mine"
    with pytest.raises(CatalogError, match=r"no \*\.yaml rule files"):
        config.load_rules()


def test_approvals_and_notifications(tmp_path: Path) -> None:
    (tmp_path / "hook.token").write_text("t\n")
    path = write(
        tmp_path,
        """\
        approvals: {timeout: 90s}
        notifications:
          receivers:
            - {name: ops, type: webhook, url: "http://127.0.0.1:9/hook/", token_file: hook.token}
            - {name: chat, type: slack, url: "https://hooks.example/x"}
          retries: 2
          backoff: 500ms
          timeout: 3s
          claim_lease: 1m
          page_url: http://runbook.example:8080
        """,
    )
    config = load_config(path)
    assert config.approvals.timeout_seconds == 90.0
    n = config.notifications
    assert [(r.name, r.type, r.url, r.token_file) for r in n.receivers] == [
        ("ops", "webhook", "http://127.0.0.1:9/hook", tmp_path / "hook.token"),
        ("chat", "slack", "https://hooks.example/x", None),
    ]
    assert (n.retries, n.backoff_seconds, n.timeout_seconds, n.page_url) == (
        2,
        0.5,
        3.0,
        "http://runbook.example:8080",
    )
    assert n.claim_lease_seconds == 60.0
    assert load_config(None).approvals.timeout_seconds == 15 * 60.0
    assert load_config(None).notifications.claim_lease_seconds == 30.0


def test_a_claim_lease_shorter_than_four_timeouts_is_refused(tmp_path: Path) -> None:
    """A claim is renewed every quarter lease, between attempts: an attempt
    (up to a few timeouts) must fit, or a live replica's claim would lapse and
    another replica would send the same event again."""
    path = write(
        tmp_path,
        """\
        notifications:
          timeout: 10s
          claim_lease: 30s
        """,
    )
    assert problems(path) == [
        f"{path}:2: notifications: claim_lease (30 s) must be at least 4 x timeout (10 s)"
    ]


def test_bad_notifications_are_named_with_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        approvals: {timeout: 0s}
        notifications:
          receivers:
            - {name: ops, type: pager, url: "http://127.0.0.1:9"}
            - {name: chat, type: slack, url: "hooks.example"}
          retries: -1
        """,
    )
    assert problems(path) == [
        f"{path}:1: approvals.timeout: bad duration '0s': must be positive",
        f"{path}:4: notifications.receivers[0].type: 'pager' is not one of webhook, slack",
        f"{path}:5: notifications.receivers[1].url must be an http(s) URL, got 'hooks.example'",
        f"{path}:6: notifications.retries: Input should be greater than or equal to 0",
    ]


def test_the_page_names_and_the_tokens_name(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        webhook:
          token_file: t
          token_name: alertmanager-prod
        page:
          hosts: [Runbook.Internal, 10.0.0.5, "[::1]"]
        """,
    )
    config = load_config(path)
    assert config.webhook.token_name == "alertmanager-prod"
    assert config.page.hosts == ("runbook.internal", "10.0.0.5", "::1")
    assert load_config(write(tmp_path, "database: x\n")).webhook.token_name == "webhook token"
    path = write(
        tmp_path,
        """\
        webhook:
          username: u
          password_file: p
          token_name: x
        page:
          hosts: [ok.example, "https://runbook.example", "runbook.example:8080"]
          url: x
        """,
    )
    assert problems(path) == [
        f"{path}:2: webhook: token_name names the token; with basic auth the user name is recorded",
        f"{path}:6: page.hosts[1]: 'https://runbook.example' is not a host name (no scheme, port "
        "or path: runbook.example)",
        f"{path}:6: page.hosts[2]: 'runbook.example:8080' is not a host name (no scheme, port "
        "or path: runbook.example)",
        f"{path}:7: unknown key page.url (allowed: hosts)",
    ]


def test_limits_and_retention(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        limits:
          webhook_body: 8MiB
          header_timeout: 2s
          body_timeout: 1m
          keep_alive: 500ms
          max_connections: 32
          max_client_connections: 4
        retention: {max_age: 2d, max_size: 1GB, interval: 30s}
        """,
    )
    config = load_config(path)
    assert config.limits == LimitsConfig(
        webhook_body_bytes=8 * 1024**2,
        header_timeout_seconds=2.0,
        body_timeout_seconds=60.0,
        keep_alive_seconds=0.5,
        max_connections=32,
        max_client_connections=4,
    )
    assert config.limits.client_connections == 4
    assert config.retention == RetentionConfig(
        max_age_seconds=2 * 86400.0, max_bytes=10**9, interval_seconds=30.0
    )
    defaults = load_config(None)
    assert defaults.limits == LimitsConfig(
        webhook_body_bytes=4 * 1024**2,
        header_timeout_seconds=10.0,
        body_timeout_seconds=30.0,
        keep_alive_seconds=5.0,
        max_connections=100,
    )
    assert defaults.limits.client_connections == 50  # half of max_connections
    assert defaults.retention == RetentionConfig(
        max_age_seconds=7 * 86400.0, max_bytes=256 * 1024**2, interval_seconds=600.0
    )
    path = write(tmp_path, "limits: {webhook_body: 4096}\nretention: {max_size: 64KiB}\n")
    config = load_config(path)
    assert (config.limits.webhook_body_bytes, config.retention.max_bytes) == (4096, 65536)


def test_bad_limits_and_retention_are_named_with_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        limits:
          webhook_body: 4 apples
          header_timeout: 0s
          max_connections: 0
          max_body: 1
        retention:
          max_age: forever
          max_size: 0
        """,
    )
    assert problems(path) == [
        f"{path}:2: limits.webhook_body: bad size '4 apples': expected bytes, "
        "or e.g. '64KiB', '4MiB', '256MB'",
        f"{path}:3: limits.header_timeout: bad duration '0s': must be positive",
        f"{path}:4: limits.max_connections: Input should be greater than or equal to 1",
        f"{path}:5: unknown key limits.max_body (allowed: webhook_body, header_timeout, "
        "body_timeout, keep_alive, max_connections, max_client_connections)",
        f"{path}:7: retention.max_age: bad duration 'forever': expected e.g. '30s', '5m', '1h30m'",
        f"{path}:8: retention.max_size must be positive",
    ]


def test_the_rules_layer_loads_its_own_sections(tmp_path: Path) -> None:
    """The rules layer reads engines, rules and automation with the same loader and
    wording (`load_file` on its model), knowing nothing of the service's sections
    (checked by Config, whose loader owns the file: runbooks/model/config.py)."""
    path = write(tmp_path, FULL + "limits: {webhook_body: 1MiB}\nanything: else\n")
    config = rules_config.load_file(RulesConfig, path, runbooks=RUNBOOKS)
    assert isinstance(config, RulesConfig)
    assert [e.name for e in config.engines] == ["llama-0", "llama-1"]
    assert config.rules.evaluation_interval == 0.5
    assert config.rules.leader_lease == 15.0
    assert config.automation.mode("oom-pressure") == "auto"
    assert rules_config.load_file(RulesConfig, None) == RulesConfig()
    path = write(tmp_path, "rules: {evaluation_interval: 1m, leader_lease: 1m}\nwebhook: 3\n")
    with pytest.raises(CatalogError) as info:
        rules_config.load_file(RulesConfig, path)
    assert [str(p) for p in info.value.problems] == [
        f"{path}:1: rules.leader_lease (60 s) must be at least twice rules.evaluation_interval "
        "(60 s): the leader renews it every cycle"
    ]


def test_sections_built_in_python_take_seconds_and_the_file_keys_only_in_files(
    tmp_path: Path,
) -> None:
    assert ExecutorConfig(verify_seconds=5).verify_seconds == 5.0
    assert WebhookConfig(token_file=Path("t")).token_file == Path("t")
    path = write(tmp_path, "approvals: {timeout_seconds: 5s}\n")
    assert problems(path) == [f"{path}:1: unknown key approvals.timeout_seconds (allowed: timeout)"]
