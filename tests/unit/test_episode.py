"""Checks read the episode: the agent's one-second samples of the checks' gauges,
their peak and mean over a span (exact, on a fake clock and known samples), the
span an alert's checks ask for, what the journal keeps and how a check reads."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from vllm_runbook.collector.agent import install_routes
from vllm_runbook.collector.agent_api import EPISODE_SIGNALS, AgentState, Episode, Extent
from vllm_runbook.collector.episode import (
    EPISODE_KEPT_SECONDS,
    EpisodeHistory,
    episode_span,
    kv_capacity_seqs,
)
from vllm_runbook.collector.request_tracking import ChangeTracker
from vllm_runbook.collector.server import AgentServer
from vllm_runbook.runbooks.engine.client import EngineClient
from vllm_runbook.runbooks.engine.sources import NO_EPISODE, NO_GPU, SOURCES, check_episode
from vllm_runbook.runbooks.run.conditions import episode_seconds
from vllm_runbook.runbooks.run.render import format_check

from tests.fake_agent import agent_state

USABLE = 128


class Gauges:
    """The collector's parts an EpisodeHistory reads, set by hand."""

    def __init__(self) -> None:
        self.free = USABLE
        self.stats = SimpleNamespace(
            usable_blocks=USABLE,
            block_pool=SimpleNamespace(get_num_free_blocks=lambda: self.free),
            budget_fill=0.0,
            batch_gauges=lambda: self.batch,
        )
        self.batch = (0, 0.0, 0.0)  # (longest, fragmentation, length padding)
        self.scheduler = SimpleNamespace(running=[], waiting=[], kv_holding_waiting=[])
        self.requests = SimpleNamespace(oldest_waiting_since=None)
        self.gpus: dict[str, dict[str, float]] = {}

    def history(self) -> EpisodeHistory:
        return EpisodeHistory(
            self.scheduler,  # type: ignore[arg-type]
            self.stats,  # type: ignore[arg-type]
            self.requests,  # type: ignore[arg-type]
            lambda: self.gpus,
        )

    def set(
        self,
        used: int,
        running: int,
        waiting: int,
        since: float | None,
        longest: int,
        fragmentation: float,
        fill: float,
        padding: float,
    ) -> None:
        self.free = USABLE - used
        self.scheduler.running = [object()] * running
        self.scheduler.waiting = [object()] * waiting
        self.requests.oldest_waiting_since = since
        self.batch = (longest, fragmentation, padding)
        self.stats.budget_fill = fill


# (time, used blocks, running, waiting, oldest waiting since, longest, fragmentation,
# budget fill, length padding): a wave that rises, peaks and ends.
WAVE = (
    (1000.0, 32, 4, 0, None, 100, 0.5, 0.5, 0.25),
    (1001.0, 128, 16, 8, 999.0, 400, 0.25, 1.0, 0.5),
    (1002.0, 96, 8, 4, 999.0, 300, 0.25, 0.5, 0.25),
    (1003.0, 0, 0, 0, None, 0, 0.0, 0.0, 0.0),
)


@pytest.fixture
def wave() -> tuple[Gauges, EpisodeHistory]:
    gauges = Gauges()
    history = gauges.history()
    for t, *values in WAVE:
        gauges.set(*values)  # type: ignore[arg-type]
        history.sample(t)
    return gauges, history


def test_peak_and_mean_of_each_gauge_over_the_episode(wave: tuple[Gauges, EpisodeHistory]) -> None:
    _, history = wave
    episode = history.episode(now=1003.5, seconds=10.0)
    assert episode.model_dump() == {
        "seconds": 10.0,
        "kept_seconds": 3.5,
        "samples": 4,
        "kv_cache_usage": {"peak": 1.0, "mean": 0.5},  # 0.25, 1, 0.75, 0
        # 128·4//32 = 16, 128·16//128 = 16, 128·8//96 = 10; nothing running: no sample
        "kv_capacity_seqs": {"peak": 16.0, "mean": 14.0},
        "requests_running": {"peak": 16.0, "mean": 7.0},
        "requests_waiting": {"peak": 8.0, "mean": 3.0},
        "oldest_waiting": {"peak": 3.0, "mean": 1.25},  # 0, 1001-999, 1002-999, 0
        "max_sequence_tokens": {"peak": 400.0, "mean": 200.0},
        "block_fragmentation": {"peak": 0.5, "mean": 0.25},
        "budget_fill": {"peak": 1.0, "mean": 0.5},
        "length_padding_ratio": {"peak": 0.5, "mean": 0.25},
        "gpu_utilization_max": None,  # no NVML
        "gpu_memory_used_max": None,
    }


def test_only_the_samples_in_the_span_count(wave: tuple[Gauges, EpisodeHistory]) -> None:
    _, history = wave
    late = history.episode(now=1003.5, seconds=2.0)  # from 1001.5: the samples at 1002, 1003
    assert (late.samples, late.requests_running) == (2, Extent(peak=8.0, mean=4.0))
    empty = history.episode(now=1010.0, seconds=5.0)  # the engine idled since 1003
    assert (empty.samples, empty.kept_seconds, empty.requests_running) == (0, 10.0, None)


def test_gpu_gauges_are_the_busiest_and_fullest_gpu_at_each_sample() -> None:
    gauges = Gauges()
    history = gauges.history()
    gauges.gpus = {
        "0": {"utilization_ratio": 0.5, "memory_used_bytes": 1e9},
        "1": {"utilization_ratio": 0.25, "memory_used_bytes": 3e9},
    }
    history.sample(10.0)
    gauges.gpus = {"0": {"utilization_ratio": 1.0, "memory_used_bytes": 1e9}}
    history.sample(11.0)
    episode = history.episode(now=11.0, seconds=60.0)
    assert episode.gpu_utilization_max == Extent(peak=1.0, mean=0.75)
    assert episode.gpu_memory_used_max == Extent(peak=3e9, mean=2e9)


def test_a_wall_clock_set_back_starts_the_samples_again(
    wave: tuple[Gauges, EpisodeHistory],
) -> None:
    _, history = wave
    history.sample(900.0)
    assert [s[0] for s in history.samples] == [900.0]


def test_the_breakers_tick_says_when_it_sampled() -> None:
    """One clock read per step; the gauges are sampled at the tick's time only."""
    now = [1000.0]
    tracker = ChangeTracker(
        scheduler=None,
        stats=SimpleNamespace(preemptions=0),  # type: ignore[arg-type]
        requests=SimpleNamespace(log=SimpleNamespace(by_reason={})),  # type: ignore[arg-type]
        clock=lambda: now[0],
    )
    ticks = []
    for t in (1000.0, 1000.4, 1000.99, 1001.0, 1001.5, 990.0):
        now[0] = t
        ticks.append(tracker.sample())
    assert ticks == [1000.0, None, None, 1001.0, None, 990.0]


def test_the_span_is_at_least_the_window_and_at_most_what_is_kept() -> None:
    assert episode_span(None, 60.0) == 60.0
    assert episode_span(10.0, 60.0) == 60.0
    assert episode_span(420.0, 60.0) == 420.0
    assert episode_span(1e6, 60.0) == EPISODE_KEPT_SECONDS == 1800.0


def test_kv_capacity_is_one_definition() -> None:
    assert kv_capacity_seqs(255, 0, 24) == 24
    assert kv_capacity_seqs(100, 155, 10) == 25
    assert kv_capacity_seqs(0, 255, 0) is None


# --- the span an alert's checks ask for -------------------------------------------------

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_an_alerts_episode_starts_when_its_condition_began() -> None:
    fired = NOW - timedelta(seconds=300)
    rules = {"VllmOOMPressure": 120.0}
    # startsAt is when it fired (after `for`): the condition held 120 s before.
    assert episode_seconds("alertmanager:VllmOOMPressure", fired, rules, NOW) == 420.0
    assert episode_seconds("rules:VllmOOMPressure", fired, rules, NOW) == 420.0
    # An alert the rules do not know: from startsAt; a clock ahead: not negative.
    assert episode_seconds("alertmanager:Other", fired, rules, NOW) == 300.0
    assert episode_seconds("alertmanager:Other", NOW + timedelta(seconds=5), rules, NOW) == 0.0
    # No alert: the collector's window (the agent's default).
    assert episode_seconds("alice", None, rules, NOW) is None


# --- what the journal keeps, and how a check reads ------------------------------------------


def episode(**extents: Extent) -> Episode:
    return Episode(seconds=420.0, kept_seconds=1800.0, samples=95, **extents)


def test_a_check_keeps_peak_and_mean_beside_its_value() -> None:
    read = episode(max_sequence_tokens=Extent(peak=812.0, mean=430.5))
    assert check_episode(read, "max_sequence_tokens") == {
        "episode": {"peak": 812.0, "mean": 430.5, "seconds": 420.0, "samples": 95}
    }
    short = Episode(
        seconds=60.0, kept_seconds=12.0, samples=12, kv_cache_usage=Extent(peak=1, mean=0.5)
    )
    assert check_episode(short, "kv_cache_usage")["episode"]["kept_seconds"] == 12.0
    # A signal the agent does not sample (knobs, windowed rates): nothing added.
    assert check_episode(read, "preemptions_per_minute") == {}
    assert check_episode(read, "max_num_seqs") == {}


def test_a_check_says_why_its_episode_could_not_be_read() -> None:
    assert check_episode(None, "kv_cache_usage") == {"episode_unavailable": NO_EPISODE}
    idle = Episode(seconds=60.0, kept_seconds=0.0, samples=0)
    assert check_episode(idle, "requests_running") == {
        "episode_unavailable": "no scheduler step in the last 60 s (the engine was idle)"
    }
    read = episode()
    assert check_episode(read, "kv_capacity_seqs") == {
        "episode_unavailable": "no request running at any sample in the last 420 s"
    }
    assert check_episode(read, "gpu_utilization_max") == {"episode_unavailable": NO_GPU}
    # The episode's gauges are signals a check can name (one name per quantity).
    assert set(EPISODE_SIGNALS) <= set(SOURCES)


def test_a_check_line_shows_now_peak_and_mean() -> None:
    gap = {
        "signal": "max_sequence_tokens",
        "value": 0,
        "episode": {"peak": 812.0, "mean": 430.5, "seconds": 420.0, "samples": 95},
    }
    assert format_check(gap) == "0 now; peak 812, mean 430.5 over 420 s"
    capacity = {
        "signal": "kv_capacity_seqs",
        "value": None,
        "unavailable": "no request running: no KV footprint to scale",
        "episode": {"peak": 16.0, "mean": 14.0, "seconds": 60.0, "samples": 12, "kept_seconds": 12},
    }
    assert format_check(capacity) == (
        "unavailable now: no request running: no KV footprint to scale; "
        "peak 16, mean 14 over 60 s (samples reach back 12 s)"
    )
    older = {"signal": "kv_cache_usage", "value": 0.0, "episode_unavailable": NO_EPISODE}
    assert format_check(older) == f"0 now; peak/mean unavailable: {NO_EPISODE}"
    # A signal with no episode (a knob), and a journal from before the episode.
    assert format_check({"signal": "max_num_seqs", "value": 32}) == "32"


# --- over HTTP: the client asks, the agent answers -------------------------------------------


class Served:
    """What the agent's routes serve, answering a fixed state with `episode`."""

    enabled = True
    error = None
    control: Any = None
    dp_rank = 0

    def __init__(self) -> None:
        self.asked: list[tuple[int | None, float | None]] = []

    def engine_idle(self) -> bool:
        return True

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        self.asked.append((since_step, episode_seconds))
        return agent_state().model_copy(update={"episode": episode()})


@pytest.fixture
def served() -> Iterator[tuple[Served, EngineClient]]:
    server = AgentServer("127.0.0.1", 0, CollectorRegistry())
    collector = Served()
    install_routes(server, collector, "token")  # type: ignore[arg-type]
    server.start()
    try:
        yield collector, EngineClient(server.url, token="token")
    finally:
        server.close()


def test_the_client_asks_the_agent_for_the_episodes_span(
    served: tuple[Served, EngineClient],
) -> None:
    collector, client = served
    assert client.state().episode == episode()
    client.state(since_step=7, episode_seconds=420.25)
    client.state(episode_seconds=-3)  # clamped to 0 by the client
    assert collector.asked == [(None, None), (7, 420.25), (None, 0.0)]


@pytest.mark.parametrize("bad", ["x", "-1", "nan", "inf"])
def test_a_malformed_span_is_refused(served: tuple[Served, EngineClient], bad: str) -> None:
    collector, client = served
    answer = httpx.get(f"{client.url}/v1/state?episode_seconds={bad}", timeout=10)
    assert answer.status_code == 400
    assert "episode_seconds must be a number of seconds >= 0" in answer.json()["error"]
    assert collector.asked == []
