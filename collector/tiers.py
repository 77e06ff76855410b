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
- shares of each step's token budget (40 / 45 / 15 %): whenever more than
  one tier has work, `tier_quotas` splits the budget by the shares of the
  tiers with work, and what a tier cannot use this step (its demand is
  smaller) goes to the others in proportion to theirs. With chunked prefill
  every prefill chunk is cut to what its tier has left (`ShareLedger`, called
  by vLLM for every request it schedules); a decode is counted, never
  withheld. Without chunked prefill a prompt is scheduled whole or not at
  all, so exact per-step shares are impossible: the queue then admits by
  deficit round robin (each waiting tier earns its quota per step and spends
  it on whole prompts), which holds the shares over steps.
- per-tier deadlines (100 ms / 2 x 500 ms / none): a request still waiting
  for its first schedule past its tier's deadline is demoted one tier, or
  aborted with a reason where its client asked (`ON_DEADLINE_KEY` in the
  request's `extra_args`, the OpenAI API's `vllm_xargs`).

`TierConfig` is the configuration (boundaries, limits, shares, deadlines,
aging) and validates it; the per-step work is a handful of integer
operations plus C-level passes over the running requests (see
`running_by_tier`, `running_demand`).
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
from itertools import compress
from operator import attrgetter, eq, lt, sub
from typing import Any

from vllm_runbook.collector.metrics import TIERS

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_BOUNDARIES = (256, 1024)
# The report's maximum batch per path (16 / 32 / 8 of 56 sequences) and its
# GPU quota per path (40 / 45 / 15 %).
REPORT_LIMITS = (16, 32, 8)
DEFAULT_SHARES = (0.40, 0.45, 0.15)
DEFAULT_AGING_SECONDS = 30.0
# The report's timeouts per path: hot 100 ms ("demote at once"), warm 500 ms
# waited twice ("wait in the queue twice"), cold none.
DEFAULT_DEADLINES: tuple[float | None, float | None, float | None] = (0.1, 1.0, None)
# The request field a client sets to be aborted, not demoted, at its deadline:
# SamplingParams(extra_args={ON_DEADLINE_KEY: "abort"}), or in the OpenAI API
# "vllm_xargs": {"vllm_runbook_on_deadline": "abort"}.
ON_DEADLINE_KEY = "vllm_runbook_on_deadline"


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
    # seconds waiting for a first schedule before a demotion (or an abort); None: none
    deadlines: tuple[float | None, float | None, float | None] = DEFAULT_DEADLINES

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
        d = self.deadlines
        if len(d) != 3 or not all(
            x is None or (isinstance(x, int | float) and 0 < x < math.inf) for x in d
        ):
            raise TierConfigError(
                "tier deadlines must be three positive seconds or none (hot, warm, cold), "
                f"got {d!r}"
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
            "deadlines": dict(zip(TIERS, self.deadlines, strict=True)),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TierConfig:
        """VLLM_RUNBOOK_TIER_BOUNDARIES=256,1024, VLLM_RUNBOOK_TIER_LIMITS=16,32,8,
        VLLM_RUNBOOK_TIER_SHARES=0.4,0.45,0.15, VLLM_RUNBOOK_TIER_AGING_SECONDS=30,
        VLLM_RUNBOOK_TIER_DEADLINES=0.1,1.0,none."""
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
            deadlines=numbers("VLLM_RUNBOOK_TIER_DEADLINES", _seconds_or_none, DEFAULT_DEADLINES),
        )


def _seconds_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


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


def tier_quotas(
    budget: int, shares: tuple[float, float, float], demand: Iterable[int]
) -> list[int]:
    """The step's token budget split between the tiers by their shares.

    Only tiers with demand take part (an idle tier lends its share). A tier
    whose demand is below its part gets its demand, and the rest is split
    again between the others by their shares, until every tier has its
    demand or the budget is spent (water-filling). Parts are whole tokens
    (largest remainder; a tie goes to the hotter tier). Examples at a budget
    of 1,000 and 40/45/15: every tier busy → 400/450/150; hot wants 30,
    warm and cold much more → 30/728/242."""
    want = [max(0, int(d)) for d in demand]
    quota = [0, 0, 0]
    remaining = int(budget)
    active = [t for t in range(3) if want[t] > 0]
    while active and remaining > 0:
        total = sum(shares[t] for t in active)
        exact = {t: remaining * shares[t] / total for t in active}
        satisfied = [t for t in active if want[t] - quota[t] <= exact[t]]
        if satisfied:
            for t in satisfied:
                remaining -= want[t] - quota[t]
                quota[t] = want[t]
            active = [t for t in active if t not in satisfied]
            continue
        parts = {t: int(exact[t]) for t in active}
        leftover = remaining - sum(parts.values())
        for t in sorted(active, key=lambda t: (parts[t] - exact[t], t))[:leftover]:
            parts[t] += 1
        for t in active:
            quota[t] += parts[t]
        break
    return quota


_num_tokens_with_spec = attrgetter("num_tokens_with_spec")


def running_demand(tiers: list[int], running: list[Any]) -> list[int]:
    """Tokens the running requests of each tier still need (their remaining
    prompt, or one per decode), summed in C."""
    need = list(map(sub, map(_num_tokens_with_spec, running), map(_num_computed_tokens, running)))
    return [sum(compress(need, map(eq, tiers, itertools.repeat(t)))) for t in range(3)]


def wants_abort(request: Any) -> bool:
    """Whether the client asked to be aborted, not demoted, at its deadline."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, Mapping):
        return False
    return str(extra.get(ON_DEADLINE_KEY, "")).lower() == "abort"


@dataclass
class Expired:
    """A waiting request past its tier's deadline, and what was done."""

    request: Any
    tier: int  # the tier whose deadline it missed
    waited: float  # seconds
    aborted: bool  # False: demoted to tier + 1


class TieredRequestQueue:
    """vLLM RequestQueue for the `tiered` policy (see the module docstring).

    One heap per tier of (priority, arrival_time, seq, request, tokens): the
    head of each is its tier's first by (client priority, arrival), and the
    oldest when priorities are equal, so aging is judged on three heads only.
    `tokens` is what the request would compute at admission (its demand).
    Per tier with a deadline, a second heap by arrival finds the requests
    past it (`expire`) by looking at its head only.

    Between `begin_step()` and `end_step()` (the hook brackets schedule())
    the queue knows the running requests per tier and applies the admission
    limits and, once `set_quotas()` gave them, the tiers' shares of the
    budget: `peek_request` gives the first admissible request, and the queue
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
        self._tokens = [0, 0, 0]  # sum of the entries' tokens, per heap
        self._where: dict[str, int] = {}  # request id -> the heap it is in
        self._due: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        self._seq = itertools.count()
        # Deficit round robin without chunked prefill: tokens each tier may
        # still admit (earned per step while it waits; kept between steps).
        self._credit = [0.0, 0.0, 0.0]
        # Per step (None outside a step).
        self._now: float | None = None
        self._running: list[int] | None = None
        self._limits: tuple[int, int, int] = (0, 0, 0)
        self._max_active = 0
        self._popped: dict[str, int] = {}  # request id -> the tier it was popped from
        self._left: list[int] | None = None  # chunked prefill: tokens left per tier
        self._drr = False
        self._quotas = [0, 0, 0]
        self.peeked: tuple[Any, int] | None = None  # (request, tier) vLLM is looking at
        self._failed = False

    # -- tiers ---------------------------------------------------------------

    def tier_counts(self) -> list[int]:
        return [len(h) for h in self._heaps]

    def tier_tokens(self) -> list[int]:
        """Tokens the waiting requests of each tier would compute at admission."""
        return list(self._tokens)

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
        self._left, self._drr = None, False

    def set_quotas(self, quotas: list[int] | None, chunked: bool) -> None:
        """This step's token quotas per tier (None: no shares this step).
        Chunked prefill: `quotas` is the ledger the scheduler's chunks are
        taken from (a tier with nothing left admits nothing more); else each
        waiting tier earns its quota as credit and spends it on whole prompts."""
        if quotas is None:
            self._credit = [0.0, 0.0, 0.0]
            return
        if chunked:
            self._left = quotas
            return
        self._drr = True
        self._quotas = quotas
        for t, heap in enumerate(self._heaps):
            if heap:  # earned while it waits, at most enough for its next prompt
                self._credit[t] = min(self._credit[t] + quotas[t], max(quotas[t], heap[0][4]))
            else:
                self._credit[t] = 0.0

    def demand(self, budget: int) -> list[int]:
        """Inside a step: tokens each tier could admit now (0 for a tier at
        its admission limit while another waits), at most the budget each."""
        running, limits = self._running, self._limits
        waiting = [bool(h) for h in self._heaps]
        out = [0, 0, 0]
        for t in range(3):
            if not waiting[t]:
                continue
            if (
                running is not None
                and running[t] >= limits[t]
                and any(waiting[o] for o in range(3) if o != t)
            ):
                continue
            out[t] = min(self._tokens[t], budget)
        return out

    def end_step(self) -> None:
        self._now = self._running = None
        self._popped.clear()
        self._left, self._drr = None, False
        self.peeked = None

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
        borrow: tuple[Any, ...] | None = None  # without credit (deficit round robin)
        borrow_tier = -1
        waiting = [bool(h) for h in self._heaps]
        left, drr = self._left, self._drr
        for tier, heap in enumerate(self._heaps):
            if not heap:
                continue
            entry = heap[0]
            request = entry[3]
            effective = self._effective_tier(tier, request, now)
            key: tuple[Any, ...] = (entry[0], effective, entry[1], entry[2])
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
            if left is not None and left[tier] <= 0:
                continue  # its share of this step is spent
            if drr:
                if self._credit[tier] < entry[4]:
                    if borrow is None or key < borrow:
                        borrow, borrow_tier = key, tier
                    continue
                # A tier that saved its credit over several steps for a prompt
                # larger than one step's quota goes first, or the others would
                # take the budget and it would never fit.
                key = (entry[4] <= self._quotas[tier], *key)
            if best is None or key < best:
                best, best_tier = key, tier
        if best is None:
            if borrow is None:
                return None
            best_tier = borrow_tier  # no tier has the credit: the budget is not left idle
        return best_tier, self._heaps[best_tier][0]

    # -- deadlines -----------------------------------------------------------

    def expire(self, now: float) -> list[Expired]:
        """Requests still waiting for their first schedule past their tier's
        deadline: removed, and demoted one tier (put back in the next tier's
        heap) unless their client asked for an abort (the caller aborts them).
        A request of the last tier is only ever aborted."""
        expired: list[Expired] = []
        deadlines = self.config.deadlines
        for tier in range(3):
            deadline, due = deadlines[tier], self._due[tier]
            if deadline is None:
                due.clear()
                continue
            while due:
                request = due[0][2]
                preempted = int(getattr(request, "num_preemptions", 0) or 0)
                if self._where.get(request.request_id) != tier or preempted:
                    heapq.heappop(due)  # admitted, removed or moved: not waiting here
                    continue
                waited = now - self.waited_since(request)
                if waited < deadline:
                    break
                heapq.heappop(due)
                abort = wants_abort(request)
                if abort or tier < 2:
                    expired.append(Expired(request, tier, waited, abort))
        if not expired:
            return expired
        self._remove({e.request for e in expired})
        for e in expired:
            if not e.aborted:
                self._push(e.request, e.tier + 1, register=True)
        return expired

    # -- RequestQueue --------------------------------------------------------

    def _push(self, request: Any, tier: int, register: bool) -> None:
        tokens = max(0, int(request.num_tokens) - int(request.num_computed_tokens))
        heapq.heappush(
            self._heaps[tier],
            (request.priority, request.arrival_time, next(self._seq), request, tokens),
        )
        self._tokens[tier] += tokens
        self._where[request.request_id] = tier
        if register and self.config.deadlines[tier] is not None:
            heapq.heappush(self._due[tier], (request.arrival_time, next(self._seq), request))

    def add_request(self, request: Any) -> None:
        tier = self.config.tier_of(request.num_prompt_tokens)
        self._push(request, tier, register=not getattr(request, "num_preemptions", 0))

    def pop_request(self) -> Any:
        # vLLM pops the request it peeked at, after scheduling its chunk (which
        # may have spent its tier's share): that one, not a new choice.
        peeked, self.peeked = self.peeked, None
        if (
            peeked is not None
            and self._heaps[peeked[1]]
            and self._heaps[peeked[1]][0][3] is peeked[0]
        ):
            chosen: tuple[int, Any] | None = (peeked[1], self._heaps[peeked[1]][0])
        else:
            chosen = self._choose()
        if chosen is None:
            # vLLM pops only after a peek or a truthy check; keep it total anyway.
            chosen = next(((t, h[0]) for t, h in enumerate(self._heaps) if h), None)
            if chosen is None:
                raise IndexError("pop from an empty queue")
        tier, _ = chosen
        entry = heapq.heappop(self._heaps[tier])
        request = entry[3]
        self._tokens[tier] -= entry[4]
        self._where.pop(request.request_id, None)
        if self._drr:  # a deficit counter: a borrowing tier does not go below 0
            self._credit[tier] = max(0.0, self._credit[tier] - entry[4])
        if self._running is not None:
            self._running[tier] += 1  # admitted (or skipped: corrected when prepended)
            self._popped[request.request_id] = tier
        return request

    def peek_request(self) -> Any:
        chosen = self._choose()
        if chosen is None:
            raise IndexError("peek from an empty queue")
        request = chosen[1][3]
        self.peeked = (request, chosen[0])
        return request

    def prepend_request(self, request: Any) -> None:
        # Order is by (priority, tier, arrival): a preempted or skipped request
        # keeps its arrival time, so it goes back ahead of later ones; a skipped
        # one goes back to the tier it was taken from (a demoted one stays so).
        tier = self._popped.pop(request.request_id, None) if self._running is not None else None
        if tier is not None:
            self._running[tier] -= 1  # type: ignore[index]
            if self._drr:
                self._credit[tier] += max(0, request.num_tokens - request.num_computed_tokens)
            self._push(request, tier, register=False)  # its deadline entry is still there
        else:
            self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Any) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Any]) -> None:
        self._remove(requests if isinstance(requests, set) else set(requests))

    def _remove(self, gone: set[Any]) -> None:
        for tier, heap in enumerate(self._heaps):
            kept = [e for e in heap if e[3] not in gone]
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heaps[tier][:] = kept
                self._tokens[tier] = sum(e[4] for e in kept)
        for request in gone:
            self._where.pop(request.request_id, None)

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
