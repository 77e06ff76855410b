"""The in-service evaluator: every rule, every engine, pending -> firing -> resolved.

State follows Prometheus' alerting rules exactly: an alert becomes pending
at the first evaluation where the condition holds (activeAt), firing at the
first evaluation at least `for` later, resolved at the first evaluation
where the condition no longer holds (a pending one just disappears).

An engine without the plugin (no fresh series of the collector) is evaluated
on each rule's variant for such engines (vllm_runbook.rules.needs: vLLM's own
series stand in for the collector's); a rule without one is not evaluated
there, and `skipped` says what it needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_runbook.collector.metrics import COLLECTOR_UP, PREFIX
from vllm_runbook.rules import condition as C
from vllm_runbook.rules import template
from vllm_runbook.rules.compiler import Cache, Compiler, Fn
from vllm_runbook.rules.incidents import IncidentEvent, IncidentSink, OpenAlert, State
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.needs import NEEDS_TEXT, RuleNeeds, needs
from vllm_runbook.rules.window import LOOKBACK_SECONDS, EngineKey, EngineSeries, WindowStore

log = logging.getLogger(__name__)

TRIM_EVERY_SECONDS = 60.0


def store_for_rules(
    rules: Sequence[Rule],
    *,
    left_open: bool = True,
    slack: float = 60.0,
    lookback: float = LOOKBACK_SECONDS,
) -> WindowStore:
    """A WindowStore keeping each series the rules read (with or without the plugin)
    for its longest window, and the collector's `up` (whether an engine has the plugin)."""
    retention: dict[str, float] = {COLLECTOR_UP.name: lookback + slack}
    counters: set[str] = set()
    # the matchers each series is read with; None once a reader takes them all
    only: dict[str, set[tuple[tuple[str, str], ...]] | None] = {}
    conditions = [rule.condition for rule in rules]
    conditions += [n.without_plugin for n in map(needs, rules) if n.without_plugin is not None]
    for condition in conditions:
        for leaf, offset in C.leaves(condition):
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
        self.needs: list[RuleNeeds] = [needs(r) for r in self.rules]
        self._vllm_fns: list[Fn | None] = [
            compiler.condition(n.without_plugin) if n.without_plugin is not None else None
            for n in self.needs
        ]
        # engines whose latest evaluation found no plugin (vLLM's own series only)
        self.without_plugin: set[EngineKey] = set()
        self._said_skipped = False
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
            fns: Sequence[Fn | None] = self._fns
            if not self._has_plugin(eng, now):
                fns = self._vllm_fns
                if eng.key not in self.without_plugin:
                    self._say_without_plugin(eng.key)
            else:
                self.without_plugin.discard(eng.key)
            for i, fn in enumerate(fns):
                if fn is None:
                    continue
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

    def skipped(self, engine: EngineKey) -> list[tuple[Rule, RuleNeeds]]:
        """The rules not evaluated on `engine` (it has no plugin) and what each needs."""
        if engine not in self.without_plugin:
            return []
        return [(r, n) for r, n in zip(self.rules, self.needs, strict=True) if n.needs != "vllm"]

    def _has_plugin(self, eng: EngineSeries, now: float) -> bool:
        for name, series in eng.by_name.items():
            if name.startswith(PREFIX) and any(
                self.store.latest(s, now) is not None for s in series
            ):
                return True
        return False

    def _say_without_plugin(self, engine: EngineKey) -> None:
        """Log an engine found without the plugin; the rules left out, with what each
        needs, on the first such engine only (the list is the same for all)."""
        first = not self._said_skipped
        self._said_skipped = True
        self.without_plugin.add(engine)
        skipped = self.skipped(engine)
        names = ", ".join(
            f"{r.alert} ({r.severity}: needs {NEEDS_TEXT[n.needs]})" for r, n in skipped
        )
        log.warning(
            "engine %s (model %s, engine %s) has no vllm-runbook plugin: %d of %d rules "
            "evaluated on vLLM's own series; not evaluated: %s",
            *engine,
            len(self.rules) - len(skipped),
            len(self.rules),
            (names or "none") if first else "as listed for the first such engine",
        )

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
