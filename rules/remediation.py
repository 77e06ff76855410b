"""From a firing incident to the runbook executor, as far as the deployment allows.

The Dispatcher is the evaluator's sink: it hands every event to the sinks
that record it (the store first), notifies, and where `automation` in the
configuration says `auto` or `approve` for the incident's runbook, hands
the incident to a RemediationHook. Default everywhere: `notify` (record and
log, run nothing). The executor implements RemediationHook; until it is
wired, LoggingRemediationHook stands in and only logs what it would do.

A hook runs on the evaluation thread: it should enqueue and return. An
exception in it is logged, never allowed to stop the evaluation cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from vllm_runbook.rules.config import Automation, EngineConfig
from vllm_runbook.rules.incidents import IncidentEvent, IncidentSink, engine_name

log = logging.getLogger(__name__)

HandoffMode = Literal["auto", "approve"]


@dataclass(frozen=True)
class Handoff:
    incident: IncidentEvent
    mode: HandoffMode  # auto: run now; approve: ask a person first
    engine_name: str  # as in the store's incidents and executions
    engine: EngineConfig | None  # the inventory entry (agent URL), None if unknown
    # One firing episode of one alert on one engine: the executor runs a
    # runbook at most once per episode (like Alertmanager's fingerprint+startsAt).
    episode: str

    @property
    def runbook(self) -> str:
        assert self.incident.runbook is not None  # only runbook alerts are handed off
        return self.incident.runbook


class RemediationHook(Protocol):
    def on_firing(self, handoff: Handoff) -> None: ...

    def on_resolved(self, handoff: Handoff) -> None: ...


class LoggingRemediationHook:
    """The default hook: says what the executor would be asked, does nothing."""

    def on_firing(self, handoff: Handoff) -> None:
        verb = "run" if handoff.mode == "auto" else "ask approval to run"
        log.warning(
            "would %s runbook %s on %s for %s (episode %s): no executor wired",
            verb,
            handoff.runbook,
            handoff.engine_name,
            handoff.incident.alert,
            handoff.episode,
        )

    def on_resolved(self, handoff: Handoff) -> None:
        log.info(
            "%s resolved on %s (episode %s)",
            handoff.incident.alert,
            handoff.engine_name,
            handoff.episode,
        )


def episode_of(event: IncidentEvent) -> str:
    return f"{event.alert}/{event.severity}@{engine_name(event.engine)}#{event.first_seen:.3f}"


class Dispatcher:
    """An IncidentSink that records, notifies, then hands off per `automation`."""

    def __init__(
        self,
        sinks: Sequence[IncidentSink],
        automation: Automation,
        hook: RemediationHook | None = None,
        engines: Mapping[str, EngineConfig] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.automation = automation
        self.hook: RemediationHook = hook or LoggingRemediationHook()
        self.engines = dict(engines or {})
        self._handed: dict[str, Handoff] = {}  # episode -> hand-off, until resolved

    def record(self, event: IncidentEvent) -> None:
        for sink in self.sinks:
            sink.record(event)
        if event.state == "firing":
            self._firing(event)
        elif event.state == "resolved":
            handoff = self._handed.pop(episode_of(event), None)
            if handoff is not None:
                self._call("on_resolved", handoff)

    def _firing(self, event: IncidentEvent) -> None:
        mode = self.automation.mode(event.runbook)
        name = engine_name(event.engine)
        log.warning(
            "incident firing: %s (%s) on %s, value %.4g: %s [runbook %s, %s]",
            event.alert,
            event.severity,
            name,
            event.value,
            event.summary,
            event.runbook or "none",
            mode,
        )
        if mode == "notify":
            return
        handoff = Handoff(event, mode, name, self.engines.get(event.engine[0]), episode_of(event))
        self._handed[handoff.episode] = handoff
        self._call("on_firing", handoff)

    def _call(self, method: str, handoff: Handoff) -> None:
        try:
            getattr(self.hook, method)(handoff)
        except Exception:
            log.exception("remediation hook %s failed for %s", method, handoff.episode)
