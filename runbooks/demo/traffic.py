"""The demo's client traffic: closed-loop clients and single requests on one
asyncio loop in a background thread, every request timed and logged."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from vllm_runbook.runbooks.demo.config import HIGH
from vllm_runbook.runbooks.demo.report import SignalLog


@dataclass
class Request:
    t0: float
    phase: str
    priority: int
    output_tokens: int
    t1: float | None = None
    ok: bool | None = None  # None with t1 set: cancelled at the end of its phase
    error: str | None = None


class Clients:
    """A group of closed-loop clients; `stop()` cancels their requests in flight
    (vLLM aborts a request whose client disconnects)."""

    def __init__(self, traffic: Traffic, tasks: list[asyncio.Task[None]]) -> None:
        self.traffic, self.tasks = traffic, tasks

    def stop(self) -> None:
        for task in self.tasks:
            self.traffic.loop.call_soon_threadsafe(task.cancel)


class Traffic:
    """All client traffic, on one asyncio loop in a background thread; every
    request is timed and written to the signal history."""

    def __init__(self, api: str, model: str, log: SignalLog) -> None:
        self.api, self.model, self.log = api, model, log
        self.phase = "steady"
        self.requests: list[Request] = []
        self.closing = False
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.http: httpx.AsyncClient = self._call(self._client())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @staticmethod
    async def _client() -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        return httpx.AsyncClient(timeout=300, limits=limits)

    def close(self) -> None:
        """Cancel every request in flight and stop the loop (idempotent)."""
        if self.closing:
            return
        self.closing = True

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(0.5, self.loop.stop)

        self.loop.call_soon_threadsafe(cancel_all)
        self._thread.join(5)

    def _new(self, max_tokens: int, priority: int) -> Request:
        req = Request(time.time(), self.phase, priority, max_tokens)
        with self._lock:
            self.requests.append(req)
        return req

    async def _send(self, req: Request, prompt: list[int]) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "priority": req.priority,
        }
        try:
            for attempt in range(3):
                try:
                    response = await self.http.post(self.api + "/v1/completions", json=body)
                    response.raise_for_status()
                    req.ok = True
                    break
                except httpx.TransportError as exc:
                    # Typically a keep-alive connection the server closed as
                    # it was reused; a completion can simply be sent again.
                    if attempt == 2:
                        req.ok, req.error = False, f"{type(exc).__name__}: {exc}"
                except httpx.HTTPError as exc:
                    req.ok, req.error = False, f"{type(exc).__name__}: {exc}"
                    break
        except asyncio.CancelledError:
            req.ok = None  # the phase ended: not a failure
            raise
        finally:
            req.t1 = time.time()
            if self.closing and req.ok is False:
                req.ok = None  # the engine stopping is no failure either
            self.log.write(
                "request",
                t0=req.t0,
                t1=req.t1,
                phase=req.phase,
                priority=req.priority,
                ok=req.ok,
                output_tokens=req.output_tokens,
                **({"error": req.error} if req.error else {}),
            )

    def send(self, prompt: list[int], max_tokens: int, priority: int) -> Request:
        """Send one request without waiting for it; the Request fills in when done."""
        return self.send_cancellable(prompt, max_tokens, priority)[0]

    def send_cancellable(
        self, prompt: list[int], max_tokens: int, priority: int
    ) -> tuple[Request, concurrent.futures.Future[None]]:
        """`send`, and the future that cancels the request in flight."""
        req = self._new(max_tokens, priority)
        return req, asyncio.run_coroutine_threadsafe(self._send(req, prompt), self.loop)

    def clients(
        self, n: int, make: Callable[[random.Random], tuple[list[int], int, int]]
    ) -> Clients:
        """`n` clients, each sending `make(rng)` → (prompt, max_tokens, priority)
        as soon as its previous request is done, until stopped."""

        async def loop(seed: int) -> None:
            rng = random.Random(seed)
            while not self.closing:
                prompt, max_tokens, priority = make(rng)
                await self._send(self._new(max_tokens, priority), prompt)

        async def start() -> list[asyncio.Task[None]]:
            base = random.randrange(1 << 30)
            return [asyncio.create_task(loop(base + k)) for k in range(n)]

        return Clients(self, self._call(start()))

    def in_flight(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.t1 is None]

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.t1 is not None and r.t1 >= t and r.ok)


@dataclass
class QueueReading:
    """What the backlog keeper needs of the engine, from the agent's latest state."""

    t: float  # when it was read (time.time())
    max_num_seqs: int  # the admission limit now (the autopilot may move it)
    waiting: int  # requests in the engine's waiting queue (any priority)


class Backlog:
    """Open-loop high-priority arrivals that keep a queue in front of the engine.

    Closed-loop clients come in waves: when their requests finish together the
    engine's queue can empty for a moment, and whatever lower-priority request
    waits is admitted. Starvation needs a backlog that never drains, so this
    keeps the number of high-priority requests waiting (in the engine or on
    their way to it) at least `depth` deep, whatever the admission limit and
    the engine's speed: `depth` follows the measured completion rate
    (`seconds_of_work` of it), so the queue outlasts a pause of the client
    process that long. `tick()` is called about twice a second.
    """

    def __init__(
        self,
        traffic: Traffic,
        make: Callable[[random.Random], tuple[list[int], int, int]],
        read: Callable[[], QueueReading | None],
        *,
        priority: int,
        min_depth: int = 32,
        max_depth: int = 200,
        seconds_of_work: float = 30.0,
    ) -> None:
        self.traffic, self.make, self.read, self.priority = traffic, make, read, priority
        self.min_depth, self.max_depth, self.seconds_of_work = min_depth, max_depth, seconds_of_work
        self.depth = 0  # high-priority requests to keep queued beyond the admission limit
        self.sized = False  # True: depth follows the completion rate
        self.rng = random.Random(random.randrange(1 << 30))
        self.sent: list[tuple[Request, concurrent.futures.Future[None]]] = []
        self.started = time.time()
        # What the phase measured, for its story and its failure message.
        self.min_waiting: int | None = None  # fewest high-priority requests waiting in the engine
        self.drained = 0  # readings with none waiting while others waited behind them
        self._last_reading_t = 0.0

    def in_flight(self) -> int:
        return sum(1 for req, _ in self.sent if req.t1 is None)

    def completion_rate(self, window_s: float = 20.0) -> float | None:
        """High-priority requests completed per second over the last `window_s`
        (None until the phase has run that long)."""
        now = time.time()
        if now - self.started < window_s:
            return None
        since = now - window_s
        done = sum(1 for req, _ in self.sent if req.ok and (req.t1 or 0.0) >= since)
        return done / window_s

    def size_by_rate(self) -> None:
        """From now on the queue is sized by the measured completion rate (and
        never shrinks: a pause of the engine lowers the rate, not the need)."""
        self.sized = True
        rate = self.completion_rate()
        want = self.min_depth if rate is None else math.ceil(rate * self.seconds_of_work)
        self.depth = max(self.depth, min(self.max_depth, max(self.min_depth, want)))

    def shorten(self, seconds_of_work: float) -> None:
        """From now on keep `seconds_of_work` of the measured completion rate
        queued (at least `min_depth`): a stream the engine still cannot drain."""
        self.seconds_of_work = seconds_of_work
        rate = self.completion_rate()
        want = self.min_depth if rate is None else math.ceil(rate * seconds_of_work)
        self.depth = min(self.max_depth, max(self.min_depth, want))

    def tick(self, lower_waiting: int = 0) -> None:
        """Top the queue up; `lower_waiting`: requests of lower priority still
        waiting behind it (they are in the engine's waiting count too)."""
        reading = self.read()
        limit = 1 if reading is None else max(1, reading.max_num_seqs)
        want = limit + self.depth
        if reading is not None and reading.t > self._last_reading_t:
            self._last_reading_t = reading.t
            waiting_high = max(0, reading.waiting - lower_waiting)
            if lower_waiting:
                fewest = self.min_waiting
                self.min_waiting = waiting_high if fewest is None else min(fewest, waiting_high)
                if waiting_high == 0:
                    self.drained += 1
            if self.sized and waiting_high < self.depth // 2:
                # Requests slow to reach the engine (a busy API server) are not
                # queued yet: send more until the engine itself holds a queue.
                want = max(want, self.in_flight() + self.depth - waiting_high)
            if self.sized:
                self.size_by_rate()
        want = min(want, limit + 4 * max(self.depth, 1))
        for _ in range(max(0, want - self.in_flight())):
            prompt, max_tokens, _ = self.make(self.rng)
            self.sent.append(self.traffic.send_cancellable(prompt, max_tokens, self.priority))

    def stop(self) -> None:
        """Cancel the requests still in flight (vLLM aborts them)."""
        for req, future in self.sent:
            if req.t1 is None:
                future.cancel()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


SYSTEM_PROMPT = [3 + (7 * i) % 509 for i in range(128)]  # shared by the steady traffic: 4 blocks


def steady_request(rng: random.Random) -> tuple[list[int], int, int]:
    return SYSTEM_PROMPT + _tokens(rng, rng.randint(16, 160)), rng.randint(32, 96), HIGH


def long_request(rng: random.Random) -> tuple[list[int], int, int]:
    # 500-750 prompt + 200-250 output tokens: 22-32 blocks each, ~9 fit in 255.
    return _tokens(rng, rng.randint(500, 750)), rng.randint(200, 250), HIGH


def stream_request(rng: random.Random) -> tuple[list[int], int, int]:
    # Long decodes: the engine, not the HTTP server, is the bottleneck, and the
    # queue holds far more work than a busy machine's pauses can drain.
    # At most 440 tokens (14 blocks): 16 of them fill 88 % of the cache.
    return _tokens(rng, rng.randint(16, 30)), rng.randint(380, 410), HIGH
