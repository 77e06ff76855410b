"""The executor's checks read the alert's episode: the span they ask the agent for,
and the peak and mean the journal keeps beside each value (a fake agent)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from vllm_runbook.collector.agent_api import Episode, Extent
from vllm_runbook.runbooks.engine.operations import engine_registry
from vllm_runbook.runbooks.engine.sources import NO_EPISODE
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.store import Journal

from tests.fake_agent import URL, Clock, FakeAgent

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
# Between two waves: nothing runs now, the wave's samples are in the episode.
GAP = {"requests_running": 0, "kv_blocks_used": 0, "kv_blocks_free": 255, "kv_cache_usage": 0.0}
EPISODE = Episode(
    seconds=420.0,
    kept_seconds=1800.0,
    samples=95,
    kv_cache_usage=Extent(peak=0.97, mean=0.61),
    kv_capacity_seqs=Extent(peak=24.0, mean=19.5),
    requests_running=Extent(peak=24.0, mean=11.0),
    max_sequence_tokens=Extent(peak=812.0, mean=430.5),
)


def executor(store: Journal, agent: FakeAgent) -> Executor:
    clock = Clock()
    return Executor(
        store,
        load_catalog(registry=engine_registry()),
        engine_registry(),
        client_factory=lambda url: agent,  # type: ignore[arg-type,return-value]
        sleep=clock.sleep,
        clock=clock,
        alert_for_seconds={"VllmOOMPressure": 120.0},
        wall_clock=lambda: NOW,
    )


def test_an_alerts_checks_read_its_episode_beside_the_gap(store: Journal) -> None:
    agent = FakeAgent([GAP])
    agent.episode = EPISODE
    result = executor(store, agent).execute(
        "oom-pressure",
        URL,
        trigger="alert",
        who="alertmanager:VllmOOMPressure",
        alert_fingerprint="fp",
        alert_starts_at=NOW - timedelta(seconds=300),
        dry_run=True,
    )
    # Fired 300 s ago after its condition held 120 s: 420 s of episode.
    assert agent.episode_asks[0] == 420.0
    checks: dict[str, Any] = result.record.checks or {}
    span = {"seconds": 420.0, "samples": 95}
    assert checks["max_sequence_tokens"]["value"] == 0
    assert checks["max_sequence_tokens"]["episode"] == {"peak": 812.0, "mean": 430.5, **span}
    assert checks["kv_usage"]["episode"] == {"peak": 0.97, "mean": 0.61, **span}
    assert checks["running"] == {
        "signal": "requests_running",
        "description": "Requests running now",
        "value": 0,
        "episode": {"peak": 24.0, "mean": 11.0, **span},
    }
    capacity = checks["kv_capacity"]
    assert (capacity["value"], capacity["unavailable"]) == (
        None,
        "no request running: no KV footprint to scale",
    )
    assert capacity["episode"] == {"peak": 24.0, "mean": 19.5, **span}
    # A windowed rate is over a window already: no episode of its own.
    assert set(checks["preemption_rate"]) == {"signal", "description", "value"}


def test_a_cli_run_reads_the_collectors_window_and_an_older_agent_is_said(
    store: Journal,
) -> None:
    agent = FakeAgent([GAP])  # agent.episode None: an agent older than the field
    result = executor(store, agent).execute("oom-pressure", URL, dry_run=True)
    assert agent.episode_asks[0] is None  # the agent's default span: its window
    checks: dict[str, Any] = result.record.checks or {}
    assert checks["running"]["episode_unavailable"] == NO_EPISODE
    assert checks["max_sequence_tokens"]["episode_unavailable"] == NO_EPISODE
    assert "episode_unavailable" not in checks["preemption_rate"]
