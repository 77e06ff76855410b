"""What the demo shows as it happens: the service's events (EventFeed), one
line of engine signals a second (Monitor), both through the console (Demo)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.runbooks.demo.config import LOW
from vllm_runbook.runbooks.demo.traffic import QueueReading, Traffic
from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError
from vllm_runbook.runbooks.run.render import (
    format_check,
    format_guards,
    format_verification,
)
from vllm_runbook.runbooks.service.api import Execution, Executions, Incidents
from vllm_runbook.runbooks.store.models import ACTIVE_STATUSES, HOLDING, ExecutionStatus


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "n/a" if value is None else str(value)


class EventFeed:
    """Polls the service's API and prints each new incident state and execution event.
    `executions`: every execution seen, by id, as /api/executions last answered it."""

    def __init__(self, service: str, out: Callable[[str], None]) -> None:
        self.service = service
        self.out = out
        self.printed: set[tuple[int, str]] = set()  # (incident id, state) already shown
        self.fired: set[str] = set()  # alerts seen firing (or resolved: they fired before)
        self.executions: dict[int, Execution] = {}
        self.seen: set[tuple[Any, ...]] = set()

    def start(self) -> EventFeed:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.poll()  # the last events

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            # Executions first: every execution seen then has its finding
            # already recorded as firing in the incidents read after it.
            answer = httpx.get(self.service + "/api/executions?limit=200", timeout=5)
            executions = Executions.model_validate_json(answer.content).root
            answer = httpx.get(self.service + "/api/incidents", timeout=5)
            incidents = Incidents.model_validate_json(answer.content).root
        except (httpx.HTTPError, ValueError):  # a ValidationError (not its model) is a ValueError
            return
        for inc in sorted(incidents, key=lambda i: i.id):
            # A pending finding that clears is discarded; a resolved one fired
            # first, even if it fired and resolved between two polls.
            states = {"firing": ["firing"], "resolved": ["firing", "resolved"]}
            for state in states.get(inc.state, []):
                if (inc.id, state) in self.printed:
                    continue
                self.printed.add((inc.id, state))
                self.fired.add(inc.alert)
                verb = "fired" if state == "firing" else "resolved"
                self.out(
                    f"finding {inc.alert} {verb} on {inc.engine} "
                    f"(value {_fmt(inc.value)}, {inc.severity})"
                )
        for e in sorted(executions, key=lambda e: e.id):
            self.executions[e.id] = e
            self._execution(e)

    def _once(self, key: tuple[Any, ...], line: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.out(line)

    def _execution(self, e: Execution) -> None:
        n = e.id
        if e.reverts_id is not None:
            self._once((n, "new"), f"  revert #{n} of #{e.reverts_id}: {e.reason or ''}")
        else:
            alert = e.who.removeprefix("rules:")
            self._once(
                (n, "new"),
                f"  runbook {e.runbook} chosen for {alert} (automation auto) → execution #{n}",
            )
        if e.checks and e.reverts_id is None:
            checks = ", ".join(f"{k} {format_check(v)}" for k, v in e.checks.items())
            self._once((n, "checks"), f"  #{n} checks: {checks}")
        for s in e.steps:
            before, after = s.before or {}, s.after or {}
            if s.status == "skipped":
                note = s.params.get("note", "")
                self._once((n, s.id, "skip"), f"  #{n} {s.action}: skipped, {note}")
            elif s.status in ("applying", "applied", "reverted") and before:
                self._once(
                    (n, s.id, "before"),
                    f"  #{n} action {s.action}: before "
                    + ", ".join(f"{k}={_fmt(v)}" for k, v in before.items()),
                )
            if s.status in ("applied", "reverted") and after:
                where = f" (engine step {s.applied_at_step})" if s.applied_at_step else ""
                self._once(
                    (n, s.id, "after"),
                    f"  #{n} action {s.action}: after "
                    + ", ".join(f"{k}={_fmt(v)}" for k, v in after.items())
                    + where,
                )
        v = e.verification
        if v:
            self._once(
                (n, "verify"),
                f"  #{n} verification: {format_verification(v, parenthesized=True)}"
                + (f"; guards: {g}" if (g := format_guards(v)) else ""),
            )
        if e.display_status == HOLDING:
            # What it waits on, each time that changes (the cause, the hold, a person).
            self._once((n, "holding", e.hold_note), f"  #{n} holding: {e.hold_note}")
        elif e.status not in ACTIVE_STATUSES:
            why = e.error or e.reason or ""
            self._once((n, e.status), f"  #{n} {e.status}" + (f": {why}" if why else ""))
        if e.premature:
            self._once((n, "premature"), f"  #{n} premature: {e.reason}")


@dataclass
class Demo:
    directory: Path
    ci: bool
    deadline: float
    print_lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.time)

    def say(self, line: str, *, event: bool = False) -> None:
        stamp = f"{time.time() - self.started:5.0f}s "
        if event and not self.ci:
            line = f"\033[1;36m{line}\033[0m"
        with self.print_lock:
            print(stamp + line, flush=True)

    def phase_banner(self, name: str, what: str) -> None:
        line = f"── {name}: {what}"
        if not self.ci:
            line = f"\033[1m{line}\033[0m"
        self.say(line)

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Monitor:
    """One line of signals per second, the service's events, and the signal history."""

    def __init__(self, demo: Demo, client: EngineClient, traffic: Traffic, feed: EventFeed) -> None:
        self.demo, self.client, self.traffic, self.feed = demo, client, traffic, feed
        self.state: AgentState | None = None
        self.state_t = 0.0  # when `state` was read (time.time())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._last_preemptions: float | None = None

    def start(self) -> Monitor:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def queue(self) -> QueueReading | None:
        """The engine's admission limit and waiting queue from the latest state."""
        state, t = self.state, self.state_t
        if state is None:
            return None
        # The queues are read live (under the scheduler's lock); the stats at the last step.
        waiting = state.stats.requests_waiting if state.queues is None else state.queues.waiting
        return QueueReading(t, state.knobs.max_num_seqs, waiting)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop.is_set():
            # One line a second; after a stall (a busy machine) carry on, don't catch up.
            next_tick = max(next_tick + 1.0, time.monotonic())
            with contextlib.suppress(EngineClientError):
                self._sample()
            self.stop.wait(max(0.0, next_tick - time.monotonic()))

    def _sample(self) -> None:
        asked = time.time()
        state = self.client.state()
        now = time.time()
        self.state, self.state_t = state, now
        s, k = state.stats, state.knobs
        flying = self.traffic.in_flight()
        oldest = max((now - r.t0 for r in flying), default=0.0)
        oldest_low = max((now - r.t0 for r in flying if r.priority == LOW), default=0.0)
        rps = self.traffic.completed_since(now - 5) / 5
        preemptions = s.preemptions_total
        delta = 0.0 if self._last_preemptions is None else preemptions - self._last_preemptions
        self._last_preemptions = preemptions
        sample = {
            "t": now,
            "engine": self.client.url,
            "phase": self.traffic.phase,
            "rps": rps,
            "kv_hit_ratio": s.kv_hit_ratio,
            "block_fragmentation": s.block_fragmentation,
            "kv_cache_usage": s.kv_cache_usage,
            "preemptions": preemptions,
            "requests_running": s.requests_running,
            "requests_waiting": s.requests_waiting,
            "max_num_batched_tokens": k.max_num_batched_tokens,
            "max_num_seqs": k.max_num_seqs,
            "policy": k.policy,
            "oldest_request_s": oldest,
            "oldest_low_priority_s": oldest_low,
            "state_s": now - asked,  # how long the agent took to answer
        }
        self.traffic.log.write("sample", **sample)
        self.demo.say(
            f"{self.traffic.phase:<11} {rps:5.1f} req/s  hit {_pct(s.kv_hit_ratio):>4}  "
            f"frag {_pct(s.block_fragmentation, 1):>5}  "
            f"KV {_pct(s.kv_cache_usage):>4}  "
            f"preempt {preemptions:4.0f} (+{delta:.0f})  "
            f"run {s.requests_running:3.0f} "
            f"wait {s.requests_waiting:3.0f}  "
            f"budget {k.max_num_batched_tokens:4d}  seqs {k.max_num_seqs:3d}  "
            f"{k.policy}"
        )


class PhaseMeasure:
    """The peak KV usage and the preemptions a phase saw, from the monitor's
    samples (for the message when the phase's finding never fires)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.started = time.monotonic()
        self.peak_kv: float | None = None
        self.first_preemptions: float | None = None
        self.last_preemptions: float | None = None

    def update(self) -> None:
        state = self.monitor.state
        if state is None:
            return
        kv, preemptions = state.stats.kv_cache_usage, state.stats.preemptions_total
        if kv is not None:
            self.peak_kv = kv if self.peak_kv is None else max(self.peak_kv, kv)
        if preemptions is not None:
            if self.first_preemptions is None:
                self.first_preemptions = preemptions
            self.last_preemptions = preemptions

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def __str__(self) -> str:
        first, last = self.first_preemptions, self.last_preemptions
        preempted = "n/a" if first is None or last is None else f"{last - first:.0f}"
        return f"{preempted} preemptions, peak KV usage {_pct(self.peak_kv)}"


def _pct(value: Any, digits: int = 0) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def runs_of(feed: EventFeed, runbook: str) -> list[Execution]:
    """The runbook's executions that ran (not reverts, not refused)."""
    return [
        e
        for e in feed.executions.values()
        if e.runbook == runbook and e.reverts_id is None and e.status != ExecutionStatus.REFUSED
    ]


def finished(e: Execution) -> bool:
    return e.status not in ACTIVE_STATUSES


# latency-spike's `until`: the cause holds while a request waits this long.
CAUSE_WAIT_S = 2.0


class StreamAfterFix:
    """What the demo sees while the high-priority stream outlasts the FCFS
    switch: whether the execution holds (its finding resolved, its cause
    not) and whether the policy stayed FCFS all along."""

    def __init__(self, monitor: Monitor, feed: EventFeed, execution_id: int | None) -> None:
        self.monitor, self.feed, self.id = monitor, feed, execution_id
        self.started = time.monotonic()
        self.holding_since: float | None = None
        self._last_t = 0.0
        self.reverted = False  # the hold released it while the stream was on
        self.readings = 0
        # Readings of another policy while the cause held (a request waiting
        # over the runbook's 2 s for its first schedule): a flip the hold forbids.
        self.not_fcfs = 0
        # Readings where the engine's queue had drained anyway (the client could
        # not keep the stream up): the cause gone, a revert then is right.
        self.drained = 0
        self.note: str | None = None

    def update(self) -> float:
        """Seconds the execution has been seen holding (0 before)."""
        e = self.feed.executions.get(self.id) if self.id is not None else None
        if e is not None and e.status == ExecutionStatus.REVERTED:
            # The hold released it (its cause gone): what follows is not judged here.
            self.reverted = True
        state, t = self.monitor.state, self.monitor.state_t
        if state is not None and t > self._last_t and not self.reverted:
            self._last_t = t
            self.readings += 1
            cause = state.stats.oldest_waiting >= CAUSE_WAIT_S
            if not cause:
                self.drained += 1
            elif state.knobs.policy != "fcfs":
                if self.drained:
                    # The queue drained at an earlier reading (the cause gone): the
                    # hold's revert, read before the feed shows it (the queue may
                    # build again behind the reverted policy).
                    self.reverted = True
                else:
                    self.not_fcfs += 1
        if e is not None and e.display_status == HOLDING:
            self.note = e.hold_note
            if self.holding_since is None:
                self.holding_since = time.monotonic()
        if self.holding_since is None:
            return 0.0
        return time.monotonic() - self.holding_since

    def said(self, bound_s: float) -> str:
        lasted = time.monotonic() - self.started
        policy = (
            "the policy stayed fcfs at every reading while the cause held"
            if not self.not_fcfs
            else f"the policy was not fcfs at {self.not_fcfs} of {self.readings} readings "
            "while the cause held"
        )
        if self.drained:
            policy += (
                f"; the engine's queue drained at {self.drained} of {self.readings} readings "
                "(the client did not keep the stream up)"
            )
        if self.holding_since is None:
            return (
                f"#{self.id} was not seen holding in {lasted:.0f} s of stream (bound "
                f"{bound_s:.0f} s): its finding did not resolve while the stream lasted; {policy}"
            )
        held = time.monotonic() - self.holding_since
        return (
            f"stream after the switch: {lasted:.0f} s; #{self.id} held for {held:.0f} s of it "
            f"({self.note}); {policy}"
            + ("; reverted once the cause was gone" if self.reverted else "")
        )
