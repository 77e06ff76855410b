"""The scheduler hook: per-step statistics computed inside the EngineCore.

`RunbookSchedulerMixin` is mixed in front of whatever scheduler class vLLM
chose (Scheduler, AsyncScheduler, a user class). Each step it times
`schedule()`, reads the scheduler's own state and updates the metrics of
`vllm_runbook.collector.metrics`. It never changes what the scheduler does.

The engine comes first: any exception in our code disables the collector for
that engine (one log line, `vllm_runbook_collector_up 0`) and the scheduler
goes on as if we were not there. vLLM's own exceptions pass through untouched.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import logging
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import attrgetter
from typing import Any

from prometheus_client import CollectorRegistry
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent import install_routes
from vllm_runbook.collector.auth import TokenError, configured_token, generate_token, is_loopback
from vllm_runbook.collector.autopilot import DEFAULT_TARGET, Autopilot, parse_switch, parse_target
from vllm_runbook.collector.control import POLICIES, EngineControl
from vllm_runbook.collector.exporter import MultiprocessMirror, Sample, StatsExporter, close_quietly
from vllm_runbook.collector.nvml import NvmlPoller, load_pynvml
from vllm_runbook.collector.requests import (
    ChangeMarks,
    Finished,
    Histogram,
    Mark,
    RequestLog,
    summarize,
)
from vllm_runbook.collector.server import AgentServer, ServerLimits
from vllm_runbook.collector.tiers import TIERS, TierConfig, running_by_tier
from vllm_runbook.collector.window import SlidingWindowMax, SlidingWindowRatio

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_PORT = 9360
TESTED_VLLM = ((0, 32), (0, 32))  # inclusive (major, minor) range


@dataclass(frozen=True)
class CollectorSettings:
    host: str = "127.0.0.1"
    port: int | None = DEFAULT_PORT  # None: no HTTP endpoint; 0: any free port
    window_seconds: float = 60.0
    nvml_interval: float = 5.0
    server_limits: ServerLimits = field(default_factory=ServerLimits)
    autopilot: bool = False
    autopilot_target: float = DEFAULT_TARGET
    # The scheduling policy to start with (None: vLLM's own --scheduling-policy),
    # and the tiers of the `tiered` policy and of the per-tier signals.
    policy: str | None = None
    tiers: TierConfig = field(default_factory=TierConfig)

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(
                f"VLLM_RUNBOOK_POLICY must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CollectorSettings:
        env = dict(os.environ) if env is None else env
        port_text = env.get("VLLM_RUNBOOK_PORT", str(DEFAULT_PORT)).strip().lower()
        port = None if port_text in ("off", "none", "-1") else int(port_text)
        return cls(
            host=env.get("VLLM_RUNBOOK_HOST", "127.0.0.1"),
            port=port,
            window_seconds=float(env.get("VLLM_RUNBOOK_WINDOW_SECONDS", "60")),
            nvml_interval=float(env.get("VLLM_RUNBOOK_NVML_INTERVAL", "5")),
            server_limits=ServerLimits.from_env(env),
            **_autopilot_settings(env),
            policy=env.get("VLLM_RUNBOOK_POLICY", "").strip().lower() or None,
            tiers=TierConfig.from_env(env),
        )


def _autopilot_settings(env: dict[str, str]) -> dict[str, Any]:
    """VLLM_RUNBOOK_AUTOPILOT and _TARGET. A bad value leaves the autopilot
    off (one log line) rather than the collector unstarted."""
    try:
        return {
            "autopilot": parse_switch(env.get("VLLM_RUNBOOK_AUTOPILOT", "off")),
            "autopilot_target": parse_target(
                env.get("VLLM_RUNBOOK_AUTOPILOT_TARGET", str(DEFAULT_TARGET))
            ),
        }
    except ValueError as exc:
        logger.error("vllm-runbook: autopilot left off: VLLM_RUNBOOK_AUTOPILOT*: %s", exc)
        return {"autopilot": False, "autopilot_target": DEFAULT_TARGET}


def agent_token(host: str, env: dict[str, str] | None = None) -> str | None:
    """The configured token; None means "generate one" (loopback only).
    TokenError when the agent must not start."""
    token = configured_token(env)
    if token is None and not is_loopback(host):
        raise TokenError(
            f"binding to {host} (not loopback) needs VLLM_RUNBOOK_TOKEN or VLLM_RUNBOOK_TOKEN_FILE"
        )
    return token


def check_vllm_version(version: str) -> bool:
    """True when `version` is in the tested range; logs a warning otherwise."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    low, high = TESTED_VLLM
    if not (low <= (major, minor) <= high):
        logger.warning(
            "vllm-runbook: vLLM %s is outside the tested range %d.%d-%d.%d; "
            "the collector will disable itself if the scheduler differs",
            version,
            *low,
            *high,
        )
        return False
    return True


def predicted_padded_tokens(num_tokens: int, capture_sizes: list[int]) -> int:
    """Tokens the model runner executes for a batch of `num_tokens` when it pads
    to the smallest cudagraph capture size ≥ n (eager above the largest)."""
    if not capture_sizes or num_tokens > capture_sizes[-1] or num_tokens <= 0:
        return num_tokens
    return capture_sizes[bisect.bisect_left(capture_sizes, num_tokens)]


class EngineCollector:
    """Owns one engine's statistics, windows, endpoint and NVML poller.

    The per-step methods only update plain attributes; `samples()` turns them
    (plus the scheduler's live queue, KV and knob state) into Prometheus
    samples when someone scrapes.
    """

    def __init__(
        self,
        scheduler: Any,
        settings: CollectorSettings | None = None,
        registry: CollectorRegistry | None = None,
        nvml: Any = "auto",
    ) -> None:
        self.settings = settings or CollectorSettings.from_env()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.scheduler = scheduler
        self.enabled = True
        self.error: str | None = None
        self.start_time = time.time()

        vllm_config = scheduler.vllm_config
        served = vllm_config.model_config.served_model_name
        self.model_name = served[0] if isinstance(served, list) else str(served)
        # data_parallel_index keeps the DP rank even where vLLM runs a non-MoE
        # DP rank as an independent engine (data_parallel_rank is 0 there).
        parallel = vllm_config.parallel_config
        rank = getattr(parallel, "data_parallel_index", None)
        self.dp_rank = int(parallel.data_parallel_rank if rank is None else rank) or 0
        self.parallel = {
            "tensor_parallel_size": int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            "pipeline_parallel_size": int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
            "data_parallel_size": int(getattr(parallel, "data_parallel_size", 1) or 1),
        }
        self.labels = (self.model_name, str(self.dp_rank))
        self.block_size = int(scheduler.block_size)

        # KV blocks: the first KV cache group (full attention for decoder LLMs).
        kv_manager = scheduler.kv_cache_manager
        self.block_pool = kv_manager.block_pool
        group0 = kv_manager.coordinator.single_type_managers[0]
        self._req_to_blocks: dict[str, list[Any]] = group0.req_to_blocks
        # Only full attention never holds null placeholder blocks; other kinds
        # (sliding window, mamba) need the slower count.
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        self._blocks_have_nulls = type(group0) is not FullAttentionManager

        compilation = vllm_config.compilation_config
        mode = compilation.cudagraph_mode
        cudagraphs_on = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
        self.capture_sizes = (
            sorted(compilation.cudagraph_capture_sizes or []) if cudagraphs_on else []
        )

        self.startup_max_num_batched_tokens = int(scheduler.max_num_scheduled_tokens)
        self.startup_max_num_seqs = int(scheduler.max_num_active_reqs)

        # Plain per-step statistics (written by the engine thread only).
        self.steps = 0
        self.scheduled_tokens = 0
        self.token_budget = 0
        self.step_tokens = 0
        self.budget_fill = 0.0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.padded_tokens = 0
        self.unpadded_tokens = 0
        self.fragmentation = 0.0
        self.length_padding = 0.0
        # Longest context (computed tokens, prompt + generated) in the running batch.
        self.max_sequence_tokens = 0
        # (steps, preemptions, scheduled tokens) after the latest step, as one tuple.
        self.progress = (0, 0, 0)
        # The applied step of a lower admission limit still draining, if any.
        self._settling: int | None = None
        self.requests = RequestLog(bounds=M.REQUEST_SECONDS_BUCKETS)
        self.marks = ChangeMarks()
        # Request id -> wall time it reached the engine, and -> seconds it waited
        # for its first schedule (both until it finishes). End-to-end and queue
        # times are the engine's: from its add_request, on the collector's clock.
        self._arrived: dict[str, float] = {}
        self._queue_seconds: dict[str, float] = {}
        self._schedule_bounds = M.SCHEDULE_SECONDS.buckets
        self.schedule_counts = [0] * (len(self._schedule_bounds) + 1)  # last: +Inf
        self.schedule_seconds_sum = 0.0
        self.hit_window = SlidingWindowRatio(self.settings.window_seconds)
        self.padding_window = SlidingWindowRatio(self.settings.window_seconds)
        self.preemption_window = SlidingWindowRatio(self.settings.window_seconds)
        self.kv_usage_peak = SlidingWindowMax(self.settings.window_seconds)
        self._usable_blocks = self.block_pool.num_gpu_blocks - 1  # minus vLLM's null block
        # Requests never scheduled yet, in the order they reached the engine:
        # (request id, wall time of add_request). Only the head is looked at,
        # once per step; entries behind it that were scheduled or aborted
        # meanwhile are dropped when they reach it.
        self._never_scheduled: deque[tuple[str, float]] = deque()
        from vllm.v1.request import RequestStatus

        # Waiting for a first schedule: WAITING and the waits before it (grammar,
        # remote KV). Not WAITING_FOR_STREAMING_REQ: that one ran and waits for input.
        self._first_wait = frozenset(
            s for s in RequestStatus if s.name.startswith("WAITING") and "STREAMING" not in s.name
        )
        self.oldest_waiting_since: float | None = None  # when the head reached the engine
        self.wall_clock: Callable[[], float] = time.time
        self._horizon_lock = threading.Lock()
        self._horizon_floor = 0.0
        self.autopilot = Autopilot(self.settings.autopilot_target)
        # Per tier: seconds from arrival in the engine to the first schedule.
        self.tier_queue_histograms = tuple(Histogram(M.REQUEST_SECONDS_BUCKETS) for _ in TIERS)
        arrived = self._arrived
        self.control = EngineControl(
            scheduler,
            lambda: self.steps,
            self.on_change_applied,
            self.autopilot,
            tiers=self.settings.tiers,
            clock=lambda: self.wall_clock(),
            waited_since=lambda r: arrived.get(r.request_id, r.arrival_time),
        )
        if self.settings.policy is not None:
            self.control.start_with_policy(self.settings.policy)
        if self.settings.autopilot:
            self.autopilot.enable(int(scheduler.max_num_active_reqs), 0)

        self._wrap_prefix_cache_stats(kv_manager)
        self.registry.register(StatsExporter(self.samples, self.labels))
        nvml_gauges = {spec.name: M.build_gauge(spec, self.registry) for spec in M.NVML_METRICS}

        self.mirror: MultiprocessMirror | None = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.mirror = MultiprocessMirror(self.samples, self.labels).start()

        self.server: AgentServer | None = None
        self.token_path: str | None = None
        if self.settings.port is not None:
            self.server = self._start_server()

        self.nvml = NvmlPoller(
            load_pynvml() if nvml == "auto" else nvml,
            nvml_gauges[M.NVML_UP.name],
            nvml_gauges[M.GPU_MEMORY_USED.name],
            nvml_gauges[M.GPU_MEMORY_TOTAL.name],
            nvml_gauges[M.GPU_UTILIZATION.name],
            self.labels,
            self.settings.nvml_interval,
        )
        self.nvml.start()

    def _start_server(self) -> AgentServer | None:
        host = self.settings.host
        port = self.settings.port + self.dp_rank if self.settings.port else 0
        try:
            token = agent_token(host)
        except TokenError as exc:
            logger.error("vllm-runbook: agent not started: %s", exc)
            return None
        try:
            server = AgentServer(host, port, self.registry, limits=self.settings.server_limits)
        except OSError as exc:
            logger.warning(
                "vllm-runbook: cannot serve on %s:%d (%s); set VLLM_RUNBOOK_PORT", host, port, exc
            )
            return None
        if token is None:
            try:
                token, path = generate_token(server.port)
                self.token_path = str(path)
            except (OSError, TokenError) as exc:
                # Without a stored token nobody can write: serve reads only.
                logger.warning(
                    "vllm-runbook: cannot store the agent token (%s); "
                    "set VLLM_RUNBOOK_TOKEN to enable control",
                    exc,
                )
                token = secrets.token_urlsafe(32)
        install_routes(server, self, token)
        logger.info("vllm-runbook: engine %d agent at %s", self.dp_rank, server.url)
        return server.start()

    def engine_idle(self) -> bool:
        """The engine will not call schedule() for now: no request to run, or
        the scheduler is paused (PAUSED_ALL counts no unfinished request while
        its queues still hold them). A command is then applied from the HTTP
        thread — safe because every scheduler method that touches the queues
        (schedule, update_from_output, add_request, finish_requests,
        reset_prefix_cache) runs under the same lock as the command."""
        return self.scheduler.get_num_unfinished_requests() == 0

    def state(self, since_step: int | None = None) -> dict[str, Any]:
        """The agent's `/v1/state`. With `since_step` (the step a change took
        effect from, as the knob routes answer it), `since` holds what happened
        from that step on: counter deltas and the requests finished since
        (None when no change was applied at that step, or it is too old)."""
        stats: dict[str, Any] = {}
        for s in self.samples():
            if s.spec.type == "histogram" or s.spec.extra_labels:
                continue
            key = s.spec.name.removeprefix(M.PREFIX)
            key = key + "_total" if s.spec.type == "counter" else key
            stats[key] = None if math.isnan(s.value) else s.value
        preempted, _ = self.preemption_window.sums()
        stats["preemptions_per_minute"] = preempted * 60.0 / self.settings.window_seconds
        stats["admitted_before_time"] = self.waiting_horizon()[1]
        now = self.wall_clock()
        window = self.settings.window_seconds
        stats.update(summarize(self.requests.since_time(now - window)))
        stats["window_seconds"] = window
        stats["requests_finished_by_reason_total"] = dict(self.requests.by_reason)
        bounds = self.control.bounds()
        return {
            "engine": {
                "model_name": self.model_name,
                "engine": str(self.dp_rank),
                "pid": os.getpid(),
                "started_at": self.start_time,
                "step": self.steps,
                "vllm_version": _vllm_version(),
                # Which scheduler vLLM picked (RunbookAsyncScheduler on GPU by default).
                "scheduler_class": type(self.scheduler).__name__,
                "parallel": dict(self.parallel),
            },
            "collector_up": self.enabled,
            "knobs": self.control.knobs(),
            "startup": dict(self.control.startup),
            "bounds": {knob: b.as_dict() for knob, b in bounds.items()},
            "autopilot": {
                **self.autopilot.snapshot(),
                "ceiling": self.control.autopilot_ceiling(),
            },
            "stats": stats,
            "gpus": self.nvml.snapshot(),
            "schedule_histogram": {
                "bounds": list(self._schedule_bounds),
                "cumulative": list(accumulate(self.schedule_counts)),
            },
            "since": None if since_step is None else self.since(since_step, now),
            "tiers": {
                "config": self.control.tiers.as_dict(int(self.scheduler.max_num_active_reqs)),
                "now": self.tier_state(),
            },
            "queues": self.queue_snapshot(),
        }

    def queue_snapshot(self, oldest: int = 5) -> dict[str, Any] | None:
        """The scheduler's queues for a diagnosis: their lengths, its pause state
        and the `oldest` requests waiting longest for their first schedule.
        Any thread, under the scheduler lock (None if not free within 1 s)."""
        sched = self.scheduler
        lock = self.control.lock
        if not lock.acquire(timeout=1.0):
            return None
        try:
            now = self.wall_clock()
            tier_of = self.control.tiers.tier_of
            arrived, first_wait = self._arrived, self._first_wait
            queued = [
                (arrived[r.request_id], r)
                for q in (sched.waiting, sched.kv_holding_waiting)
                for r in _queued(q)
                if r.request_id in arrived and r.status in first_wait
            ]
            heads = heapq.nsmallest(oldest, queued, key=lambda entry: entry[0])
            pause = getattr(sched, "_pause_state", None)
            return {
                "running": len(sched.running),
                "waiting": len(sched.waiting),
                "kv_holding_waiting": len(sched.kv_holding_waiting),
                "pause_state": getattr(pause, "name", None if pause is None else str(pause)),
                "oldest_waiting": [
                    {
                        "request_id": r.request_id,
                        "tier": TIERS[tier_of(r.num_prompt_tokens)],
                        "prompt_tokens": int(r.num_prompt_tokens),
                        "priority": int(r.priority),
                        "status": getattr(r.status, "name", str(r.status)),
                        "waited_seconds": max(0.0, now - since),
                    }
                    for since, r in heads
                ],
            }
        finally:
            lock.release()

    def since(self, step: int, now: float | None = None) -> dict[str, Any] | None:
        """What happened from `step` (a change's first step) on; None when unknown."""
        mark = self.marks.get(step)
        if mark is None:
            return None
        if not mark.settled:
            return {
                "from_step": step,
                "settled": False,
                "num_requests_running": len(self.scheduler.running),
                "max_num_seqs": int(self.scheduler.max_num_active_reqs),
            }
        now = self.wall_clock() if now is None else now
        seconds = max(0.0, now - mark.time)
        steps, preemptions, scheduled_tokens = self.progress
        preempted = preemptions - mark.preemptions
        scheduled = scheduled_tokens - mark.scheduled_tokens
        queries = self.prefix_queries - mark.prefix_queries
        hits = self.prefix_hits - mark.prefix_hits
        return {
            "from_step": step,
            "settled": True,
            "effective_step": mark.step,
            "from_time": mark.time,
            "seconds": seconds,
            "steps": steps - mark.steps,
            "preemptions": preempted,
            "preemptions_per_minute": preempted * 60.0 / seconds if seconds > 0 else None,
            "scheduled_tokens": scheduled,
            "throughput_tokens_per_second": scheduled / seconds if seconds > 0 else None,
            "kv_hit_ratio": hits / queries if queries else None,
            **summarize(self.requests.since_step(mark.step)),
        }

    def on_change_applied(self, effective_from_step: int) -> None:
        """A knob change was applied (any thread, under the scheduler lock):
        keep the counters as they stand before its first step. A lower
        admission limit with more requests running than it admits takes
        effect only once they drain: `on_schedule` settles the mark then."""
        settled = len(self.scheduler.running) <= self.scheduler.max_num_active_reqs
        self.marks.add(effective_from_step, self._mark(effective_from_step, settled))
        if not settled:
            self._settling = effective_from_step

    def _mark(self, applied_step: int, settled: bool) -> Mark:
        return Mark(
            step=self.steps + 1,
            time=self.wall_clock(),
            steps=self.steps,
            preemptions=self.preemptions,
            scheduled_tokens=self.scheduled_tokens,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            applied_step=applied_step,
            settled=settled,
        )

    def _wrap_prefix_cache_stats(self, kv_manager: Any) -> None:
        """Count prefix-cache lookups at admission, whatever vLLM's log_stats."""
        original = kv_manager.record_prefix_cache_stats
        lookup_enabled = kv_manager.prefix_cache_lookup_enabled
        collector = self

        def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
            if collector.enabled:
                try:
                    if lookup_enabled(request):
                        collector.on_prefix_lookup(request.num_tokens, num_hits)
                except Exception as exc:
                    collector.disable(exc)
            original(request, num_hits)

        kv_manager.record_prefix_cache_stats = record_prefix_cache_stats

    # -- per step (engine thread): plain arithmetic only ---------------------

    def on_prefix_lookup(self, num_tokens: int, num_hits: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hits
        self.hit_window.add(num_hits, num_tokens)

    def on_add_request(self, request: Any) -> None:
        """A request reached the engine: it waits for its first schedule from now."""
        since = self.wall_clock()
        self._never_scheduled.append((request.request_id, since))
        self._arrived[request.request_id] = since
        if self.oldest_waiting_since is None:
            self.oldest_waiting_since = since

    def on_requests_finished(self, scheduler: Any) -> None:
        """Requests aborted (finish_requests): a queued one may have been the oldest,
        and the engine may go idle with no step to notice; a stale head would read
        as a request starving."""
        if self._never_scheduled:
            self._advance_oldest_waiting(scheduler)

    def _advance_oldest_waiting(self, scheduler: Any) -> None:
        """Drop the head while it is no longer waiting for its first schedule."""
        queue, requests = self._never_scheduled, scheduler.requests
        while queue:
            request_id, since = queue[0]
            request = requests.get(request_id)
            if request is not None and request.status in self._first_wait:
                self.oldest_waiting_since = since
                return
            queue.popleft()
        self.oldest_waiting_since = None

    def waiting_horizon(self) -> tuple[float, float]:
        """(age, admitted_before): how long the oldest request waiting for its first
        schedule has been in the engine (0 when none waits), and the time before
        which every request the engine received has been scheduled at least once
        (that request's arrival in the engine, or now when none waits).

        Any thread. `admitted_before` never decreases (a floor under a lock, as
        HTTP threads race with the engine thread's add): it stands still while a
        request starves and moves on as the queue is served."""
        now = self.wall_clock()
        since = self.oldest_waiting_since
        age = 0.0 if since is None else max(0.0, now - since)
        with self._horizon_lock:
            horizon = max(self._horizon_floor, now if since is None else since)
            self._horizon_floor = horizon
        return age, horizon

    def on_schedule(self, scheduler: Any, output: Any, elapsed: float, free_before: int) -> None:
        """After schedule(): `request.num_computed_tokens` includes this step.
        `free_before`: free KV blocks when schedule() started."""
        if self._usable_blocks:
            self.kv_usage_peak.add(1.0 - free_before / self._usable_blocks)
        self.schedule_counts[bisect.bisect_left(self._schedule_bounds, elapsed)] += 1
        self.schedule_seconds_sum += elapsed
        tokens = output.total_num_scheduled_tokens
        budget = scheduler.max_num_scheduled_tokens
        self.steps += 1
        self.scheduled_tokens += tokens
        self.token_budget += budget
        self.step_tokens = tokens
        self.budget_fill = tokens / budget if budget else 0.0
        preempted = len(output.preempted_req_ids)
        if preempted:
            self.preemptions += preempted
            self.preemption_window.add(preempted, 0)
        # One consistent triple for readers on other threads (one assignment).
        self.progress = (self.steps, self.preemptions, self.scheduled_tokens)
        if self._settling is not None and len(scheduler.running) <= scheduler.max_num_active_reqs:
            # The admission limit is in effect from the next step on.
            self.marks.add(self._settling, self._mark(self._settling, True), replace=True)
            self._settling = None
        if self._never_scheduled:
            self._advance_oldest_waiting(scheduler)
        if output.scheduled_new_reqs:
            now = self.wall_clock()
            arrived, queued = self._arrived, self._queue_seconds
            requests, tier_of = scheduler.requests, self.control.tiers.tier_of
            histograms = self.tier_queue_histograms
            for new in output.scheduled_new_reqs:
                since = arrived.get(new.req_id)
                if since is not None and new.req_id not in queued:
                    seconds = queued[new.req_id] = max(0.0, now - since)
                    request = requests.get(new.req_id)
                    if request is not None:
                        histograms[tier_of(request.num_prompt_tokens)].observe(seconds)

        running = scheduler.running
        if not running:
            self.fragmentation = self.length_padding = 0.0
            self.max_sequence_tokens = 0
            return
        # C-level map/sum instead of a Python loop: this runs every step over
        # every running request (see benchmarks/collector_overhead.py).
        lengths = list(map(_num_computed_tokens, running))
        ids = list(map(_request_id, running))
        blocks: Iterator[list[Any]] = map(self._req_to_blocks.get, ids, repeat([], len(ids)))
        count: Callable[[list[Any]], int] = _count_real_blocks if self._blocks_have_nulls else len
        held = sum(map(count, blocks))
        computed = sum(lengths)
        self.max_sequence_tokens = max(lengths)
        self.fragmentation = 1.0 - computed / (held * self.block_size) if held else 0.0
        scheduled = output.num_scheduled_tokens
        if len(scheduled) != len(running):  # scheduled ⊆ running after schedule()
            lengths = [n for n, i in zip(lengths, ids, strict=True) if i in scheduled]
            computed = sum(lengths)
        max_len = max(lengths, default=0)
        self.length_padding = 1.0 - computed / (len(lengths) * max_len) if max_len else 0.0

    # -- the autopilot (engine thread) ------------------------------------------

    def autopilot_observe(self, scheduler: Any, output: Any, free_before: int) -> None:
        """After schedule() and on_schedule(): feed the controller this step."""
        usable = self._usable_blocks
        self.autopilot.observe(
            self.steps,
            scheduler.max_num_active_reqs,
            self.control.autopilot_ceiling(),
            len(scheduler.running),
            len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
            len(output.preempted_req_ids),
            1.0 - free_before / usable if usable else 0.0,
        )

    def autopilot_apply(self) -> None:
        """Before schedule(), under the scheduler lock: its pending decision."""
        decision = self.autopilot.pending
        self.autopilot.pending = None
        if decision is not None and self.autopilot.enabled:
            applied = self.control.apply_autopilot(decision.limit)
            self.autopilot.limit = applied
            logger.debug(
                "vllm-runbook: engine %d autopilot: max_num_seqs %d (%s) from step %d",
                self.dp_rank,
                applied,
                decision.reason,
                self.steps + 1,
            )

    def autopilot_failed(self, exc: BaseException) -> None:
        """Fail open: the autopilot turns off, the knobs stay, the engine and
        the collector go on."""
        autopilot = self.autopilot
        if not autopilot.enabled:
            return
        autopilot.disable()
        autopilot.error = f"{type(exc).__name__}: {exc}"
        logger.error(
            "vllm-runbook: autopilot turned off for engine %d after an error (%s); "
            "the engine keeps serving with max_num_seqs %d",
            self.dp_rank,
            autopilot.error,
            int(self.scheduler.max_num_active_reqs),
        )

    def on_request_finished(self, request: Any) -> None:
        """A request is being freed (finished, length-capped, aborted, failed)."""
        from vllm.v1.request import RequestStatus

        now = self.wall_clock()
        request_id = request.request_id
        queued = self._queue_seconds.pop(request_id, None)
        arrived = self._arrived.pop(request_id, None)
        if queued is None:  # never scheduled: it waited until now
            queued = max(0.0, now - arrived) if arrived is not None else 0.0
        reason = RequestStatus.get_finished_reason(request.status)
        if self.autopilot.enabled:
            try:
                budget = self.scheduler.max_num_scheduled_tokens or 1
                self.autopilot.on_request_finished(
                    request.num_output_tokens, -(-request.num_prompt_tokens // budget)
                )
            except Exception as exc:
                self.autopilot_failed(exc)
        self.requests.add(
            Finished(
                step=self.steps,
                time=now,
                reason=str(reason) if reason is not None else "abort",
                e2e_seconds=max(0.0, now - arrived) if arrived is not None else 0.0,
                queue_seconds=queued,
            )
        )

    def on_update(self, scheduler: Any, scheduler_output: Any, runner_output: Any) -> None:
        """After update_from_output(): padding of the batch just executed."""
        stat = runner_output.cudagraph_stats
        if stat is not None:
            unpadded, padded = stat.num_unpadded_tokens, stat.num_padded_tokens
        else:
            unpadded = scheduler_output.total_num_scheduled_tokens
            padded = predicted_padded_tokens(unpadded, self.capture_sizes)
        if padded:
            self.padded_tokens += padded
            self.unpadded_tokens += unpadded
            self.padding_window.add(padded - unpadded, padded)
        if not scheduler.running:
            self.fragmentation = 0.0
            self.max_sequence_tokens = 0

    # -- at scrape time (HTTP thread) ----------------------------------------

    def samples(self) -> list[Sample]:
        """Every non-NVML metric now. Reads the scheduler's ints and list
        lengths from another thread: single attribute reads, no iteration."""
        sched = self.scheduler
        pool = self.block_pool
        usable = pool.num_gpu_blocks - 1  # one block is vLLM's null block
        free = pool.get_num_free_blocks()
        policy = self.control.knobs()["policy"]
        cumulative = list(accumulate(self.schedule_counts))
        return [
            Sample(M.COLLECTOR_UP, 1.0 if self.enabled else 0.0),
            Sample(M.ENGINE_START_TIME, self.start_time),
            Sample(M.PREFIX_CACHE_QUERIES, self.prefix_queries),
            Sample(M.PREFIX_CACHE_HITS, self.prefix_hits),
            # No lookups in the window: undefined (NaN), not "0 % hits".
            Sample(M.KV_HIT_RATIO, self.hit_window.ratio(math.nan)),
            Sample(M.BLOCK_FRAGMENTATION, self.fragmentation),
            Sample(M.PADDING_RATIO, self.padding_window.ratio()),
            Sample(M.LENGTH_PADDING_RATIO, self.length_padding),
            Sample(M.SCHEDULE_SECONDS, self.schedule_seconds_sum, buckets=tuple(cumulative)),
            Sample(M.STEPS, self.steps),
            Sample(M.SCHEDULED_TOKENS, self.scheduled_tokens),
            Sample(M.TOKEN_BUDGET, self.token_budget),
            Sample(M.STEP_TOKENS, self.step_tokens),
            Sample(M.BUDGET_FILL, self.budget_fill),
            Sample(M.PADDED_TOKENS, self.padded_tokens),
            Sample(M.UNPADDED_TOKENS, self.unpadded_tokens),
            Sample(M.REQUESTS_RUNNING, len(sched.running)),
            Sample(M.REQUESTS_WAITING, len(sched.waiting) + len(sched.kv_holding_waiting)),
            Sample(M.OLDEST_WAITING, self.waiting_horizon()[0]),
            Sample(M.PREEMPTIONS, self.preemptions),
            Sample(M.MAX_SEQUENCE_TOKENS, self.max_sequence_tokens),
            *(
                Sample(M.REQUESTS_FINISHED, count, (reason,))
                for reason, count in self.requests.by_reason.items()
            ),
            *(
                Sample(spec, h.sum, buckets=tuple(accumulate(h.counts)))
                for spec, h in (
                    (M.REQUEST_QUEUE_SECONDS, self.requests.queue_histogram),
                    (M.REQUEST_E2E_SECONDS, self.requests.e2e_histogram),
                )
            ),
            Sample(M.KV_BLOCKS_USED, usable - free),
            Sample(M.KV_BLOCKS_FREE, free),
            Sample(M.KV_CACHE_USAGE, (usable - free) / usable if usable else 0.0),
            Sample(M.KV_CACHE_USAGE_PEAK, self.kv_usage_peak.max()),
            Sample(M.MAX_NUM_BATCHED_TOKENS, sched.max_num_scheduled_tokens),
            Sample(M.MAX_NUM_SEQS, sched.max_num_active_reqs),
            Sample(M.STARTUP_MAX_NUM_BATCHED_TOKENS, self.startup_max_num_batched_tokens),
            Sample(M.STARTUP_MAX_NUM_SEQS, self.startup_max_num_seqs),
            *(
                Sample(M.SCHEDULER_POLICY, 1.0 if name == policy else 0.0, (name,))
                for name in M.POLICIES
            ),
            Sample(M.AUTOPILOT_ENABLED, 1.0 if self.autopilot.enabled else 0.0),
            Sample(M.AUTOPILOT_KV_TARGET, self.autopilot.target),
            Sample(M.AUTOPILOT_KV_HIGH, self.autopilot.high),
            Sample(M.AUTOPILOT_CHANGES, self.autopilot.changes_up, ("up",)),
            Sample(M.AUTOPILOT_CHANGES, self.autopilot.changes_down, ("down",)),
            *self.tier_samples(),
        ]

    def tier_state(self) -> dict[str, Any] | None:
        """Per tier: requests waiting (any wait, preempted included) and running,
        and the age of the oldest one waiting for its first schedule (0 when
        none). Any thread: the queues are read under the scheduler lock (held
        by the engine thread only inside schedule() and the queue methods, so
        the wait is one schedule() at most); None if it is not free within 1 s."""
        sched = self.scheduler
        lock = self.control.lock
        if not lock.acquire(timeout=1.0):
            return None
        try:
            tier_of = self.control.tiers.tier_of
            now = self.wall_clock()
            first_wait, arrived = self._first_wait, self._arrived
            waiting = [0, 0, 0]
            oldest = [0.0, 0.0, 0.0]
            for queue in (sched.waiting, sched.kv_holding_waiting):
                for request in _queued(queue):
                    tier = tier_of(request.num_prompt_tokens)
                    waiting[tier] += 1
                    since = arrived.get(request.request_id)
                    if since is not None and request.status in first_wait:
                        oldest[tier] = max(oldest[tier], now - since)
            running = running_by_tier(self.control.tiers.boundaries, list(sched.running))
        finally:
            lock.release()
        return {
            tier: {
                "waiting": waiting[i],
                "running": running[i],
                "oldest_waiting_seconds": oldest[i],
            }
            for i, tier in enumerate(TIERS)
        }

    def tier_samples(self) -> list[Sample]:
        state = self.tier_state()
        samples: list[Sample] = []
        for i, tier in enumerate(TIERS):
            if state is not None:
                t = state[tier]
                samples.append(Sample(M.TIER_REQUESTS_WAITING, t["waiting"], (tier,)))
                samples.append(Sample(M.TIER_REQUESTS_RUNNING, t["running"], (tier,)))
                samples.append(Sample(M.TIER_OLDEST_WAITING, t["oldest_waiting_seconds"], (tier,)))
            h = self.tier_queue_histograms[i]
            samples.append(
                Sample(M.TIER_QUEUE_SECONDS, h.sum, (tier,), buckets=tuple(accumulate(h.counts)))
            )
        return samples

    # -- failure -------------------------------------------------------------

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


_num_computed_tokens = attrgetter("num_computed_tokens")
_request_id = attrgetter("request_id")


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _queued(queue: Any) -> Iterator[Any]:
    """The requests in a vLLM request queue (or ours), in no particular order."""
    heaps = getattr(queue, "_heaps", None)
    if heaps is not None:
        return (entry[3] for heap in heaps for entry in heap)
    heap = getattr(queue, "_heap", None)
    return iter(list(heap if heap is not None else queue))


def _count_real_blocks(blocks: list[Any]) -> int:
    return sum(1 for b in blocks if not b.is_null)


class RunbookSchedulerMixin:
    """Mixed in front of a vLLM scheduler class; see the module docstring."""

    _runbook: EngineCollector | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._runbook = EngineCollector(self)
        except Exception:
            self._runbook = None
            logger.exception("vllm-runbook: collector not started; the engine runs without it")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        runbook = self._runbook
        if runbook is None or not runbook.enabled:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        control = runbook.control
        with control.lock:
            try:
                if control.pending:  # knob changes land between steps only
                    control.drain()
                free_before = runbook.block_pool.get_num_free_blocks()
            except Exception as exc:
                runbook.disable(exc)
                return super().schedule(*args, **kwargs)  # type: ignore[misc]
            if runbook.autopilot.pending is not None:
                try:
                    runbook.autopilot_apply()
                except Exception as exc:
                    runbook.autopilot_failed(exc)
            # After the autopilot: the tier limits scale with this step's max_num_seqs.
            tiered = control.tiered
            if tiered:
                try:
                    control.begin_tiered_step()
                except Exception as exc:
                    runbook.disable(exc)
                    with contextlib.suppress(Exception):
                        control.end_tiered_step()  # the queues go on, in order, without limits
                    return super().schedule(*args, **kwargs)  # type: ignore[misc]
            start = time.perf_counter()
            try:
                output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            finally:
                if tiered:
                    try:
                        control.end_tiered_step()
                    except Exception as exc:
                        runbook.disable(exc)
            elapsed = time.perf_counter() - start
        try:
            runbook.on_schedule(self, output, elapsed, free_before)
        except Exception as exc:
            runbook.disable(exc)
            return output
        if runbook.autopilot.enabled:
            try:
                runbook.autopilot_observe(self, output, free_before)
            except Exception as exc:
                runbook.autopilot_failed(exc)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        runbook = self._runbook
        if runbook is None or not runbook.enabled:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        with runbook.control.lock:
            result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        try:
            runbook.on_update(self, scheduler_output, model_runner_output)
        except Exception as exc:
            runbook.disable(exc)
        return result

    # The queues a policy switch rebuilds are also touched here.
    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        runbook = self._runbook
        if runbook is None:
            return super().add_request(*args, **kwargs)  # type: ignore[misc]
        with runbook.control.lock:
            result = super().add_request(*args, **kwargs)  # type: ignore[misc]
        if runbook.enabled:
            try:
                runbook.on_add_request(args[0] if args else kwargs["request"])
            except Exception as exc:
                runbook.disable(exc)
        return result

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        runbook = self._runbook
        if runbook is None:
            return super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        with runbook.control.lock:
            result = super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        if runbook.enabled:
            try:
                runbook.on_requests_finished(self)
            except Exception as exc:
                runbook.disable(exc)
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        # With reset_running_requests it preempts every running request onto
        # `waiting`: a policy switch rebuilding that queue at the same time
        # (the HTTP thread, while the engine is paused) would lose them.
        runbook = self._runbook
        if runbook is None:
            return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        with runbook.control.lock:
            return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        runbook = self._runbook
        if runbook is not None and runbook.enabled:
            try:
                runbook.on_request_finished(request)
            except Exception as exc:
                runbook.disable(exc)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            if self._runbook is not None:
                self._runbook.close()


def with_collector(scheduler_cls: type) -> type:
    """`scheduler_cls` with the hook mixed in front (itself if already hooked)."""
    if issubclass(scheduler_cls, RunbookSchedulerMixin):
        return scheduler_cls
    return type(
        f"Runbook{scheduler_cls.__name__}",
        (RunbookSchedulerMixin, scheduler_cls),
        {"__module__": __name__},
    )
