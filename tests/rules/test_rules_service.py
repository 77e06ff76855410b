"""The embedded rules service from a config file: refuses broken catalogs, records
incidents in the store, and hands firing ones off only where automation says so."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import yaml
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from rule_server import Routes, serve
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.config import Automation, EngineConfig
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.incidents import IncidentEvent, MemoryIncidentSink
from vllm_runbook.rules.remediation import Dispatcher, Handoff
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.service.rules_service import RulesService
from vllm_runbook.runbooks.store import Journal

LABELS = {"model_name": "tiny", "engine": "0"}


class RecordingHook:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, Handoff]] = []
        self.fail = fail

    def on_firing(self, handoff: Handoff) -> None:
        self.calls.append(("firing", handoff))
        if self.fail:
            raise RuntimeError("executor down")

    def on_resolved(self, handoff: Handoff) -> None:
        self.calls.append(("resolved", handoff))


def write_config(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_refuses_to_start_with_a_broken_catalog(tmp_path: Path) -> None:
    catalog = tmp_path / "rules"
    catalog.mkdir()
    (catalog / "bad.yaml").write_text(
        "rules:\n"
        "  - alert: VllmX\n"
        "    severity: warning\n"
        "    summary: s\n"
        "    description: d\n"
        "    runbook: no-such-runbook\n"
        "    for: 5 minutes\n"
        "    condition: {expr: nope, above: 1}\n"
        "  - alert: VllmY\n"
        "    severity: warning\n"
        "    summary: s\n"
        "    description: d\n"
        "    runbook: null\n"
        "    for: 5m\n"
        "    condition: {expr: nope, above: 1}\n",
        encoding="utf-8",
    )
    config = load_config(write_config(tmp_path, {"rules": {"catalog": "rules"}}))
    scheduler = BackgroundScheduler()
    with pytest.raises(CatalogError) as info:
        RulesService.from_config(config).start(scheduler)
    shown = str(catalog / "bad.yaml")
    # Every broken rule is named; none is dropped silently; nothing was scheduled.
    assert [str(p) for p in info.value.problems] == [
        f"{shown}:6: rule VllmX: unknown runbook 'no-such-runbook' (known: batch-too-large, "
        "batch-utilization-low, engine-stalled, engine-stuck, error-rate-high, gpu-compute-skew, "
        "gpu-memory-imbalance, hot-path-backlog, kv-hit-low, latency-spike, memory-leak, "
        "oom-pressure, padding-high, restore, spec-decode-acceptance-low, "
        "throughput-drop, warmup; or null for diagnose-only)",
        f"{shown}:15: rule VllmY: unknown signal 'nope'",
    ]
    assert scheduler.get_jobs() == []


def test_refuses_to_start_with_a_bad_override(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"rules": {"overrides": {"VllmOOMPressure": {"fo": "2s"}}}})
    with pytest.raises(CatalogError, match=r"runbook.yaml:3: rule VllmOOMPressure: override of "):
        RulesService.from_config(load_config(path))


@pytest.fixture
def agent() -> Iterator[tuple[Routes, CollectorRegistry]]:
    registry = CollectorRegistry()
    with serve() as routes:
        routes.text("/metrics", lambda: generate_latest(registry).decode())
        yield routes, registry


def test_cycle_records_and_hands_off_in_auto_mode(
    tmp_path: Path, agent: tuple[Routes, CollectorRegistry], incident_store: Journal
) -> None:
    routes, registry = agent
    usage = cast(Gauge, M.build(M.KV_CACHE_USAGE_PEAK, registry))
    preemptions = cast(Counter, M.build(M.PREEMPTIONS, registry))
    config = load_config(
        write_config(
            tmp_path,
            {
                "engines": [{"name": "cpu-0", "agent": routes.url}],
                "rules": {
                    "evaluation_interval": "1s",
                    "overrides": {"VllmOOMPressure": {"for": "2s", "window": "10s"}},
                },
                "automation": {"oom-pressure": "auto"},
            },
        )
    )
    hook = RecordingHook()
    service = RulesService.from_config(config, store=incident_store, hook=hook)
    usage.labels(**LABELS).set(0.97)
    preemptions.labels(**LABELS)
    t0 = 1_700_000_000.0
    assert service.run_cycle(t0) == []
    preemptions.labels(**LABELS).inc(2)
    usage.labels(**LABELS).set(0.5)  # blocks freed by the preemption; max_over_time keeps 0.97
    assert [(e.alert, e.state) for e in service.run_cycle(t0 + 1)] == [
        ("VllmOOMPressure", "pending")
    ]
    assert service.run_cycle(t0 + 2) == []
    assert hook.calls == []
    [firing] = service.run_cycle(t0 + 3)
    assert (firing.state, firing.at, firing.first_seen, firing.value) == (
        "firing",
        t0 + 3,
        t0 + 1,
        0.97,
    )
    [(kind, handoff)] = hook.calls
    assert (kind, handoff.mode, handoff.runbook, handoff.engine_name) == (
        "firing",
        "auto",
        "oom-pressure",
        "cpu-0",
    )
    assert handoff.engine == EngineConfig(name="cpu-0", agent=routes.url)
    assert handoff.incident is firing
    [row] = incident_store.list_incidents(open_only=True)
    assert (row.alert, row.engine, row.state, row.severity, row.value) == (
        "VllmOOMPressure",
        "cpu-0",
        "firing",
        "critical",
        0.97,
    )
    # The 0 -> 2 increase needs the t0 sample, which leaves the left-open 10 s window
    # at t0 + 10: resolved then, and the hook hears it.
    assert service.run_cycle(t0 + 9.5) == []
    [resolved] = service.run_cycle(t0 + 10)
    assert resolved.state == "resolved"
    assert [k for k, _ in hook.calls] == ["firing", "resolved"]
    assert hook.calls[1][1].episode == handoff.episode
    [row] = incident_store.list_incidents()
    assert (row.state, row.resolved_at is not None) == ("resolved", True)


def event(state: str, runbook: str | None = "oom-pressure") -> IncidentEvent:
    return IncidentEvent(
        alert="VllmOOMPressure",
        severity="critical",
        runbook=runbook,
        engine=("cpu-0", "tiny", "0"),
        state=state,  # type: ignore[arg-type]
        value=0.97,
        first_seen=10.0,
        last_seen=20.0,
        at=20.0,
    )


@pytest.mark.parametrize(
    ("modes", "runbook", "expected"),
    [
        ({}, "oom-pressure", []),  # default: notify, record only
        ({"oom-pressure": "approve"}, "oom-pressure", ["approve"]),
        ({"oom-pressure": "auto"}, "oom-pressure", ["auto"]),
        ({"latency-spike": "auto"}, "oom-pressure", []),
        ({}, None, []),  # diagnose-only alerts never reach the executor
    ],
)
def test_automation_decides_the_hand_off(
    modes: dict[str, str], runbook: str | None, expected: list[str]
) -> None:
    hook, memory = RecordingHook(), MemoryIncidentSink()
    dispatcher = Dispatcher([memory], Automation(modes), hook)  # type: ignore[arg-type]
    for state in ("pending", "firing", "resolved"):
        dispatcher.record(event(state, runbook))
    assert [e.state for e in memory.events] == ["pending", "firing", "resolved"]
    assert [h.mode for kind, h in hook.calls if kind == "firing"] == expected
    assert len(hook.calls) == 2 * len(expected)


def test_a_failing_hook_never_breaks_recording(caplog: pytest.LogCaptureFixture) -> None:
    hook, memory = RecordingHook(fail=True), MemoryIncidentSink()
    dispatcher = Dispatcher([memory], Automation({"default": "auto"}), hook)
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.rules.remediation"):
        dispatcher.record(event("firing"))
    assert [e.state for e in memory.events] == ["firing"]
    assert "remediation hook on_firing failed for VllmOOMPressure/critical@cpu-0#10.000" in (
        caplog.text
    )


def test_start_schedules_one_job_at_the_configured_interval(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, {"rules": {"evaluation_interval": "500ms"}}))
    scheduler = BackgroundScheduler()
    job = RulesService.from_config(config).start(scheduler)
    assert (job.trigger.interval.total_seconds(), job.max_instances, job.coalesce) == (
        0.5,
        1,
        True,
    )


def test_the_service_counts_scrape_errors_into_its_exported_metric(tmp_path: Path) -> None:
    """The rules' scraper knows no service metric: the service injects its counter."""
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics

    from tests.engines import free_port

    url = f"http://127.0.0.1:{free_port()}"
    config = load_config(write_config(tmp_path, {"engines": [{"name": "gone", "agent": url}]}))
    metrics = ServiceMetrics(scrape_targets=[url + "/metrics"])
    service = RulesService.from_config(config, metrics=metrics, scrape_timeout=1.0)
    try:
        service.run_cycle(now=100.0)
        service.run_cycle(now=111.0)  # after the first backoff (10 s) it is tried again
    finally:
        service.close()
    sample = metrics.registry.get_sample_value
    labels = {"target": url + "/metrics"}
    assert (
        sample("vllm_runbook_service_scrape_errors_total", {**labels, "reason": "unreachable"}) == 2
    )
    assert sample("vllm_runbook_service_scrape_errors_total", {**labels, "reason": "parse"}) == 0
    assert service.scraper.error_counts == {(url + "/metrics", "unreachable"): 2}


def test_the_scrape_deadline_and_grace_come_from_the_configuration(tmp_path: Path) -> None:
    """A hanging target does not hold the cycle: the scraper stops waiting at
    rules.scrape_deadline x evaluation_interval, or after rules.scrape_grace."""
    default = RulesService.from_config(load_config(write_config(tmp_path, {})))
    assert (default.scraper.deadline, default.scraper.grace) == (2.5, 0.25)
    doc = {"rules": {"evaluation_interval": "2s", "scrape_deadline": 0.2, "scrape_grace": "1s"}}
    set_ = RulesService.from_config(load_config(write_config(tmp_path, doc)))
    assert (set_.scraper.deadline, set_.scraper.grace) == (0.4, 1.0)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"scrape_deadline": 1.5}, "rules.scrape_deadline: Input should be less than or equal"),
        ({"scrape_deadline": 0}, "rules.scrape_deadline: Input should be greater than 0"),
        ({"scrape_grace": "0s"}, "rules.scrape_grace: bad duration '0s': must be positive"),
    ],
)
def test_a_bad_scrape_deadline_or_grace_is_refused(
    tmp_path: Path, rules: dict[str, object], message: str
) -> None:
    with pytest.raises(CatalogError, match=message.replace("(", r"\(")):
        load_config(write_config(tmp_path, {"rules": rules}))
