"""The engine autopilot: max_num_seqs adjusted between steps so that requests
are not preempted while the KV cache runs close to a target usage.

vLLM V1 sizes its KV cache at start; when the running sequences outgrow it,
the scheduler preempts (frees a request's blocks and recomputes it later).
How many sequences fit depends on their lengths, which move with the
workload, so no fixed max_num_seqs stays right. The controller, fed once per
scheduler step with plain numbers (`observe`), keeps the admission limit
where the cache's peak usage sits in a band [target, high]:

- down, at once, on a preemption while the current limit is in effect:
  to ⌊0.8 × the sequences that were running⌋; right after a climb (a failed
  probe) just back to the limit before it, and no climb above that limit for
  `HOLD_EPOCHS` epochs;
- down, at an epoch's end, when the epoch's peak usage exceeded `high`:
  proportionally, to ⌊limit × target / peak⌋ (at least one less);
- up, at an epoch's end, only after a whole epoch without a preemption in
  which requests waited while the limit was full and the peak stayed below
  `target`: half the way (rounded up) to limit × target / peak, the limit at
  which the peak would reach the target if usage scales with sequences;
  nothing when that is less than one sequence away (the dead band).

An epoch is one request lifetime in steps (an average over finished
requests): a change shows its full effect on the cache only once the
requests admitted under it have grown to their full length. Why this is
stable is in docs/autopilot.md.

The controller only decides; the collector applies its decision through the
bounded live-change path (control.py) at the start of the next schedule(),
never above the startup value and never above the token budget (the budget's
floor follows max_num_seqs, so the autopilot never moves the budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TARGET = 0.9
BAND = 0.05  # high = min(1, target + BAND)
CUT_FACTOR = 0.8
HOLD_EPOCHS = 4
MIN_EPOCH_STEPS = 16
MAX_EPOCH_STEPS = 4096
INITIAL_EPOCH_STEPS = 64
LIFETIME_EMA = 0.1  # weight of one finished request in the lifetime average


def parse_target(value: object) -> float:
    """A target peak KV usage in (0, 1]; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"autopilot_target must be a number in (0, 1], got {value!r}")
    try:
        target = float(value)
    except ValueError:
        raise ValueError(f"autopilot_target must be a number in (0, 1], got {value!r}") from None
    if not 0.0 < target <= 1.0:  # also rejects NaN
        raise ValueError(f"autopilot_target must be in (0, 1], got {value!r}")
    return target


ADVISORY = "advisory"


def parse_mode(value: object) -> tuple[bool, bool]:
    """VLLM_RUNBOOK_AUTOPILOT: on/off (as `parse_switch`) or advisory →
    (on, advisory); ValueError otherwise."""
    if str(value).strip().lower() == ADVISORY:
        return False, True
    return parse_switch(value), False


def parse_switch(value: object) -> bool:
    """on/off (also true/false, 1/0) → bool; ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"autopilot must be on or off, got {value!r}")


@dataclass(frozen=True)
class Decision:
    limit: int
    reason: str  # "preemption", "failed probe", "peak over target", "room"


class Autopilot:
    """The controller's state; see the module docstring. Engine thread only,
    except `snapshot()` (single attribute reads)."""

    def __init__(self, target: float = DEFAULT_TARGET) -> None:
        self.enabled = False
        # Advisory mode: observes and decides as if on, applies nothing; `limit`
        # is the max_num_seqs it would have set (exported, never applied).
        self.advisory = False
        self.target = target
        self.error: str | None = None
        self.epoch_steps = float(INITIAL_EPOCH_STEPS)
        self.limit = 0
        # The decision the collector applies before the next step, if any.
        self.pending: Decision | None = None
        self.last: Decision | None = None
        self.last_change_step = 0
        self.changes_up = 0
        self.changes_down = 0
        self._reset_epoch(0, 0.0)
        self._draining = False
        self._probe_from: int | None = None  # limit before the latest climb
        self._hold_ceiling = 0
        self._hold_until = -1
        # Told after it starts observing or decides (the hook's slow path).
        self.wake: Callable[[], None] = lambda: None

    @property
    def high(self) -> float:
        return min(1.0, self.target + BAND)

    @property
    def observing(self) -> bool:
        """Fed every step: while on, or advising."""
        return self.enabled or self.advisory

    def advise(self, limit: int, step: int) -> None:
        """Advisory mode from `limit` (the max_num_seqs in force): decide, apply nothing."""
        self.enable(limit, step)
        self.enabled, self.advisory = False, True
        self.wake()

    def enable(self, limit: int, step: int) -> None:
        self.enabled = True
        self.advisory = False  # switched on: it acts from now on
        self.error = None
        self.limit = limit
        self.pending = None
        # Until the first step shows the limit in effect (no more running than
        # it admits: a cap just before the hand-over may still be draining),
        # a preemption is the old limit's, not this one's.
        self._draining = True
        self._probe_from = None
        self._hold_until = -1
        self.last_change_step = step
        self._reset_epoch(step, 0.0)
        self.wake()

    def disable(self) -> None:
        self.enabled = self.advisory = False
        self.pending = None

    def set_target(self, target: float, step: int) -> None:
        self.target = target
        self._hold_until = -1
        self._reset_epoch(step, 0.0)

    def _reset_epoch(self, step: int, usage: float) -> None:
        self.epoch_start = step
        self.epoch_peak = usage
        self.epoch_preempted = False
        self.epoch_waited = False

    def on_request_finished(self, num_output_tokens: int, prefill_steps: int) -> None:
        """A request's lifetime in steps: one per output token plus its prefill."""
        lifetime = num_output_tokens + prefill_steps
        self.epoch_steps += LIFETIME_EMA * (lifetime - self.epoch_steps)

    def epoch_length(self) -> int:
        return int(min(MAX_EPOCH_STEPS, max(MIN_EPOCH_STEPS, self.epoch_steps)))

    def observe(
        self,
        step: int,
        limit: int,
        ceiling: int,
        running: int,
        waiting: int,
        preempted: int,
        kv_usage: float,
    ) -> Decision | None:
        """One step's numbers (after schedule()): `limit` the admission limit in
        force, `ceiling` the highest the autopilot may set, `running` and
        `waiting` the queue lengths, `preempted` this step's preemptions,
        `kv_usage` the usage at the step's start. Returns (and keeps in
        `pending`) a new limit, or None."""
        if limit != self.limit:  # changed by someone else meanwhile (a restore)
            self.limit = limit
            self._probe_from = None
        if kv_usage > self.epoch_peak:
            self.epoch_peak = kv_usage
        if waiting and running >= limit:
            self.epoch_waited = True
        if self._draining and running <= limit:
            self._draining = False
        if preempted:
            self.epoch_preempted = True
            if not self._draining:
                return self._decrease_on_preemption(step, limit, running + preempted)
            return None
        if step - self.epoch_start < self.epoch_length():
            return None
        decision = self._at_epoch_end(step, limit, ceiling)
        self._reset_epoch(step, kv_usage)
        return decision

    def _decrease_on_preemption(self, step: int, limit: int, was_running: int) -> Decision | None:
        if self._probe_from is not None and self._probe_from < limit:
            # The latest climb did not fit: back to where it came from, and stay.
            new, reason = self._probe_from, "failed probe"
            self._hold_ceiling, self._hold_until = new, step + HOLD_EPOCHS * self.epoch_length()
        else:
            new, reason = math.floor(CUT_FACTOR * min(was_running, limit)), "preemption"
        new = max(1, min(new, limit - 1))
        if new >= limit:
            return None  # already at 1
        return self._decide(step, new, reason, down=True)

    def _at_epoch_end(self, step: int, limit: int, ceiling: int) -> Decision | None:
        if self.epoch_preempted or self._draining:
            return None
        peak = self.epoch_peak
        if peak > self.high and limit > 1:
            new = max(1, min(limit - 1, math.floor(limit * self.target / peak)))
            return self._decide(step, new, "peak over target", down=True)
        if not self.epoch_waited or peak >= self.target:
            return None  # nobody waits for room, or the band is reached: hold
        if step < self._hold_until:
            ceiling = min(ceiling, self._hold_ceiling)
        if limit >= ceiling:
            return None
        estimate = limit * self.target / max(peak, 0.01)
        gap = estimate - limit
        if gap < 1.0:
            return None  # the dead band: within one sequence of the target
        new = min(ceiling, limit + math.ceil(gap / 2))
        decision = self._decide(step, new, "room", down=False)
        self._probe_from = limit
        return decision

    def _decide(self, step: int, new: int, reason: str, down: bool) -> Decision:
        decision = Decision(new, reason)
        self.pending = self.last = decision
        self.wake()
        self.last_change_step = step
        if down:
            self.changes_down += 1
            self._draining = True
            self._probe_from = None
        else:
            self.changes_up += 1
        self.limit = new
        return decision

    def snapshot(self) -> dict[str, object]:
        last = self.last
        return {
            "enabled": self.enabled,
            "advisory": self.advisory,
            "target": self.target,
            "high": self.high,
            "limit": self.limit if self.observing else None,
            "epoch_steps": self.epoch_length(),
            "epoch_peak_kv_usage": self.epoch_peak,
            "changes": {"up": self.changes_up, "down": self.changes_down},
            "last_change": None
            if last is None
            else {"step": self.last_change_step, "max_num_seqs": last.limit, "reason": last.reason},
            "error": self.error,
        }
