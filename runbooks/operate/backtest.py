"""What the service would have done over a recorded range (`runbook backtest`).

The rules side (vllm_runbook.rules.backtest) replays the catalog over the
range; at every finding this module decides as the service would, on the
recorded series only, deterministically:

- the runbook: the rule's `runbook` label, else the first whose triggers
  name the alert; what the automation section (and `mode`) make of it;
- its checks' values at the firing time, read off the replayed series
  (a signal no series holds, e.g. error_rate, is shown as not recorded);
- the guards, simulated over the timeline: approval, cooldown and max runs
  per hour per (runbook, engine), the blast radius (a run holds its engine
  "under remediation" until its verification's deadline), `acts_only_if`,
  and the circuit breaker: a change is judged `watch` after it over the
  recorded counters (preemptions per finished request, as the breaker does);
  a trip holds later changes of the same knobs on that engine for its
  cooldown;
- the knob changes, computed as the actions compute them from the recorded
  knob values (max_num_seqs, kv capacity, token budget, policy, startup); a
  step's `when:` is read at the firing time, as a dry run shows it.

A counterfactual caveat is said once in the output: the history recorded is
the one without the changes, so what came after a would-be change (its
verification, the breaker's judgement) is read as if it had no effect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_runbook.rules.backtest import Finding, Replay
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.rules.incidents import IncidentEvent
from vllm_runbook.rules.window import EngineKey
from vllm_runbook.runbooks.model.actions import ActionRegistry
from vllm_runbook.runbooks.model.config import BreakerConfig, Config
from vllm_runbook.runbooks.model.spec import Catalog, Runbook
from vllm_runbook.runbooks.run.conditions import describe_condition, holds
from vllm_runbook.runbooks.service.breaker import Measurement, judge

# Read besides each runbook's checks and conditions: the knobs and the breaker's counters.
KNOB_SIGNALS = ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_seqs")
STARTUP = {
    "max_num_seqs": "vllm_runbook_startup_max_num_seqs",
    "max_num_batched_tokens": "vllm_runbook_startup_max_num_batched_tokens",
}
POLICY_SERIES = "vllm_runbook_scheduler_policy"
BREAKER_COUNTERS = ("preemptions", "requests_finished")

WOULD_RUN, WOULD_ASK, ADVISE, NOTIFY, REFUSED, NOTHING, NO_RUNBOOK = (
    "would run",
    "would ask approval",
    "would advise",
    "notify only",
    "refused",
    "nothing to improve",
    "no runbook",
)


@dataclass
class Decision:
    finding: Finding
    runbook: str | None
    decision: str
    reason: str | None = None
    checks: dict[str, float | None] = field(default_factory=dict)
    changes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        f = self.finding
        return {
            "alert": f.alert,
            "severity": f.severity,
            "engine": f.engine_name,
            "labels": f.labels,
            "pending_at": f.pending_at,
            "fired_at": f.fired_at,
            "resolved_at": f.resolved_at,
            "value": f.value,
            "peak": f.peak,
            "runbook": self.runbook,
            "decision": self.decision,
            "reason": self.reason,
            "checks": self.checks,
            "changes": self.changes,
            "notes": self.notes,
        }


@dataclass
class _Run:
    runbook: str
    engine: EngineKey
    at: float
    until: float  # under remediation till then (its verification's deadline)
    knobs: frozenset[str]
    judge_at: float | None  # when the breaker judges it


@dataclass
class Simulator:
    """Decides every finding of a Replay as it happens; `observe` is its observer."""

    replay: Replay
    runbooks: Catalog
    config: Config
    registry: ActionRegistry
    decisions: list[Decision] = field(default_factory=list)
    runs: list[_Run] = field(default_factory=list)
    holds: dict[tuple[EngineKey, str], tuple[float, str]] = field(default_factory=dict)
    trips: list[dict[str, Any]] = field(default_factory=list)
    _decided: int = 0

    @staticmethod
    def signals(runbooks: Catalog) -> set[str]:
        """What a replay must read for the runbooks' checks, conditions and changes."""
        names = set(KNOB_SIGNALS) | set(BREAKER_COUNTERS)
        for spec in runbooks.values():
            names |= {c.signal for c in spec.checks}
            names |= {c.signal for c in spec.acts_only_if}
            names |= {s.when.signal for s in spec.steps if s.when is not None}
        return names

    @staticmethod
    def extra_series() -> list[str]:
        return [*STARTUP.values(), POLICY_SERIES]

    @property
    def breaker(self) -> BreakerConfig:
        return self.config.breaker

    def runbook_of(self, finding: Finding) -> Runbook | None:
        if finding.runbook and finding.runbook in self.runbooks:
            return self.runbooks[finding.runbook]
        found = self.runbooks.for_alert(finding.alert)
        return found[0] if found else None

    # the Replay's observer
    def observe(self, now: float, events: list[IncidentEvent]) -> None:
        self._judge_due(now)
        new = self.replay.findings[self._decided :]
        self._decided = len(self.replay.findings)
        for finding in new:
            self.decisions.append(self.decide(finding, now))

    def _read(self, engine: EngineKey, signal: str, t: float) -> float | None:
        return self.replay.read(engine, signal, t)

    def decide(self, finding: Finding, now: float) -> Decision:
        spec = self.runbook_of(finding)
        if spec is None:
            return Decision(finding, None, NO_RUNBOOK)
        d = Decision(finding, spec.name, WOULD_RUN)
        engine = finding.engine
        d.checks = {c.name: self._read(engine, c.signal, now) for c in spec.checks}
        d.changes, d.notes = self.changes(spec, engine, now)
        mode = self.config.automation.mode(spec.name)
        advisory = spec.name in self.config.advisory({spec.name: spec})
        if mode == "notify":
            d.decision = NOTIFY
            d.reason = f"automation for {spec.name}: notify"
            return d
        refusal = self.refusal(spec, engine, now, d.changes)
        if refusal is not None:
            d.decision, d.reason = refusal
            return d
        if mode == "approve" or spec.guardrails.requires_approval:
            d.decision = WOULD_ASK
        else:
            d.decision = ADVISE if advisory else WOULD_RUN
        if d.decision != ADVISE:
            knobs = frozenset(c["knob"] for c in d.changes)
            deadline = spec.verification.deadline_seconds if spec.verification else 0.0
            judge_at = now + self.breaker.watch_seconds if knobs and self.breaker.enabled else None
            self.runs.append(_Run(spec.name, engine, now, now + deadline, knobs, judge_at))
        return d

    def refusal(
        self, spec: Runbook, engine: EngineKey, now: float, changes: list[dict[str, Any]]
    ) -> tuple[str, str] | None:
        knobs = {c["knob"] for c in changes}
        for knob in sorted(knobs):
            held = self.holds.get((engine, knob))
            if held is not None and now < held[0]:
                left = format_duration(math.ceil(held[0] - now))
                return REFUSED, f"circuit breaker hold on {knob} ({held[1]}); {left} left"
        g = spec.guardrails
        mine = [r for r in self.runs if r.runbook == spec.name and r.engine == engine]
        if mine and g.cooldown_seconds and now < mine[-1].at + g.cooldown_seconds:
            left = format_duration(math.ceil(mine[-1].at + g.cooldown_seconds - now))
            return REFUSED, f"cooldown: {spec.name} ran on this engine; {left} left"
        recent = [r for r in mine if r.at > now - 3600]
        if len(recent) >= g.max_runs_per_hour:
            return REFUSED, f"max runs per hour: {len(recent)} of {g.max_runs_per_hour}"
        others = {r.engine for r in self.runs if r.engine != engine and r.at <= now < r.until}
        if len(others) >= g.max_concurrent_engines:
            return REFUSED, (
                f"blast radius: {len(others)} other engine(s) under remediation "
                f"(at most {g.max_concurrent_engines} at once for {spec.name})"
            )
        for when in spec.acts_only_if:
            value = self._read(engine, when.signal, now)
            if value is None:
                return NOTHING, f"{when.signal} not recorded"
            if not holds(when, value):
                return (
                    NOTHING,
                    f"{when.signal} = {value:g}, acts only if {describe_condition(when)}",
                )
        mutating = [
            s
            for s in spec.steps
            if s.action in self.registry and self.registry.get(s.action).mutating
        ]
        if mutating and all(s.when is None for s in mutating) and not changes:
            return NOTHING, "every step would change nothing"
        return None

    # -- knob changes, as the actions compute them (runbooks/engine/operations.py) --
    def changes(
        self, spec: Runbook, engine: EngineKey, t: float
    ) -> tuple[list[dict[str, Any]], list[str]]:
        out: list[dict[str, Any]] = []
        notes: list[str] = []
        knobs: dict[str, Any] = {k: self._read(engine, k, t) for k in KNOB_SIGNALS}
        knobs["policy"] = self._policy(engine, t)
        for step in spec.steps:
            if step.action not in self.registry or not self.registry.get(step.action).mutating:
                continue
            if step.when is not None:
                value = self._read(engine, step.when.signal, t)
                if value is None or not holds(step.when, value):
                    shown = "not recorded" if value is None else f"{value:g}"
                    notes.append(
                        f"{step.action}: skipped, {describe_condition(step.when)} "
                        f"({step.when.signal} = {shown})"
                    )
                    continue
            change, note = _change(step.action, step.params, knobs, self._startup(engine, t))
            if note:
                notes.append(f"{step.action}: {note}")
            for knob, (before, after) in change.items():
                out.append({"action": step.action, "knob": knob, "before": before, "after": after})
                knobs[knob] = after
        return out, notes

    def _startup(self, engine: EngineKey, t: float) -> dict[str, float | None]:
        return {k: self._raw(engine, name, t) for k, name in STARTUP.items()}

    def _raw(self, engine: EngineKey, name: str, t: float) -> float | None:
        return self.replay.latest(engine, name, t)

    def _policy(self, engine: EngineKey, t: float) -> str | None:
        eng = self.replay.store.engines.get(engine)
        for s in eng.by_name.get(POLICY_SERIES, ()) if eng else ():
            if self.replay.store.latest(s, t) == 1:
                return s.labels.get("policy")
        return None

    # -- the circuit breaker -----------------------------------------------------------
    def _judge_due(self, now: float) -> None:
        for run in self.runs:
            if run.judge_at is None or run.judge_at > now:
                continue
            run.judge_at, watch = None, self.breaker.watch_seconds
            after = self._measure(run.engine, run.at, run.at + watch)
            if after is None:
                continue
            before = self._measure(run.engine, run.at - watch, run.at)
            m = Measurement(after.seconds, after.preemptions, after.finished, 0, None, before)
            trip = judge(m, self.breaker)
            if trip is None:
                continue
            until = now + self.breaker.cooldown_seconds
            for knob in run.knobs:
                self.holds[(run.engine, knob)] = (until, f"{run.runbook} tripped it: {trip.text}")
            self.trips.append(
                {
                    "engine": "/".join(run.engine),
                    "runbook": run.runbook,
                    "at": now,
                    "why": trip.text,
                }
            )

    def _measure(self, engine: EngineKey, t0: float, t1: float) -> Measurement | None:
        counts = []
        for name in BREAKER_COUNTERS:
            a, b = self._read(engine, name, t0), self._read(engine, name, t1)
            if a is None or b is None:
                return None
            counts.append(int(b - a) if b >= a else int(b))
        return Measurement(t1 - t0, counts[0], counts[1], 0)


def _change(
    action: str,
    params: Mapping[str, Any],
    knobs: Mapping[str, Any],
    startup: Mapping[str, float | None],
) -> tuple[dict[str, tuple[Any, Any]], str | None]:
    """{knob: (before, after)} and a note, as the action would decide on these values."""
    current = knobs.get("max_num_seqs")
    if action == "set_max_num_seqs":
        if current is None:
            return {}, "max_num_seqs not recorded"
        current = int(current)
        value = params.get("value")
        if value == "kv_capacity":
            capacity = knobs.get("kv_capacity_seqs")
            if capacity is None:
                return {}, "kv_capacity unknown (nothing running held KV blocks)"
            if capacity >= current:
                return {}, f"kv_capacity {capacity:g} >= max_num_seqs {current}: nothing to lower"
            headroom = float(params.get("headroom", 0.5))
            target = max(1, math.floor(capacity * headroom))
            if target >= current:
                return {}, f"kv_capacity {capacity:g} x {headroom:g} >= max_num_seqs {current}"
        else:
            target = int(value) if value is not None else current
        if target == current:
            return {}, f"max_num_seqs is already {current}"
        return {"max_num_seqs": (current, target)}, None
    if action == "scale_max_num_batched_tokens":
        budget = knobs.get("max_num_batched_tokens")
        if budget is None:
            return {}, "max_num_batched_tokens not recorded"
        target = max(1, math.floor(budget * float(params.get("factor", 1.0))))
        note = "before the agent's floors" if target != budget else None
        return ({"max_num_batched_tokens": (int(budget), target)} if target != budget else {}), note
    if action == "set_policy":
        policy = params.get("policy")
        if knobs.get("policy") == policy:
            return {}, f"policy is already {policy}"
        return {"policy": (knobs.get("policy"), policy)}, None
    if action == "set_autopilot":
        enabled = bool(params.get("enabled", True))
        return {"autopilot": (None, enabled)}, "the autopilot's switch is not recorded"
    if action == "restore_knobs":
        out: dict[str, tuple[Any, Any]] = {}
        for knob in ("max_num_seqs", "max_num_batched_tokens"):
            now, first = knobs.get(knob), startup.get(knob)
            if now is not None and first is not None and now != first:
                out[knob] = (int(now), int(first))
        return out, None if out else "every recorded knob is at its startup value"
    return {}, "not simulated (an action the backtest does not know)"


def summary(decisions: Sequence[Decision]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in decisions:
        out[d.decision] = out.get(d.decision, 0) + 1
    return out
