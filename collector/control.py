"""Live engine control: change the token budget, the admission limit and the
scheduling policy of a running scheduler, safely.

Rules (the agent's bounds in docs/install.md, "The agent endpoint"; the autopilot's in
docs/autopilot.md):
- never above the startup value (model-runner buffers, cudagraph sizes and
  compile ranges were sized from it);
- floors: the budget stays ≥ max_model_len without chunked prefill, ≥ the
  largest multimodal item when mm chunking is off, above the speculative
  draft slots, ≥ the admission limit (every admitted sequence can decode in
  one step), and ≥ 1; max_num_seqs ≥ 1;
- the autopilot (autopilot.py) is switched here like a knob; its own
  changes of max_num_seqs go through `apply_autopilot`, within the same
  bounds, and never above the token budget (whose floor it would move);
  a command that sets max_num_seqs by hand turns the autopilot off;
- mutate only between schedule() calls: commands are queued and applied in
  arrival order by whoever holds the scheduler lock first — the engine thread
  at the start of schedule(), or the HTTP thread when the engine is idle.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import (
    KNOBS,
    ChangeResult,
    KnobsCommand,
    RestoreCommand,
    command_error,
    knob_target,
)
from vllm_runbook.collector.autopilot import Autopilot
from vllm_runbook.collector.exporter import Sample
from vllm_runbook.collector.tiers import (
    Expired,
    TierConfig,
    TieredRequestQueue,
    prefill_chunk_cap,
    prefills_running,
    running_demand,
    tier_quotas,
    tiers_of,
)

POLICIES = M.POLICIES


class ControlError(Exception):
    """A command the agent refuses; `status` is the HTTP status to answer."""

    status = 400

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


class BoundsError(ControlError):
    status = 422


class EngineBusyError(ControlError):
    status = 504


@dataclass(frozen=True)
class Bound:
    minimum: int
    maximum: int
    min_reason: str
    max_reason: str


@dataclass
class Command:
    """A validated change request. `values` maps knob → requested value."""

    values: dict[str, Any]
    clamp: bool = False
    dry_run: bool = False
    restore: bool = False
    seq: int = 0
    future: Future[dict[str, Any]] = field(default_factory=Future)


def parse_command(body: Any, restore: bool = False) -> Command:
    """Validate a JSON body into a Command (the agent API's KnobsCommand or
    RestoreCommand: types only; bounds at apply time). ControlError (400) with
    one line when it is not one."""
    try:
        if restore:
            command: KnobsCommand | RestoreCommand = RestoreCommand.model_validate(body)
            values: dict[str, Any] = {}
        else:
            command = KnobsCommand.model_validate(body)
            values = command.values()
    except ValidationError as exc:
        raise ControlError(command_error(exc)) from None
    return Command(values, command.clamp, command.dry_run, restore)


class EngineControl:
    """Applies Commands to one scheduler (wired by engine_collector.py)."""

    def __init__(
        self,
        scheduler: Any,
        current_step: Callable[[], int],
        on_applied: Callable[[int], None] | None = None,
        autopilot: Autopilot | None = None,
        tiers: TierConfig | None = None,
        clock: Callable[[], float] = time.time,
        waited_since: Callable[[Any], float] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.autopilot = autopilot or Autopilot()
        # The tiered policy: vLLM's own code sees FCFS (its `policy` enum has
        # no other value to take); our queue does the ordering and limits.
        self.tiers = tiers or TierConfig()
        self.tiered = False
        self.clock = clock
        self.waited_since = waited_since or (lambda request: request.arrival_time)
        self.current_step = current_step
        # Told the first step of every change applied (verification measures from it).
        self.on_applied = on_applied
        # The scheduler lock: held by the engine thread around schedule(),
        # update_from_output(), add_request() and finish_requests(), and by
        # whoever applies commands.
        self.lock = threading.RLock()
        self.pending: deque[Command] = deque()
        self._seq = itertools.count(1)
        self._queue_lock = threading.Lock()
        # Own copy of scheduler_config: a runtime change must not leak into
        # the process-wide VllmConfig other components read.
        scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)
        self.startup = self.knobs()
        config = scheduler.scheduler_config
        self.chunked_prefill = bool(config.enable_chunked_prefill)
        self.max_model_len = int(scheduler.max_model_len)
        spec = scheduler.vllm_config.speculative_config
        self.draft_slots = int(spec.max_num_new_slots_for_drafting) if spec is not None else 0
        mm_chunking_off = bool(getattr(config, "disable_chunked_mm_input", False))
        encoder_tokens = int(getattr(scheduler, "max_num_encoder_input_tokens", 0) or 0)
        self.mm_item_floor = encoder_tokens if mm_chunking_off else 0
        self.long_prefill_threshold = int(getattr(config, "long_prefill_token_threshold", 0) or 0)
        # The tiers' shares with chunked prefill: vLLM passes every request it
        # schedules, with its chunk, through `_reserve_prefill_lookahead`
        # (vLLM >= 0.32); where it lacks the method, the per-step chunk limit
        # (long_prefill_token_threshold) gives the hot tier its share only.
        reserve = getattr(type(scheduler), "_reserve_prefill_lookahead", None)
        self._reserve: Callable[[Any, int, int], int] | None = (
            (lambda r, c, n: reserve(scheduler, r, c, n)) if callable(reserve) else None
        )
        self._ledger: list[int] | None = None  # tokens each tier has left this step
        self._charging = False  # the override is on the scheduler instance
        self._step_error: BaseException | None = None
        # Deadlines: counted per tier; aborts' outputs wait for update_from_output.
        self.deadline_demotions = [0, 0, 0]
        self.deadline_aborts = [0, 0, 0]
        self.abort_outputs: dict[int, list[Any]] = {}
        # Told after a command is queued, the policy switched or an abort
        # queued (the hook's slow path: the engine thread reads them then).
        self.wake: Callable[[], None] = lambda: None

    def start_with_policy(self, policy_name: str) -> None:
        """The policy configured at engine start (before any request): it is
        also the startup value a restore returns to."""
        if policy_name not in POLICIES:
            raise ControlError(f"policy must be one of {', '.join(POLICIES)}, got {policy_name!r}")
        with self.lock:
            if policy_name != self.knobs()["policy"]:
                self._switch_policy(policy_name)
            self.startup["policy"] = policy_name

    # -- the tiered policy, per step (engine thread, under the lock) ----------

    def begin_tiered_step(self) -> None:
        """Before schedule(): act on the requests past their tier's deadline,
        tell the queues the running requests per tier, and, while more than
        one tier has work, give each tier its share of this step's budget
        (`tier_quotas`): with chunked prefill every chunk is cut to what its
        tier has left (`_charge`), without it the queues admit whole prompts
        by deficit round robin."""
        s = self.scheduler
        tiers = self.tiers
        running_requests = s.running
        running_tiers = list(tiers_of(tiers.boundaries, running_requests))
        running = [running_tiers.count(0), running_tiers.count(1), running_tiers.count(2)]
        max_active = int(s.max_num_active_reqs)
        limits = tiers.limits_for(max_active)
        now = self.clock()
        waiting, holding = s.waiting, s.kv_holding_waiting
        if tiers.deadlines != (None, None, None):
            expired = waiting.expire(now) + holding.expire(now)
            if expired:
                self._on_expired(expired)
        waiting.begin_step(now, running, limits, max_active)
        holding.begin_step(now, running, limits, max_active)
        budget = int(s.max_num_scheduled_tokens)
        queued = [
            a + b for a, b in zip(waiting.demand(budget), holding.demand(budget), strict=True)
        ]
        quotas: list[int] | None = None
        if sum(1 for t in range(3) if queued[t] or running[t]) > 1:
            busy = running_demand(running_tiers, running_requests)
            if self.chunked_prefill:
                demand = [b + q for b, q in zip(busy, queued, strict=True)]
                quotas = tier_quotas(budget, tiers.shares, demand)
            else:  # running requests only decode: the prompts share what they leave
                quotas = tier_quotas(max(0, budget - sum(busy)), tiers.shares, queued)
            if sum(1 for q in quotas if q) < 2:
                quotas = None
        if self.chunked_prefill and self._reserve is None:
            self._hot_reserve(running, queued)  # older vLLM: the per-step chunk limit
            quotas = None
        waiting.set_quotas(quotas, self.chunked_prefill)
        holding.set_quotas(quotas, self.chunked_prefill)
        if quotas is not None and self.chunked_prefill:
            self._ledger = quotas
            # An instance attribute for this step only: fcfs, priority and the
            # steps where one tier has all the work pay nothing.
            s._reserve_prefill_lookahead = self._charge
            self._charging = True

    def _hot_reserve(self, running: list[int], queued: list[int]) -> None:
        """Where vLLM has no per-request hook: cap this step's prefill chunks
        while the hot tier has work: to the budget minus the hot tier's share
        while hot requests wait, to the budget minus one token per hot request
        while they only decode; split between the running prefills."""
        s = self.scheduler
        tiers = self.tiers
        user = self.long_prefill_threshold
        threshold = user
        budget = int(s.max_num_scheduled_tokens)
        cap = 0
        if queued[0] or running[0]:
            if queued[0]:
                active = [q > 0 or r > 0 for q, r in zip(queued, running, strict=True)]
                cap = prefill_chunk_cap(budget, tiers.shares, active, tiers.boundaries[0])
            else:
                cap = max(1, budget - running[0])
            cap = max(1, cap // max(1, prefills_running(s.running)))
        if cap:
            threshold = min(cap, user) if user else cap
        s.scheduler_config.long_prefill_token_threshold = threshold

    def _charge(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's `_reserve_prefill_lookahead` while the shares apply: a prefill
        chunk is cut to what its tier has left of this step's quota (0: a
        running prefill waits a step; the queues offer no request of a tier
        with nothing left); a decode is counted, never withheld. Never raises
        into vLLM: a failure is kept for end_tiered_step and the chunk is
        vLLM's own."""
        reserve = self._reserve
        assert reserve is not None
        try:
            ledger = self._ledger
            if ledger is None:
                return reserve(request, num_computed_tokens, num_new_tokens)
            tier = self._tier_of_scheduled(request)
            room = ledger[tier]
            s = self.scheduler
            if (
                num_new_tokens > room
                and request.num_tokens - num_computed_tokens > 1  # a prefill, not a decode
                and not request.has_encoder_inputs  # its encoder inputs were fitted to the chunk
                and not getattr(s, "need_mamba_block_aligned_split", False)
            ):
                num_new_tokens = max(0, room)
            granted = reserve(request, num_computed_tokens, num_new_tokens)
            ledger[tier] = room - granted
            return granted
        except Exception as exc:
            if self._step_error is None:
                self._step_error = exc
            self._ledger = None
            return reserve(request, num_computed_tokens, num_new_tokens)

    def _tier_of_scheduled(self, request: Any) -> int:
        """The tier a request vLLM is scheduling is charged to: the queue's tier
        for the one being admitted (a demoted request's lower tier), the tier
        of its prompt length for a running one."""
        s = self.scheduler
        for queue in (s.waiting, s.kv_holding_waiting):
            peeked = queue.peeked
            if peeked is not None and peeked[0] is request:
                return int(peeked[1])
        return self.tiers.tier_of(request.num_prompt_tokens)

    def end_tiered_step(self) -> None:
        s = self.scheduler
        if self._charging:
            self._charging = False
            s.__dict__.pop("_reserve_prefill_lookahead", None)
        self._ledger = None
        s.waiting.end_step()
        s.kv_holding_waiting.end_step()
        if self._step_error is not None:
            error, self._step_error = self._step_error, None
            raise error

    # -- deadlines (engine thread, under the lock) --------------------------

    def _on_expired(self, expired: list[Expired]) -> None:
        """Count the demotions; abort the requests whose client asked, with
        the reason in the output's stop_reason (delivered by `deliver_aborts`
        at the step's update_from_output)."""
        aborted = []
        for e in expired:
            if e.aborted:
                self.deadline_aborts[e.tier] += 1
                aborted.append(e)
            else:
                self.deadline_demotions[e.tier] += 1
        if not aborted:
            return
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        s = self.scheduler
        finished = {
            r.request_id
            for r in s.finish_requests(
                [e.request.request_id for e in aborted], RequestStatus.FINISHED_ABORTED
            )
        }
        deadlines = self.tiers.deadlines
        for e in aborted:
            request = e.request
            if request.request_id not in finished:
                continue
            reason = (
                f"vllm-runbook: {M.TIERS[e.tier]} tier deadline {deadlines[e.tier]:g} s passed "
                f"({e.waited:.3f} s waiting for a first schedule); aborted as the request asked"
            )
            take_events = getattr(request, "take_events", None)
            self.abort_outputs.setdefault(int(getattr(request, "client_index", 0)), []).append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=reason,
                    events=take_events() if take_events is not None else None,
                    trace_headers=getattr(request, "trace_headers", None),
                )
            )
            self.wake()

    def deliver_aborts(self, outputs: dict[int, Any]) -> None:
        """Add the deadline aborts' outputs to what update_from_output returns."""
        from vllm.v1.engine import EngineCoreOutputs

        pending, self.abort_outputs = self.abort_outputs, {}
        for client_index, outs in pending.items():
            current = outputs.get(client_index)
            if current is None:
                outputs[client_index] = EngineCoreOutputs(outputs=outs)
            else:
                current.outputs = [*current.outputs, *outs]

    def _tiered_queue(self) -> TieredRequestQueue:
        return TieredRequestQueue(self.tiers, self.clock, self.waited_since)

    # -- reads ---------------------------------------------------------------

    def knobs(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "max_num_batched_tokens": int(s.max_num_scheduled_tokens),
            "max_num_seqs": int(s.max_num_active_reqs),
            "policy": "tiered" if self.tiered else getattr(s.policy, "value", str(s.policy)),
            "autopilot": self.autopilot.enabled,
            "autopilot_target": self.autopilot.target,
        }

    def samples(self) -> list[Sample]:
        """The knob gauges: effective and startup values, the active policy."""
        knobs, startup = self.knobs(), self.startup
        return [
            Sample(M.MAX_NUM_BATCHED_TOKENS, knobs["max_num_batched_tokens"]),
            Sample(M.MAX_NUM_SEQS, knobs["max_num_seqs"]),
            Sample(M.STARTUP_MAX_NUM_BATCHED_TOKENS, startup["max_num_batched_tokens"]),
            Sample(M.STARTUP_MAX_NUM_SEQS, startup["max_num_seqs"]),
            *(
                Sample(M.SCHEDULER_POLICY, 1.0 if name == knobs["policy"] else 0.0, (name,))
                for name in M.POLICIES
            ),
            *(
                Sample(M.TIER_DEADLINE_DEMOTIONS, n, (t,))
                for t, n in zip(M.TIERS, self.deadline_demotions, strict=True)
            ),
            *(
                Sample(M.TIER_DEADLINE_ABORTS, n, (t,))
                for t, n in zip(M.TIERS, self.deadline_aborts, strict=True)
            ),
        ]

    def autopilot_ceiling(self) -> int:
        """The highest max_num_seqs the autopilot may set: the startup value,
        and the budget now (the budget's floor follows max_num_seqs)."""
        return min(int(self.startup["max_num_seqs"]), int(self.scheduler.max_num_scheduled_tokens))

    def bounds(self, max_num_seqs: int | None = None) -> dict[str, Bound]:
        """Bounds now; the budget's floor depends on the admission limit
        (`max_num_seqs`, the effective one unless a change is being checked)."""
        seqs = self.knobs()["max_num_seqs"] if max_num_seqs is None else max_num_seqs
        floors = [(1, "at least 1 token per step")]
        if not self.chunked_prefill:
            floors.append(
                (
                    self.max_model_len,
                    f"chunked prefill is off: a prompt of max_model_len "
                    f"({self.max_model_len}) must fit in one step",
                )
            )
        if self.mm_item_floor:
            floors.append(
                (
                    self.mm_item_floor,
                    "multimodal chunking is off: the largest multimodal item must fit in one step",
                )
            )
        if self.draft_slots:
            floors.append(
                (
                    self.draft_slots + 1,
                    f"must exceed the {self.draft_slots} speculative draft slots",
                )
            )
        floors.append(
            (
                seqs,
                f"every admitted sequence (max_num_seqs={seqs}) must be able "
                "to decode in one step; lower max_num_seqs first",
            )
        )
        floor, why = max(floors, key=lambda f: f[0])
        startup = self.startup
        above = "raising above the startup value is unsafe (buffers and graphs were sized from it)"
        return {
            "max_num_batched_tokens": Bound(floor, startup["max_num_batched_tokens"], why, above),
            "max_num_seqs": Bound(1, startup["max_num_seqs"], "at least 1 sequence", above),
        }

    # -- commands ------------------------------------------------------------

    def submit(
        self, command: Command, wait_s: float = 30.0, idle: Callable[[], bool] | None = None
    ) -> ChangeResult:
        """Queue `command`; apply it now if the engine is idle, else wait for
        the engine thread to apply it before its next step. The answer's model
        is built here, in the caller's thread, never in the engine's step."""
        with self._queue_lock:
            command.seq = next(self._seq)
            self.pending.append(command)
        self.wake()
        deadline = time.monotonic() + wait_s
        while True:
            # An idle engine calls schedule() no more: apply it ourselves.
            # Re-checked while waiting, in case the engine goes idle meanwhile.
            if idle is None or idle():
                self.drain()
            try:
                return ChangeResult.model_validate(command.future.result(timeout=0.05))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    break
        if command.future.cancel():
            raise EngineBusyError(f"engine did not reach a step boundary in {wait_s:.0f} s")
        # Applied just now after all.
        return ChangeResult.model_validate(command.future.result())

    def drain(self) -> None:
        """Apply every queued command, in order. Engine thread: at the start
        of schedule(); HTTP thread: when the engine is idle."""
        if not self.pending:
            return
        with self.lock:
            while True:
                with self._queue_lock:
                    if not self.pending:
                        return
                    command = self.pending.popleft()
                if not command.future.set_running_or_notify_cancel():
                    continue
                try:
                    command.future.set_result(self._apply(command))
                except BaseException as exc:
                    command.future.set_exception(exc)

    def _target(self, command: Command) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The knob values after `command`, checked against the bounds."""
        if command.restore:
            return dict(self.startup), []
        clamped: list[dict[str, Any]] = []

        def check(knob: str, value: int, target: dict[str, Any], requested: dict[str, Any]) -> int:
            # the budget's floor follows the new max_num_seqs
            seqs = None if knob == "max_num_seqs" else target["max_num_seqs"]
            value, note = self._check(
                knob, value, self.bounds(seqs)[knob], command.clamp, requested
            )
            if note:
                clamped.append(note)
            return value

        return knob_target(self.knobs(), command.values, check), clamped

    @staticmethod
    def _check(
        knob: str, value: int, bound: Bound, clamp: bool, requested: dict[str, Any]
    ) -> tuple[int, dict[str, Any] | None]:
        if bound.minimum <= value <= bound.maximum:
            return value, None
        high = value > bound.maximum
        limit = bound.maximum if high else bound.minimum
        if not clamp:
            # A knob the caller did not touch can only leave its bounds
            # through another knob (the budget floor follows max_num_seqs).
            via = "" if knob in requested else " (implied by the other change)"
            raise BoundsError(
                f"{knob}={value}{via} is {'above' if high else 'below'} "
                f"{'the maximum' if high else 'the minimum'} {limit}: "
                f"{bound.max_reason if high else bound.min_reason}",
                knob=knob,
                value=value,
                bound=limit,
            )
        return limit, {"knob": knob, "requested": value, "applied": limit}

    def _apply(self, command: Command) -> dict[str, Any]:
        before = self.knobs()
        target, clamped = self._target(command)
        changes = [
            {"knob": k, "before": before[k], "after": target[k]}
            for k in KNOBS
            if target[k] != before[k]
        ]
        result = {
            "seq": command.seq,
            "dry_run": command.dry_run,
            "changes": changes,
            "clamped": clamped,
            "before": before,
            "after": target if not command.dry_run else before,
            # The first step scheduled with the new values.
            "effective_from_step": self.current_step() + 1,
        }
        if command.dry_run:
            result["would_be"] = target
            return result
        s = self.scheduler
        if target["max_num_batched_tokens"] != before["max_num_batched_tokens"]:
            # Both fields: schedule() reads the copy made at init and, every
            # step, the config's max_num_batched_tokens.
            s.max_num_scheduled_tokens = target["max_num_batched_tokens"]
            s.scheduler_config.max_num_batched_tokens = target["max_num_batched_tokens"]
        if target["max_num_seqs"] != before["max_num_seqs"]:
            # The admission limit: running requests above it drain, none is
            # preempted. max_num_running_reqs (model-runner slots) stays.
            s.max_num_active_reqs = target["max_num_seqs"]
        if target["policy"] != before["policy"]:
            self._switch_policy(target["policy"])
        if target["autopilot_target"] != before["autopilot_target"]:
            self.autopilot.set_target(target["autopilot_target"], self.current_step())
        if target["autopilot"] != before["autopilot"]:
            if target["autopilot"]:
                self.autopilot.enable(int(s.max_num_active_reqs), self.current_step())
            else:
                self.autopilot.disable()  # the knobs stay where they are
        result["after"] = self.knobs()
        if changes and self.on_applied is not None:
            self.on_applied(self.current_step() + 1)
        return result

    def apply_autopilot(self, limit: int) -> int:
        """The autopilot's own change of max_num_seqs (engine thread, under the
        lock, before schedule()): clamped to 1..autopilot_ceiling(). Not a
        command: no mark, no future; the autopilot counts its changes."""
        limit = max(1, min(int(limit), self.autopilot_ceiling()))
        self.scheduler.max_num_active_reqs = limit
        return limit

    def _switch_policy(self, policy_name: str) -> None:
        from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

        s = self.scheduler
        tiered = policy_name == "tiered"
        policy = SchedulingPolicy.FCFS if tiered else SchedulingPolicy(policy_name)
        for attr in ("waiting", "kv_holding_waiting"):
            old = getattr(s, attr)
            requests = list(old._heap) if hasattr(old, "_heap") else list(old)
            if policy == SchedulingPolicy.FCFS and not tiered:
                # FCFS is arrival order (preempted requests keep their
                # original arrival time, so they stay ahead).
                requests.sort(key=lambda r: (r.arrival_time, r.request_id))
            queue = self._tiered_queue() if tiered else create_request_queue(policy)
            for request in requests:
                queue.add_request(request)
            setattr(s, attr, queue)
        s.policy = policy
        s.scheduler_config.policy = policy.value
        if self.tiered and not tiered:
            s.scheduler_config.long_prefill_token_threshold = self.long_prefill_threshold
        self.tiered = tiered
        self.wake()
