"""The service's own metrics (vllm_runbook.runbooks.service.metric_specs), fed from what it did.

One ServiceMetrics per process, on its own registry, shared by the app (webhooks),
the worker (executions, knob changes, detection-to-action) and the rules
service (evaluation time, scrape errors, firing incidents). Each replica
counts what it did itself, so Prometheus' sums over replicas are right.

Executions and knob changes are read from the journal when an execution
finishes: the journal is the record of what changed, and the metrics agree
with it by construction.

Every label combination the service can know in advance (runbooks x
statuses, inventory engines x knobs, scrape targets x reasons) starts at 0.
Prometheus' increase(), rate() and changes() count nothing for a series whose
first sample is already 1: without the zeros, the first execution of a runbook
would never show on the dashboards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm_runbook.runbooks.engine.operations import KNOBS
from vllm_runbook.runbooks.service import metric_specs as S
from vllm_runbook.runbooks.service.breaker import REASONS as BREAKER_REASONS
from vllm_runbook.runbooks.service.discovery import SOURCES
from vllm_runbook.runbooks.service.limits import REFUSAL_REASONS as REQUEST_REFUSAL_REASONS
from vllm_runbook.runbooks.store import ExecutionRecord, StepRecord
from vllm_runbook.runbooks.store.models import (
    NOTIFY_DELIVERED,
    NOTIFY_FAILED,
    STEP_APPLIED,
    STEP_REVERTED,
    ExecutionStatus,
)

if TYPE_CHECKING:
    from vllm_runbook.rules.scrape import ScrapeCycle, ScrapeResult

# Reasons a webhook delivery is refused (the WEBHOOKS_REJECTED `reason` label).
REJECT_AUTH = "auth"
REJECT_MALFORMED = "malformed"  # not JSON, not a v4 payload, or too large
REJECT_STORE_DOWN = "store_down"
# The execution statuses this counter reaches (the active ones pass by).
COUNTED_STATUSES = (
    ExecutionStatus.PENDING,
    ExecutionStatus.SUCCEEDED,
    ExecutionStatus.FAILED,
    ExecutionStatus.ROLLED_BACK,
    ExecutionStatus.REVERTED,
    ExecutionStatus.REFUSED,
)
SCRAPE_ERROR_REASONS = ("unreachable", "http_status", "parse")
NOTIFY_OUTCOMES = (NOTIFY_DELIVERED, NOTIFY_FAILED)
# Why an alert of a stored delivery was not stored (ALERTS_REJECTED `reason`).
ALERT_STARTS_AT_OUT_OF_RANGE = "starts_at_out_of_range"
# detection_to_action_seconds observes -SKEW … MAX seconds (a negative one as 0:
# the sender's clock ahead of ours); the rest is counted apart, by reason.
DETECTION_TO_ACTION_SKEW_S = 60.0
DETECTION_TO_ACTION_MAX_S = 86400.0
STARTS_AT_AFTER_ACTION = "starts_at_after_action"
STARTS_AT_TOO_OLD = "starts_at_too_old"
UNMEASURED_REASONS = (STARTS_AT_AFTER_ACTION, STARTS_AT_TOO_OLD)


def unmeasured_reason(seconds: float) -> str | None:
    """Why a detection-to-action time of `seconds` is not a measurement (None: it is)."""
    if seconds < -DETECTION_TO_ACTION_SKEW_S:
        return STARTS_AT_AFTER_ACTION
    if seconds > DETECTION_TO_ACTION_MAX_S:
        return STARTS_AT_TOO_OLD
    return None


# The retention's limits (WEBHOOK_EVENTS_PRUNED `limit`).
PRUNED_MAX_AGE, PRUNED_MAX_SIZE = "max_age", "max_size"


def knob_changes(step: StepRecord) -> list[str]:
    """The knobs a journaled step changed on the engine (before != after)."""
    if step.status not in (STEP_APPLIED, STEP_REVERTED) or not step.before or not step.after:
        return []
    return [
        k for k, v in step.before.items() if k in KNOBS and k in step.after and step.after[k] != v
    ]


class ServiceMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        engine_names: Mapping[str, str] | None = None,
        runbooks: Iterable[str] = (),
        scrape_targets: Iterable[str] = (),
        receivers: Iterable[str] = (),
    ) -> None:
        """`engine_names`: agent URL (as executions are keyed) -> inventory name;
        `runbooks` and `scrape_targets` (URLs): the catalog's runbooks and what the
        embedded evaluator scrapes, for the series that start at 0."""
        runbooks = tuple(runbooks)
        self.registry = registry or CollectorRegistry()
        self.engine_names = dict(engine_names or {})
        built = S.build_all(self.registry)
        self.webhooks_received = cast(Counter, built[S.WEBHOOKS_RECEIVED])
        self.webhooks_rejected = cast(Counter, built[S.WEBHOOKS_REJECTED])
        self.executions = cast(Counter, built[S.EXECUTIONS])
        self.detection_to_action = cast(Histogram, built[S.DETECTION_TO_ACTION])
        self.detection_to_action_unmeasured = cast(Counter, built[S.DETECTION_TO_ACTION_UNMEASURED])
        self.rule_evaluation = cast(Histogram, built[S.RULE_EVALUATION])
        self.scrape_errors = cast(Counter, built[S.SCRAPE_ERRORS])
        self.scrape_duration = cast(Gauge, built[S.SCRAPE_DURATION])
        self.scrape_targets_backed_off = cast(Gauge, built[S.SCRAPE_TARGETS_BACKED_OFF])
        self.scrape_targets_late = cast(Gauge, built[S.SCRAPE_TARGETS_LATE])
        self.rules_cycle = cast(Histogram, built[S.RULES_CYCLE])
        self.rules_evaluation_interval = cast(Gauge, built[S.RULES_EVALUATION_INTERVAL])
        self.incidents_firing = cast(Gauge, built[S.INCIDENTS_FIRING])
        self.knob_changes = cast(Counter, built[S.KNOB_CHANGES])
        self.breaker_trips = cast(Counter, built[S.BREAKER_TRIPS])
        self.executions_holding = cast(Gauge, built[S.EXECUTIONS_HOLDING])
        self.reverts_premature = cast(Counter, built[S.REVERTS_PREMATURE])
        self._holding_labels: set[tuple[str, str]] = set()
        self.notifications = cast(Counter, built[S.NOTIFICATIONS])
        self.alerts_rejected = cast(Counter, built[S.ALERTS_REJECTED])
        self.requests_refused = cast(Counter, built[S.REQUESTS_REFUSED])
        self.webhook_events_pruned = cast(Counter, built[S.WEBHOOK_EVENTS_PRUNED])
        self.engines = cast(Gauge, built[S.ENGINES])
        self.discovery_refresh_failures = cast(Counter, built[S.DISCOVERY_REFRESH_FAILURES])
        static = len(self.engine_names)
        for source in SOURCES:
            self.engines.labels(source).set(static if source == "static" else 0)
            if source != "static":
                self.discovery_refresh_failures.labels(source)
        self.alerts_rejected.labels(ALERT_STARTS_AT_OUT_OF_RANGE)
        for reason in REQUEST_REFUSAL_REASONS:
            self.requests_refused.labels(reason)
        for limit in (PRUNED_MAX_AGE, PRUNED_MAX_SIZE):
            self.webhook_events_pruned.labels(limit)
        for receiver in receivers:
            for outcome in NOTIFY_OUTCOMES:
                self.notifications.labels(receiver, outcome)
        # A rate of 0, not "no data"; the first event counts (see the docstring).
        for reason in (REJECT_AUTH, REJECT_MALFORMED, REJECT_STORE_DOWN):
            self.webhooks_rejected.labels(reason)
        for status in ("firing", "resolved"):
            self.webhooks_received.labels(status)
        for runbook in runbooks:
            self.detection_to_action.labels(runbook)
            for reason in UNMEASURED_REASONS:
                self.detection_to_action_unmeasured.labels(runbook, reason)
            for status in COUNTED_STATUSES:
                self.executions.labels(runbook, status)
        for name in sorted(set(self.engine_names.values())):
            for knob in KNOBS:
                self.knob_changes.labels(name, knob)
            for reason in BREAKER_REASONS:
                self.breaker_trips.labels(name, reason)
            for runbook in runbooks:
                self.reverts_premature.labels(name, runbook)
                self.executions_holding.labels(name, runbook).set(0)
                self._holding_labels.add((name, runbook))
        for url in scrape_targets:
            for reason in SCRAPE_ERROR_REASONS:
                self.scrape_errors.labels(url, reason)

    def notification_sent(self, receiver: str, outcome: str) -> None:
        """The notifier reports each delivery's outcome (delivered | failed)."""
        self.notifications.labels(receiver, outcome).inc()

    def scrape_failed(self, target_url: str, reason: str) -> None:
        """The rules engine's scraper reports each failed scrape here (its `on_error`)."""
        self.scrape_errors.labels(target_url, reason).inc()

    def discovery_refreshed(self, counts: Mapping[str, int]) -> None:
        for source, count in counts.items():
            self.engines.labels(source).set(count)

    def discovery_failed(self, source: str) -> None:
        self.discovery_refresh_failures.labels(source).inc()

    def engine_name(self, engine_url: str) -> str:
        return self.engine_names.get(engine_url, engine_url)

    # --- executions -------------------------------------------------------------

    def execution_created(self, runbook: str) -> None:
        self.executions.labels(runbook, ExecutionStatus.PENDING).inc()

    def execution_finished(self, record: ExecutionRecord) -> None:
        """An execution (not a revert) reached its final status."""
        self.executions.labels(record.runbook, record.status).inc()
        changed = [(s, knob_changes(s)) for s in sorted(record.steps, key=lambda s: s.ordinal)]
        changed = [(s, knobs) for s, knobs in changed if knobs]
        # A rolled-back step changed its knobs twice: applied, then restored.
        times = 2 if record.status == ExecutionStatus.ROLLED_BACK else 1
        self._count_knobs(record.engine, (k for _, knobs in changed for k in knobs), times)
        if changed and record.alert_starts_at is not None:
            first = changed[0][0]
            acted = first.finished_at or first.started_at
            seconds = (acted - record.alert_starts_at).total_seconds()
            unmeasured = unmeasured_reason(seconds)
            if unmeasured is not None:
                # A clock (Prometheus', Alertmanager's, a sender's) that is wrong:
                # counted apart, not averaged in (year 1 would read 2000 years).
                self.detection_to_action_unmeasured.labels(record.runbook, unmeasured).inc()
            else:
                self.detection_to_action.labels(record.runbook).observe(max(0.0, seconds))

    def revert_finished(self, original: ExecutionRecord, revert: ExecutionRecord) -> None:
        """A revert of `original` finished: the original is `reverted` if it worked."""
        status = (
            ExecutionStatus.REVERTED
            if revert.status == ExecutionStatus.SUCCEEDED
            else revert.status
        )
        self.executions.labels(original.runbook, status).inc()
        knobs = (k for s in revert.steps for k in knob_changes(s))
        self._count_knobs(revert.engine, knobs, 1)

    def set_holding(self, holding: Iterable[ExecutionRecord]) -> None:
        """The executions holding now (each worker pass); a pair that held
        before and holds no more reads 0."""
        counts: dict[tuple[str, str], int] = {}
        for record in holding:
            key = (self.engine_name(record.engine), record.runbook)
            counts[key] = counts.get(key, 0) + 1
        for key in self._holding_labels | set(counts):
            self.executions_holding.labels(*key).set(counts.get(key, 0))
        self._holding_labels |= set(counts)

    def revert_premature(self, runbook: str, engine_url: str) -> None:
        """A revert's finding came back within its watch: its fix was re-applied."""
        self.reverts_premature.labels(self.engine_name(engine_url), runbook).inc()

    def breaker_tripped(self, engine_url: str, reason: str) -> None:
        """The circuit breaker rolled a change back (runbooks/service/breaker.py)."""
        self.breaker_trips.labels(self.engine_name(engine_url), reason).inc()

    def _count_knobs(self, engine_url: str, knobs: Iterable[str], times: int) -> None:
        name = self.engine_name(engine_url)
        for knob in knobs:
            self.knob_changes.labels(name, knob).inc(times)

    # --- the rules engine ---------------------------------------------------------

    def set_firing(self, alerts: Iterable[str], firing: Mapping[str, int]) -> None:
        """Firing incidents per alert now; every alert of the catalog gets a value."""
        for alert in alerts:
            self.incidents_firing.labels(alert).set(firing.get(alert, 0))

    def clear_firing(self) -> None:
        """Not the rules leader: another replica reports the incidents and the scrapes."""
        self.incidents_firing.clear()
        self.scrape_duration.clear()
        self.scrape_targets_backed_off.set(0)
        self.scrape_targets_late.set(0)

    # The scraper's observer (vllm_runbook.rules.scrape.ScrapeObserver).
    def target_scraped(self, result: ScrapeResult) -> None:
        self.scrape_duration.labels(result.target.url).set(result.seconds)

    def cycle_scraped(self, cycle: ScrapeCycle) -> None:
        self.scrape_targets_backed_off.set(cycle.skipped)
        self.scrape_targets_late.set(cycle.late)
