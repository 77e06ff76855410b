"""One engine's collector: its parts, each given its data source, wired here.

    settings + identity  settings.py        VLLM_RUNBOOK_*, model name and DP rank (the labels)
    StepStats            step_stats.py      per-step tokens, budget, preemptions, KV, padding
    RequestTracker       request_tracking.py arrivals, first schedules, finished requests
    ChangeTracker        request_tracking.py counters when a change took effect, and since
    EpisodeHistory       episode.py         the checks' gauges, a sample a second (peak, mean)
    read_engine_config   engine_config.py   the configuration vLLM resolved (read once)
    EngineControl        control.py         knobs changed between steps, within bounds
    AutopilotDriver      autopilot_driver.py the controller fed after each step
    WarmupProgress       warmup.py          the warm-up at engine start (run by the plugin's hook)
    QueueInspector       queues.py          the queues per tier, the oldest waiting requests
    StallWatch           stall.py           the heartbeat, and why the engine makes no progress
    NvmlPoller           nvml.py            GPU memory and utilisation
    StatsExporter        exporter.py        every part's samples at scrape time (+ the
    MultiprocessMirror                      PROMETHEUS_MULTIPROC_DIR copy)
    the agent            agent.py           /metrics and /v1/* on its own HTTP thread

The scheduler hook (hook.py) calls the per-step methods; everything else
runs on the agent's, the exporter's and the pollers' threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent import start_agent
from vllm_runbook.collector.agent_api import AgentState, DrainingSince, SettledSince
from vllm_runbook.collector.autopilot import Autopilot
from vllm_runbook.collector.autopilot_driver import AutopilotDriver
from vllm_runbook.collector.control import EngineControl
from vllm_runbook.collector.engine_config import config_samples, read_engine_config
from vllm_runbook.collector.episode import EpisodeHistory
from vllm_runbook.collector.exporter import MultiprocessMirror, Sample, StatsExporter, close_quietly
from vllm_runbook.collector.nvml import NvmlPoller, load_pynvml
from vllm_runbook.collector.queues import QueueInspector
from vllm_runbook.collector.request_tracking import ChangeTracker, RequestTracker
from vllm_runbook.collector.server import AgentServer
from vllm_runbook.collector.settings import CollectorSettings, EngineIdentity
from vllm_runbook.collector.stall import StallWatch
from vllm_runbook.collector.state import build_state
from vllm_runbook.collector.step_stats import StepStats
from vllm_runbook.collector.warmup import NOT_RUN, Outcome, WarmupProgress, start_hook_installed

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import KVCacheManager, VllmScheduler

logger = logging.getLogger("vllm_runbook.collector")


class EngineCollector:
    """The wiring of one engine's parts, and the fail-open switch they share:
    after any exception in our code, `enabled` is False, `error` says why, and
    the scheduler goes on as if we were not there."""

    def __init__(
        self,
        scheduler: VllmScheduler,
        settings: CollectorSettings | None = None,
        registry: CollectorRegistry | None = None,
        nvml: Any = "auto",
    ) -> None:
        self.settings = settings = settings or CollectorSettings.from_env()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.scheduler = scheduler
        self.enabled = True
        self.error: str | None = None
        self.identity = EngineIdentity.of(scheduler.vllm_config)
        self._wall_clock: Callable[[], float] = time.time

        self.stats = StepStats(scheduler, settings.window_seconds)
        self.requests = RequestTracker(
            scheduler, self.stats, settings.tiers.tier_of, self._wall_clock
        )
        self.changes = ChangeTracker(
            scheduler, self.stats, self.requests, self._wall_clock, settings.window_seconds
        )
        self.episode = EpisodeHistory(
            scheduler, self.stats, self.requests, lambda: self.nvml.latest
        )
        self.autopilot = Autopilot(settings.autopilot_target)
        arrived = self.requests.arrived
        self.control = EngineControl(
            scheduler,
            lambda: self.stats.steps,
            self.changes.on_change_applied,
            self.autopilot,
            tiers=settings.tiers,
            clock=lambda: self._wall_clock(),
            waited_since=lambda r: arrived.get(r.request_id, r.arrival_time),
        )
        self.autopilot_driver = AutopilotDriver(
            self.autopilot, scheduler, self.stats, self.control, self.identity.dp_rank
        )
        self.queues = QueueInspector(
            scheduler, self.control.lock, self.control.tiers, self.requests
        )
        self.stall = StallWatch(scheduler, self.stats, settings.stall_seconds)
        # The hook's fast path (see `settle_quiet`): False until a step found
        # nothing that needs the slow one; every part that gives a step more
        # to do sets its own state first, then wakes the collector.
        self.quiet = False
        self.lock = self.control.lock
        # changes.next_sample_at, where the fast path reads it.
        self.next_sample_at = 0.0
        for part in (self.changes, self.autopilot, self.control):
            part.wake = self.wake
        if settings.policy is not None:
            self.control.start_with_policy(settings.policy)
        if settings.autopilot:
            self.autopilot.enable(int(scheduler.max_num_active_reqs), 0)
        elif settings.autopilot_advisory:
            self.autopilot.advise(int(scheduler.max_num_active_reqs), 0)
        # Run by the plugin's start-up hook once the engine core is built (warmup.py).
        self.warmup = WarmupProgress.at_start(settings.warmup, start_hook_installed())
        self._stepped = False  # on_schedule has run once

        self._wrap_prefix_cache_stats(scheduler.kv_cache_manager)
        labels = self.identity.labels
        self.registry.register(StatsExporter(self.samples, labels))
        self.nvml = NvmlPoller.create(
            load_pynvml() if nvml == "auto" else nvml,
            self.registry,
            labels,
            settings.nvml_interval,
            settings.window_seconds,
        )
        self.nvml.start()
        self.mirror: MultiprocessMirror | None = None
        self.server: AgentServer | None = None
        self.token_path: str | None = None
        try:
            self.config = read_engine_config(scheduler, self.nvml.device())
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                self.mirror = MultiprocessMirror(self.samples, labels).start()
            if settings.port is not None:
                self.server, self.token_path = start_agent(
                    settings, self.identity.dp_rank, self.registry, self
                )
        except BaseException:
            close_quietly(self.nvml, self.mirror)
            raise

    @property
    def model_name(self) -> str:
        return self.identity.model_name

    @property
    def dp_rank(self) -> int:
        return self.identity.dp_rank

    @property
    def wall_clock(self) -> Callable[[], float]:
        """The clock of arrivals, waits and marks (tests set a fake one)."""
        return self._wall_clock

    @wall_clock.setter
    def wall_clock(self, clock: Callable[[], float]) -> None:
        self._wall_clock = self.requests.clock = self.changes.clock = clock
        self.next_sample_at = self.changes.next_sample_at

    # -- per step (engine thread), called by the scheduler hook ----------------------

    def on_schedule(
        self, scheduler: VllmScheduler, output: Any, elapsed: float, free_before: int, now: float
    ) -> None:
        """`now`: the step's time.monotonic() (the hook's timer read it)."""
        self.stats.on_schedule(scheduler, output, elapsed, free_before, now)
        # At the first step the start-up hook either ran or never will: say so.
        if not self._stepped:
            self._stepped = True
            if self.warmup.outcome == Outcome.PENDING:
                self.warmup.skip(NOT_RUN)
        changes = self.changes
        if changes.settling is not None:
            changes.check_settled(scheduler)
        requests = self.requests
        if output.scheduled_new_reqs:
            requests.on_schedule(scheduler, output)
        if now >= self.next_sample_at:  # about once a second
            self.sample(now)

    def sample(self, now: float) -> None:
        """The once-a-second samples (engine thread, after a step)."""
        changes = self.changes
        sampled_at = changes.sample(now)
        self.next_sample_at = changes.next_sample_at
        if sampled_at is not None:
            self.episode.sample(sampled_at)

    def wake(self) -> None:
        """A part has more for the engine thread to do: the next step takes the
        hook's slow path (any thread; the part set its own state before)."""
        self.quiet = False

    def settle_quiet(self) -> None:
        """After a step's slow path (engine thread): quiet again while no part
        has more to do. Set before the parts are read, so that a part waking
        meanwhile (its own state first, then `quiet` False) is never missed."""
        self.quiet = True
        control, autopilot = self.control, self.autopilot
        if (
            control.pending
            or control.tiered
            or control.abort_outputs
            or autopilot.pending is not None
            or autopilot.observing
            or self.changes.settling is not None
            or not self._stepped
        ):
            self.quiet = False

    def _wrap_prefix_cache_stats(self, kv_manager: KVCacheManager) -> None:
        """Count prefix-cache lookups at admission, whatever vLLM's log_stats."""
        original = kv_manager.record_prefix_cache_stats
        lookup_enabled = kv_manager.prefix_cache_lookup_enabled
        collector = self

        def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
            if collector.enabled:
                try:
                    if lookup_enabled(request):
                        collector.stats.on_prefix_lookup(request.num_tokens, num_hits)
                except Exception as exc:
                    collector.disable(exc)
            original(request, num_hits)

        kv_manager.record_prefix_cache_stats = record_prefix_cache_stats  # type: ignore[method-assign]

    # -- any thread ------------------------------------------------------------------

    def engine_idle(self) -> bool:
        """The engine will not call schedule() for now: no request to run, or
        the scheduler is paused (PAUSED_ALL counts no unfinished request while
        its queues still hold them). A command is then applied from the HTTP
        thread — safe because every scheduler method that touches the queues
        (schedule, update_from_output, add_request, finish_requests,
        reset_prefix_cache) runs under the same lock as the command."""
        return bool(self.scheduler.get_num_unfinished_requests() == 0)

    def state_samples(self) -> list[Sample]:
        """Every non-NVML metric but the per-tier queue gauges (which read the
        queues under the scheduler lock)."""
        return [
            Sample(M.COLLECTOR_UP, 1.0 if self.enabled else 0.0),
            Sample(M.ENGINE_START_TIME, self.identity.start_time),
            *config_samples(self.config),
            *self.stats.samples(),
            *self.stall.samples(),
            *self.requests.samples(),
            *self.control.samples(),
            *self.autopilot_driver.samples(),
            *self.warmup.samples(),
        ]

    def samples(self) -> list[Sample]:
        """Every non-NVML metric now (the exporter's and the mirror's source)."""
        return [*self.state_samples(), *self.queues.samples()]

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        """The agent's `/v1/state` (see collector/state.py). HTTP thread."""
        return build_state(self, since_step, episode_seconds)

    def since(self, step: int) -> SettledSince | DrainingSince | None:
        return self.changes.since(step)

    # -- failure and shutdown ----------------------------------------------------------

    def disable(self, exc: BaseException) -> None:
        """Fail open: stop collecting for this engine, say so once."""
        if not self.enabled:
            return
        self.enabled = False
        self.error = f"{type(exc).__name__}: {exc}"
        # The tiered policy's per-step chunk cap stops with us: vLLM's own
        # threshold back (the tiered queue itself keeps ordering, limits off).
        with contextlib.suppress(Exception):
            self.scheduler.scheduler_config.long_prefill_token_threshold = (
                self.control.long_prefill_threshold
            )
        logger.error(
            "vllm-runbook: collector disabled for engine %d after an error; "
            "the engine keeps serving without it",
            self.dp_rank,
            exc_info=exc,
        )

    def close(self) -> None:
        close_quietly(self.nvml, self.mirror)
        if self.server is not None:
            self.server.close()
