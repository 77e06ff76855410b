"""The starvation phase's backlog keeper: a queue of high-priority requests
that never drains, sized by what it measures (unit test with a fake engine)."""

from __future__ import annotations

import concurrent.futures
import random
import time

from vllm_runbook.runbooks.demo.traffic import Backlog, QueueReading, Request


class FakeTraffic:
    def __init__(self) -> None:
        self.sent: list[Request] = []

    def send_cancellable(
        self, prompt: list[int], max_tokens: int, priority: int
    ) -> tuple[Request, concurrent.futures.Future[None]]:
        req = Request(time.time(), "starvation", priority, max_tokens)
        self.sent.append(req)
        return req, concurrent.futures.Future()


def _make(rng: random.Random) -> tuple[list[int], int, int]:
    return [3] * 20, 400, 0


def _finish(reqs: list[Request], n: int, at: float) -> None:
    for req in [r for r in reqs if r.t1 is None][:n]:
        req.t1, req.ok = at, True


def test_backlog_fills_the_current_limit_and_a_few_more_then_sizes_by_the_measured_rate() -> None:
    traffic = FakeTraffic()
    reading = QueueReading(time.time(), 8, 0)  # the autopilot left the limit at 8
    backlog = Backlog(traffic, _make, lambda: reading, priority=0)  # type: ignore[arg-type]
    backlog.depth = 4
    backlog.tick()
    assert len(traffic.sent) == 8 + 4
    backlog.tick()  # nothing finished: nothing more
    assert len(traffic.sent) == 12

    # 20 s of service at 3 completions/s: the queue is 30 s of that work deep.
    backlog.started -= 20
    _finish(traffic.sent, 12, time.time() - 1)
    for _ in range(48):
        traffic.sent.append(Request(time.time() - 19, "starvation", 0, 400, time.time() - 2, True))
    backlog.sent.extend((r, concurrent.futures.Future()) for r in traffic.sent[12:])
    assert backlog.completion_rate() == 60 / 20
    backlog.size_by_rate()
    assert backlog.depth == 90
    reading = QueueReading(time.time(), 8, 90 + 8)  # the engine holds the queue and 8 low ones
    backlog.tick(lower_waiting=8)
    assert backlog.in_flight() == 8 + 90
    assert backlog.min_waiting == 90 and backlog.drained == 0


def test_backlog_sends_more_when_the_engine_queue_runs_low_and_counts_each_drain() -> None:
    traffic = FakeTraffic()
    reading = QueueReading(time.time(), 16, 0)
    backlog = Backlog(traffic, _make, lambda: reading, priority=0, min_depth=32)  # type: ignore[arg-type]
    backlog.size_by_rate()  # no rate measured yet: the minimum depth
    assert backlog.depth == 32
    backlog.tick(lower_waiting=8)  # a fresh reading: 0 high waiting (8 low only), a drain
    # In flight already counts nothing; the engine holds none: 16 + 32 at least.
    assert backlog.in_flight() >= 16 + 32
    assert backlog.drained == 1 and backlog.min_waiting == 0
    sent = backlog.in_flight()
    # The requests are slow to reach the engine (a busy API server): the next
    # fresh reading still shows none waiting, so it sends another queue's worth,
    # up to four queues beyond the limit.
    reading = QueueReading(time.time() + 1, 16, 8)
    backlog.tick(lower_waiting=8)
    assert backlog.in_flight() == min(sent + 32, 16 + 4 * 32)
    assert backlog.drained == 2
    # A stale reading (not newer than the last) counts nothing again.
    backlog.tick(lower_waiting=8)
    assert backlog.drained == 2
    # The queue stops growing at its cap.
    for t in range(2, 6):
        reading = QueueReading(time.time() + t, 16, 8)
        backlog.tick(lower_waiting=8)
    assert backlog.in_flight() == 16 + 4 * 32


def test_stop_cancels_what_is_in_flight() -> None:
    traffic = FakeTraffic()
    backlog = Backlog(  # type: ignore[arg-type]
        traffic, _make, lambda: QueueReading(time.time(), 2, 0), priority=0
    )
    backlog.depth = 1
    backlog.tick()
    _finish(traffic.sent, 1, time.time())
    backlog.stop()
    assert [f.cancelled() for _, f in backlog.sent] == [False, True, True]


def test_the_stream_after_the_fix_counts_a_flip_only_while_the_cause_held() -> None:
    """The demo's judge of the hold: another policy while a request waited over
    2 s, with no reading of a drained queue before, is a flip; once the
    engine's queue drained (the client could not keep the stream up) the revert
    is right and is said, not failed, even when the queue builds again behind
    it before the feed shows the revert."""
    from types import SimpleNamespace

    from vllm_runbook.runbooks.demo.live import StreamAfterFix

    monitor = SimpleNamespace(state=None, state_t=0.0)
    holding = SimpleNamespace(
        status="succeeded", display_status="holding", hold_note="the cause holds"
    )
    feed = SimpleNamespace(executions={3: holding})

    def reading(stream: StreamAfterFix, t: float, policy: str, oldest: float) -> None:
        monitor.state = SimpleNamespace(
            knobs=SimpleNamespace(policy=policy), stats=SimpleNamespace(oldest_waiting=oldest)
        )
        monitor.state_t = t
        stream.update()
        stream.update()  # the same reading twice counts once

    stream = StreamAfterFix(monitor, feed, 3)  # type: ignore[arg-type]
    reading(stream, 1.0, "fcfs", 9.0)
    reading(stream, 2.0, "fcfs", 2.0)
    reading(stream, 3.0, "priority", 0.4)  # drained, then reverted: right
    assert (stream.readings, stream.not_fcfs, stream.drained) == (3, 0, 1)
    said = stream.said(90)
    assert said.endswith(
        "(the cause holds); the policy stayed fcfs at every reading while the cause held; "
        "the engine's queue drained at 1 of 3 readings (the client did not keep the stream up)"
    )
    # The queue builds again behind the reverted policy before the feed says
    # REVERTED (a make demo run failed on this reading): the revert, not a flip.
    reading(stream, 4.0, "priority", 12.0)
    assert (stream.readings, stream.not_fcfs, stream.reverted) == (4, 0, True)
    assert stream.said(90).endswith("; reverted once the cause was gone")
    reading(stream, 5.0, "priority", 30.0)  # not judged after the revert
    assert (stream.readings, stream.not_fcfs) == (4, 0)

    # Priority while the cause held at every reading: a flip the hold forbids.
    monitor.state_t = 0.0
    flipped = StreamAfterFix(monitor, feed, 3)  # type: ignore[arg-type]
    reading(flipped, 1.0, "fcfs", 9.0)
    reading(flipped, 2.0, "priority", 12.0)
    assert (flipped.readings, flipped.not_fcfs, flipped.reverted) == (2, 1, False)
    assert "the policy was not fcfs at 1 of 2 readings while the cause held" in flipped.said(90)
    holding.status = "reverted"  # released by its hold: what follows is not judged
    reading(flipped, 3.0, "priority", 30.0)
    assert (flipped.readings, flipped.not_fcfs, flipped.reverted) == (2, 1, True)
