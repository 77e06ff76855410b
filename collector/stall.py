"""The engine's heartbeat, and why it makes no progress when it does not.

A stuck engine answers `/health` with 200 (its API server is fine; the
EngineCore loop is not), so the router keeps sending it traffic. The
collector sees what the API server does not: the scheduler's steps. The
engine thread stamps the time of each `schedule()` and `update_from_output()`
(StepStats: one `time.monotonic()` each, plain floats); everything here
runs at scrape time on the agent's thread from those stamps and list
lengths, without the scheduler lock, so it answers while a step is stuck
holding it.

Reasons, at most one at a time (the first that holds):

    step_hung          a step was scheduled and has not come back for
                       max(`stall_seconds`, HUNG_FACTOR x the usual step time)
                       (a hung forward pass, a collective that never returns)
    no_steps           no step for `stall_seconds` while requests wait or run
                       (the loop stopped: a deadlock, a paused scheduler)
    admission_stalled  steps go on, requests wait, nothing was admitted for
                       ADMISSION_FACTOR x `stall_seconds` while KV blocks are
                       free (the admission-deadlock shape users report)

`stall_seconds` is VLLM_RUNBOOK_STALL_SECONDS (default 10).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.exporter import Sample

if TYPE_CHECKING:
    from vllm_runbook.collector.step_stats import StepStats
    from vllm_runbook.collector.vllm_types import VllmScheduler

STALL_REASONS: Final = ("step_hung", "no_steps", "admission_stalled")
# A step is hung after this many times the usual step time (and `stall_seconds`).
HUNG_FACTOR: Final = 20.0
# Nothing admitted for this many `stall_seconds` while requests wait and KV is free.
ADMISSION_FACTOR: Final = 3.0
# "KV is free": at least this fraction of the usable blocks.
ADMISSION_FREE_KV: Final = 0.1


class StallWatch:
    """Reads the step stamps of `stats` and the scheduler's queue lengths (any
    thread, no lock). Data sources: the scheduler, its StepStats, a monotonic clock."""

    def __init__(
        self,
        scheduler: VllmScheduler,
        stats: StepStats,
        stall_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.started_at = clock()

    def last_step_age(self) -> float:
        """Seconds since the scheduler last started or finished a step (since the
        collector started when no step ran yet)."""
        stats = self.stats
        last = max(stats.scheduled_at, stats.updated_at, self.started_at)
        return max(0.0, self.clock() - last)

    def reason(self) -> str | None:
        """Why the engine makes no progress now; None while it does (or idles)."""
        stats, sched = self.stats, self.scheduler
        now = self.clock()
        # One read of each: the engine thread may move them meanwhile.
        steps, updates = stats.steps, stats.updates
        scheduled_at, updated_at = stats.scheduled_at, stats.updated_at
        waiting = len(sched.waiting) + len(sched.kv_holding_waiting)
        running = len(sched.running)
        if waiting + running == 0:
            return None  # idle, or every request finished while a step was out
        last = max(scheduled_at, updated_at, self.started_at)
        if steps > updates:
            # With async scheduling the next step is scheduled before the last
            # one comes back: a hung step stops both stamps.
            limit = max(self.stall_seconds, HUNG_FACTOR * stats.step_seconds_usual)
            return "step_hung" if now - last > limit else None
        if now - last > self.stall_seconds:
            return "no_steps"
        if waiting:
            # Steps run (none may schedule anything) but the queue's head is never admitted.
            since = max(stats.admitted_at, stats.queue_empty_at, self.started_at)
            usable = stats.usable_blocks
            free = stats.block_pool.get_num_free_blocks()
            kv_free = usable > 0 and free / usable >= ADMISSION_FREE_KV
            if kv_free and now - since > ADMISSION_FACTOR * self.stall_seconds:
                return "admission_stalled"
        return None

    def samples(self) -> list[Sample]:
        reason = self.reason()
        return [
            Sample(M.LAST_STEP_AGE, self.last_step_age()),
            Sample(M.ENGINE_STALLED, 0.0 if reason is None else 1.0),
            *(
                Sample(M.ENGINE_STALL_REASON, 1.0 if r == reason else 0.0, (r,))
                for r in STALL_REASONS
            ),
        ]
