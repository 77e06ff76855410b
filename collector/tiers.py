"""Hot/warm/cold tiers by prompt length, and the `tiered` scheduling policy.

The field reports' request-tiering (hot < 256 prompt tokens: interactive,
warm 256-1,024, cold >= 1,024: batch) done inside vLLM's scheduler:

- `TieredRequestQueue` is a vLLM `RequestQueue`: waiting requests are served
  by (client priority, tier, arrival). A request moves up one tier for every
  `aging_seconds` it has waited (a cold one reaches the hot tier after twice
  that), so none starves behind a steady stream of shorter ones.
- per-tier admission limits: while a request of another tier waits, a tier
  at its limit admits no more (an aged request is exempt). A tier whose
  neighbours have nothing waiting may borrow their slots, except that the
  warm and cold tiers never borrow the hot tier's free slots: a burst of
  long requests cannot fill the batch and leave arriving hot ones no room.
- a share of the step's token budget per tier: while hot requests wait,
  every prefill chunk of the step is capped at the budget minus the hot
  tier's share (its share of the shares of the tiers that have work), so a
  long prefill never takes the whole step from the hot tier's admissions;
  while hot requests only decode, the cap leaves one token for each; the
  cap is split between the prefills running (each takes a chunk, ahead of
  the waiting requests); an idle hot tier lends its share. (vLLM schedules the running
  requests first, in their order, and has one chunk limit per step,
  `long_prefill_token_threshold`: that is the lever, set per step on the
  collector's own copy of the scheduler config, and only with chunked prefill.)

`TierConfig` is the configuration (boundaries, limits, shares, aging) and
validates it; the per-step work is a handful of integer operations plus one
C-level pass over the running requests (see `running_by_tier`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from operator import attrgetter, lt
from typing import Any

from vllm_runbook.collector.metrics import TIERS

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_BOUNDARIES = (256, 1024)
# The report's maximum batch per path (16 / 32 / 8 of 56 sequences) and its
# GPU quota per path (40 / 45 / 15 %).
REPORT_LIMITS = (16, 32, 8)
DEFAULT_SHARES = (0.40, 0.45, 0.15)
DEFAULT_AGING_SECONDS = 30.0


class TierConfigError(ValueError):
    """Tier settings that cannot work (bad boundaries, limits, shares, aging)."""


def scaled_limits(max_num_seqs: int) -> tuple[int, int, int]:
    """The report's 16/32/8 of 56 scaled to `max_num_seqs` (each at least 1)."""
    total = sum(REPORT_LIMITS)
    return tuple(max(1, round(n * max_num_seqs / total)) for n in REPORT_LIMITS)  # type: ignore[return-value]


@dataclass(frozen=True)
class TierConfig:
    boundaries: tuple[int, int] = DEFAULT_BOUNDARIES  # prompt tokens: hot < b0 <= warm < b1 <= cold
    limits: tuple[int, int, int] | None = None  # running requests per tier; None: scaled_limits
    shares: tuple[float, float, float] = DEFAULT_SHARES  # of the step's token budget
    aging_seconds: float = DEFAULT_AGING_SECONDS  # waited this long: one tier up

    def __post_init__(self) -> None:
        b = self.boundaries
        if len(b) != 2 or not all(isinstance(x, int) and x > 0 for x in b) or b[0] >= b[1]:
            raise TierConfigError(
                f"tier boundaries must be two increasing positive token counts "
                f"(hot < first <= warm < second <= cold), got {b!r}"
            )
        if self.limits is not None and (
            len(self.limits) != 3 or not all(isinstance(x, int) and x >= 1 for x in self.limits)
        ):
            raise TierConfigError(
                f"tier limits must be three integers >= 1 (hot, warm, cold), got {self.limits!r}"
            )
        s = self.shares
        if len(s) != 3 or not all(0 < x <= 1 for x in s) or not math.isclose(sum(s), 1.0):
            raise TierConfigError(
                f"tier shares must be three fractions in (0, 1] summing to 1 "
                f"(hot, warm, cold), got {s!r}"
            )
        if not (self.aging_seconds > 0 and math.isfinite(self.aging_seconds)):
            raise TierConfigError(
                f"tier aging must be a positive number of seconds, got {self.aging_seconds!r}"
            )

    def limits_for(self, max_num_seqs: int) -> tuple[int, int, int]:
        return self.limits if self.limits is not None else scaled_limits(max_num_seqs)

    def tier_of(self, num_prompt_tokens: int) -> int:
        """0 hot, 1 warm, 2 cold."""
        return bisect.bisect_right(self.boundaries, num_prompt_tokens)

    def as_dict(self, max_num_seqs: int) -> dict[str, Any]:
        return {
            "boundaries": list(self.boundaries),
            "limits": dict(zip(TIERS, self.limits_for(max_num_seqs), strict=True)),
            "shares": dict(zip(TIERS, self.shares, strict=True)),
            "aging_seconds": self.aging_seconds,
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TierConfig:
        """VLLM_RUNBOOK_TIER_BOUNDARIES=256,1024, VLLM_RUNBOOK_TIER_LIMITS=16,32,8,
        VLLM_RUNBOOK_TIER_SHARES=0.4,0.45,0.15, VLLM_RUNBOOK_TIER_AGING_SECONDS=30."""
        env = os.environ if env is None else env

        def numbers(key: str, kind: Callable[[str], Any], default: Any) -> Any:
            text = env.get(key, "").strip()
            if not text:
                return default
            try:
                return tuple(kind(p.strip()) for p in text.split(","))
            except ValueError:
                raise TierConfigError(f"{key}={text!r}: expected comma-separated numbers") from None

        aging_text = env.get("VLLM_RUNBOOK_TIER_AGING_SECONDS", "").strip()
        try:
            aging = float(aging_text) if aging_text else DEFAULT_AGING_SECONDS
        except ValueError:
            raise TierConfigError(
                f"VLLM_RUNBOOK_TIER_AGING_SECONDS={aging_text!r}: expected seconds"
            ) from None
        return cls(
            boundaries=numbers("VLLM_RUNBOOK_TIER_BOUNDARIES", int, DEFAULT_BOUNDARIES),
            limits=numbers("VLLM_RUNBOOK_TIER_LIMITS", int, None),
            shares=numbers("VLLM_RUNBOOK_TIER_SHARES", float, DEFAULT_SHARES),
            aging_seconds=aging,
        )


_num_prompt_tokens = attrgetter("num_prompt_tokens")


def tiers_of(boundaries: tuple[int, int], requests: Iterable[Any]) -> Iterator[int]:
    """The tier of each request (C-level map; no Python loop per request)."""
    return map(partial(bisect.bisect_right, boundaries), map(_num_prompt_tokens, requests))


def running_by_tier(boundaries: tuple[int, int], running: Iterable[Any]) -> list[int]:
    counts = Counter(tiers_of(boundaries, running))  # counted in C
    return [counts[0], counts[1], counts[2]]


_num_computed_tokens = attrgetter("num_computed_tokens")


def prefills_running(running: list[Any]) -> int:
    """Running requests whose prompt is not computed yet (counted in C)."""
    return sum(map(lt, map(_num_computed_tokens, running), map(_num_prompt_tokens, running)))


def prefill_chunk_cap(
    budget: int, shares: tuple[float, float, float], active: Iterable[bool], hot_floor: int
) -> int:
    """The largest prefill chunk while the hot tier has work: the budget minus the
    hot tier's share of the shares of the tiers that have work (`active`)."""
    total = sum(s for s, on in zip(shares, active, strict=True) if on) or 1.0
    cap = int(budget * (1.0 - shares[0] / total))
    return max(cap, min(hot_floor, budget), 1)


class TieredRequestQueue:
    """vLLM RequestQueue for the `tiered` policy (see the module docstring).

    One heap per tier of (priority, arrival_time, seq, request): the head of
    each is its tier's first by (client priority, arrival), and the oldest
    when priorities are equal, so aging is judged on three heads only.

    Between `begin_step()` and `end_step()` (the hook brackets schedule())
    the queue knows the running requests per tier and applies the admission
    limits: `peek_request` gives the first admissible request, and the queue
    is false when none is (vLLM's admission loop then stops). Outside a step
    it is a plain ordered queue.
    """

    def __init__(
        self,
        config: TierConfig,
        clock: Callable[[], float],
        waited_since: Callable[[Any], float],
    ) -> None:
        self.config = config
        self.clock = clock
        self.waited_since = waited_since  # request -> when it started waiting
        self._heaps: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        self._seq = itertools.count()
        # Per step (None outside a step).
        self._now: float | None = None
        self._running: list[int] | None = None
        self._limits: tuple[int, int, int] = (0, 0, 0)
        self._max_active = 0
        self._popped: set[str] = set()
        self._failed = False

    # -- tiers ---------------------------------------------------------------

    def tier_counts(self) -> list[int]:
        return [len(h) for h in self._heaps]

    def _effective_tier(self, tier: int, request: Any, now: float) -> int:
        waited = now - self.waited_since(request)
        return max(0, tier - int(waited // self.config.aging_seconds)) if waited > 0 else tier

    def begin_step(
        self, now: float, running: list[int], limits: tuple[int, int, int], max_active: int = 0
    ) -> None:
        """`running`: requests running per tier (updated as the queue admits);
        `max_active`: the engine's admission limit (0: no hot reserve)."""
        self._now, self._running, self._limits = now, running, limits
        self._max_active = max_active
        self._popped.clear()

    def end_step(self) -> None:
        self._now = self._running = None
        self._popped.clear()

    def _choose(self) -> tuple[int, Any] | None:
        """(tier, entry) of the request to serve next; None when none may be admitted.
        Runs inside vLLM's schedule(): should our ordering ever fail, the queue
        serves its first non-empty tier and the engine goes on."""
        try:
            return self._choose_tiered()
        except Exception:
            if not self._failed:
                self._failed = True
                logger.exception("vllm-runbook: tiered ordering failed; serving in tier order")
            return next(((t, h[0]) for t, h in enumerate(self._heaps) if h), None)

    def _choose_tiered(self) -> tuple[int, Any] | None:
        now = self.clock() if self._now is None else self._now
        best: tuple[Any, ...] | None = None
        best_tier = -1
        waiting = [bool(h) for h in self._heaps]
        for tier, heap in enumerate(self._heaps):
            if not heap:
                continue
            entry = heap[0]
            request = entry[3]
            effective = self._effective_tier(tier, request, now)
            key = (entry[0], effective, entry[1], entry[2])
            running = self._running
            if (
                running is not None
                and effective == tier  # an aged request is exempt from the limits
                and running[tier] >= self._limits[tier]
            ):
                if any(waiting[t] for t in range(3) if t != tier):
                    continue  # another tier waits: no borrowing
                hot_free = max(0, self._limits[0] - running[0])
                if tier and self._max_active and sum(running) >= self._max_active - hot_free:
                    continue  # borrowing would take the hot tier's free slots
            if best is None or key < best:
                best, best_tier = key, tier
        if best is None:
            return None
        return best_tier, self._heaps[best_tier][0]

    # -- RequestQueue --------------------------------------------------------

    def add_request(self, request: Any) -> None:
        tier = self.config.tier_of(request.num_prompt_tokens)
        heapq.heappush(
            self._heaps[tier], (request.priority, request.arrival_time, next(self._seq), request)
        )

    def pop_request(self) -> Any:
        chosen = self._choose()
        if chosen is None:
            # vLLM pops only after a peek or a truthy check; keep it total anyway.
            chosen = next(((t, h[0]) for t, h in enumerate(self._heaps) if h), None)
            if chosen is None:
                raise IndexError("pop from an empty queue")
        tier, _ = chosen
        request = heapq.heappop(self._heaps[tier])[3]
        if self._running is not None:
            self._running[tier] += 1  # admitted (or skipped: corrected when prepended)
            self._popped.add(request.request_id)
        return request

    def peek_request(self) -> Any:
        chosen = self._choose()
        if chosen is None:
            raise IndexError("peek from an empty queue")
        return chosen[1][3]

    def prepend_request(self, request: Any) -> None:
        # Order is by (priority, tier, arrival): a preempted or skipped request
        # keeps its arrival time, so it goes back ahead of later ones.
        if self._running is not None and request.request_id in self._popped:
            self._popped.discard(request.request_id)
            self._running[self.config.tier_of(request.num_prompt_tokens)] -= 1
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Any) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Any]) -> None:
        gone = requests if isinstance(requests, set) else set(requests)
        for tier, heap in enumerate(self._heaps):
            kept = [e for e in heap if e[3] not in gone]
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heaps[tier][:] = kept

    def __bool__(self) -> bool:
        if self._running is None:
            return any(self._heaps)
        return self._choose() is not None

    def __len__(self) -> int:
        return sum(map(len, self._heaps))

    def __iter__(self) -> Iterator[Any]:
        """All requests in the order they would be served (limits aside)."""
        now = self.clock() if self._now is None else self._now
        entries = [
            ((e[0], self._effective_tier(t, e[3], now), e[1], e[2]), e[3])
            for t, heap in enumerate(self._heaps)
            for e in heap
        ]
        entries.sort(key=lambda kv: kv[0])
        return iter([request for _, request in entries])
