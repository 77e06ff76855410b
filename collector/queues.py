"""The scheduler's queues seen from outside the step: requests per tier and the
ones waiting longest, for the per-tier gauges and for a diagnosis.

Any thread. The queues are read under the scheduler lock (held by the
engine thread only inside schedule() and the queue methods, so the wait is
one schedule() at most); a reader gives up when it is not free within 1 s.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import QueuedRequest, Queues
from vllm_runbook.collector.exporter import Sample
from vllm_runbook.collector.request_tracking import RequestTracker
from vllm_runbook.collector.tiers import TierConfig, running_by_tier

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import Request, RequestQueue, VllmScheduler

LOCK_WAIT_SECONDS = 1.0


def queued(queue: RequestQueue) -> Iterator[Request]:
    """The requests in a vLLM request queue (or ours), in no particular order."""
    heaps = getattr(queue, "_heaps", None)
    if heaps is not None:
        return (entry[3] for heap in heaps for entry in heap)
    heap = getattr(queue, "_heap", None)
    return iter(list(heap if heap is not None else queue))


class TierCounts:
    """Per tier (hot, warm, cold): requests waiting (any wait, preempted
    included), running, and the age of the oldest waiting for its first
    schedule (0 when none)."""

    __slots__ = ("oldest_waiting_seconds", "running", "waiting")

    def __init__(self, waiting: list[int], running: list[int], oldest: list[float]) -> None:
        self.waiting = waiting
        self.running = running
        self.oldest_waiting_seconds = oldest


class QueueInspector:
    """Reads the scheduler's queues. Data sources: the scheduler and its lock,
    the tiers, and the arrivals `requests` tracks."""

    def __init__(
        self,
        scheduler: VllmScheduler,
        lock: threading.RLock,
        tiers: TierConfig,
        requests: RequestTracker,
    ) -> None:
        self.scheduler = scheduler
        self.lock = lock
        self.tiers = tiers
        self.requests = requests

    def tier_counts(self) -> TierCounts | None:
        """None if the scheduler lock is not free within 1 s."""
        sched = self.scheduler
        if not self.lock.acquire(timeout=LOCK_WAIT_SECONDS):
            return None
        try:
            tier_of = self.tiers.tier_of
            now = self.requests.clock()
            first_wait, arrived = self.requests.first_wait, self.requests.arrived
            waiting = [0, 0, 0]
            oldest = [0.0, 0.0, 0.0]
            for queue in (sched.waiting, sched.kv_holding_waiting):
                for request in queued(queue):
                    tier = tier_of(request.num_prompt_tokens)
                    waiting[tier] += 1
                    since = arrived.get(request.request_id)
                    if since is not None and request.status in first_wait:
                        oldest[tier] = max(oldest[tier], now - since)
            running = running_by_tier(self.tiers.boundaries, list(sched.running))
        finally:
            self.lock.release()
        return TierCounts(waiting, list(running), oldest)

    def samples(self) -> list[Sample]:
        counts = self.tier_counts()
        if counts is None:
            return []
        samples: list[Sample] = []
        for i, tier in enumerate(M.TIERS):
            samples.append(Sample(M.TIER_REQUESTS_WAITING, counts.waiting[i], (tier,)))
            samples.append(Sample(M.TIER_REQUESTS_RUNNING, counts.running[i], (tier,)))
            samples.append(Sample(M.TIER_OLDEST_WAITING, counts.oldest_waiting_seconds[i], (tier,)))
        return samples

    def snapshot(self, oldest: int = 5) -> Queues | None:
        """The queues for a diagnosis: their lengths, the pause state and the
        `oldest` requests waiting longest for their first schedule (HTTP thread)."""
        sched = self.scheduler
        if not self.lock.acquire(timeout=LOCK_WAIT_SECONDS):
            return None
        try:
            now = self.requests.clock()
            arrived, first_wait = self.requests.arrived, self.requests.first_wait
            waiting = [
                (arrived[r.request_id], r)
                for q in (sched.waiting, sched.kv_holding_waiting)
                for r in queued(q)
                if r.request_id in arrived and r.status in first_wait
            ]
            heads = [
                (since, r.request_id, int(r.num_prompt_tokens), int(r.priority), r.status)
                for since, r in heapq.nsmallest(oldest, waiting, key=lambda entry: entry[0])
            ]
            lengths = len(sched.running), len(sched.waiting), len(sched.kv_holding_waiting)
            pause = getattr(sched, "_pause_state", None)
        finally:
            self.lock.release()
        # The models are built after the lock is released: the engine waits for nothing.
        tier_of = self.tiers.tier_of
        return Queues(
            running=lengths[0],
            waiting=lengths[1],
            kv_holding_waiting=lengths[2],
            pause_state=getattr(pause, "name", None if pause is None else str(pause)),
            oldest_waiting=[
                QueuedRequest(
                    request_id=request_id,
                    tier=M.TIERS[tier_of(prompt_tokens)],
                    prompt_tokens=prompt_tokens,
                    priority=priority,
                    status=getattr(status, "name", str(status)),
                    waited_seconds=max(0.0, now - since),
                )
                for since, request_id, prompt_tokens, priority, status in heads
            ],
        )
