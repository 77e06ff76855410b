"""The in-service evaluator: every rule, every engine, pending -> firing -> resolved.

State follows Prometheus' alerting rules exactly: an alert becomes pending
at the first evaluation where the condition holds (activeAt), firing at the
first evaluation at least `for` later, resolved at the first evaluation
where the condition no longer holds (a pending one just disappears).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_runbook.rules import condition as C
from vllm_runbook.rules import template
from vllm_runbook.rules.compiler import Cache, Compiler, Fn
from vllm_runbook.rules.incidents import IncidentEvent, IncidentSink, OpenAlert, State
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.window import LOOKBACK_SECONDS, EngineKey, WindowStore

TRIM_EVERY_SECONDS = 60.0


def store_for_rules(
    rules: Sequence[Rule],
    *,
    left_open: bool = True,
    slack: float = 60.0,
    lookback: float = LOOKBACK_SECONDS,
) -> WindowStore:
    """A WindowStore keeping each series the rules read for its longest window."""
    retention: dict[str, float] = {}
    counters: set[str] = set()
    # the matchers each series is read with; None once a reader takes them all
    only: dict[str, set[tuple[tuple[str, str], ...]] | None] = {}
    for rule in rules:
        for leaf, offset in C.leaves(rule.condition):
            name = leaf.sel.metric
            match leaf:
                case C.Rate(_, window) | C.OverTime(_, _, window):
                    span = window
                case C.Quantile(_, _, window):
                    name, span = name + "_bucket", window
                case _:
                    span = lookback
            if isinstance(leaf, C.Rate | C.Quantile):
                counters.add(name)
            retention[name] = max(retention.get(name, 0.0), span + offset + slack)
            readers = only.get(name, set())
            if readers is not None and leaf.sel.matchers:
                readers.add(leaf.sel.matchers)
            only[name] = readers if readers is not None and leaf.sel.matchers else None
    return WindowStore(
        retention,
        counters=counters,
        lookback=lookback,
        left_open=left_open,
        only={name: m for name, m in only.items() if m is not None},
    )


@dataclass
class _Active:
    state: State
    first_seen: float
    last_seen: float
    value: float
    fired_at: float | None = None


class Evaluator:
    def __init__(
        self,
        rules: Sequence[Rule],
        store: WindowStore,
        sink: IncidentSink,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = list(rules)
        self.store = store
        self.sink = sink
        self.clock = clock
        compiler = Compiler(store)
        self._fns: list[Fn] = [compiler.condition(r.condition) for r in self.rules]
        self.active: dict[tuple[int, EngineKey], _Active] = {}
        self._last_trim = float("-inf")

    def evaluate(self, now: float | None = None) -> list[IncidentEvent]:
        """One cycle over every engine in the store; returns (and records) the changes."""
        now = self.clock() if now is None else now
        if now - self._last_trim >= TRIM_EVERY_SECONDS:
            self.store.trim(now)
            self._last_trim = now
        events: list[IncidentEvent] = []
        active = self.active
        seen: set[tuple[int, EngineKey]] = set()
        for eng in self.store:
            cache: Cache = {}
            for i, fn in enumerate(self._fns):
                value = fn(eng, now, cache)
                if value is None:
                    continue
                key = (i, eng.key)
                seen.add(key)
                alert = active.get(key)
                if alert is None or alert.state == "resolved":
                    alert = active[key] = _Active("pending", now, now, value)  # type: ignore[arg-type]
                    if self.rules[i].for_seconds > 0:
                        events.append(self._event(i, eng.key, alert, now))
                alert.last_seen, alert.value = now, value  # type: ignore[assignment]
                if alert.state == "pending" and now - alert.first_seen >= self.rules[i].for_seconds:
                    alert.state, alert.fired_at = "firing", now
                    events.append(self._event(i, eng.key, alert, now))
        for key in [k for k in active if k not in seen]:
            alert = active.pop(key)
            alert.state = "resolved" if alert.state == "firing" else "inactive"
            events.append(self._event(key[0], key[1], alert, now))
        for event in events:
            self.sink.record(event)
        return events

    def firing(self) -> list[tuple[Rule, EngineKey, float]]:
        return [
            (self.rules[i], k, a.value) for (i, k), a in self.active.items() if a.state == "firing"
        ]

    def open_alerts(self) -> list[OpenAlert]:
        """Every pending or firing alert now, for sinks that refresh what they stored."""
        return [
            OpenAlert(
                self.rules[i].alert,
                self.rules[i].severity,
                engine,
                a.state,
                a.value,
                a.first_seen,
                a.last_seen,
            )
            for (i, engine), a in self.active.items()
            if a.state in ("pending", "firing")
        ]

    def _event(self, i: int, engine: EngineKey, alert: _Active, now: float) -> IncidentEvent:
        rule = self.rules[i]
        labels = {
            "alertname": rule.alert,
            "instance": engine[0],
            "model_name": engine[1],
            "engine": engine[2],
            **rule.alert_labels,
        }
        return IncidentEvent(
            alert=rule.alert,
            severity=rule.severity,
            runbook=rule.runbook,
            engine=engine,
            state=alert.state,
            value=alert.value,
            first_seen=alert.first_seen,
            last_seen=alert.last_seen,
            at=now,
            fired_at=alert.fired_at,
            labels=labels,
            summary=template.render(rule.summary, labels, alert.value),
            description=template.render(rule.description, labels, alert.value),
        )
