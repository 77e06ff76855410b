"""Every metric `runbook serve` exports, declared once.

The service builds its prometheus_client objects from these specs
(`build_all`), and the dashboards and their tests import the same names.
Unlike the collector's metrics these carry no `model_name`/`engine` base
labels: only the labels listed with each (`extra_labels`). Where a label is
called `engine` it is the engine's name in the service's inventory (e.g.
``llama-0``), not vLLM's DP rank.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm_runbook.collector.metrics import MetricSpec

PREFIX = "vllm_runbook_service_"

# From an alert's startsAt to the first action on the engine: Alertmanager's
# group_wait alone is 10 s or more, so the interesting range is seconds to minutes.
DETECTION_TO_ACTION_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# One evaluation of the whole catalog over in-memory windows: milliseconds.
RULE_EVALUATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# One whole cycle (scrape every target, then evaluate): from milliseconds for a few
# engines to seconds for a thousand; the default evaluation interval is 5 s.
RULES_CYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0)


def _spec(
    name: str, type_: str, help_: str, *labels: str, buckets: tuple[float, ...] = ()
) -> MetricSpec:
    return MetricSpec(PREFIX + name, type_, help_, extra_labels=labels, buckets=buckets)  # type: ignore[arg-type]


WEBHOOKS_RECEIVED = _spec(
    "webhooks_received",
    "counter",
    "Alertmanager webhook deliveries received, by the alert group's status (firing|resolved).",
    "status",
)
WEBHOOKS_REJECTED = _spec(
    "webhooks_rejected",
    "counter",
    "Webhook deliveries refused, by reason (auth|malformed|store_down).",
    "reason",
)
EXECUTIONS = _spec(
    "executions",
    "counter",
    "Runbook executions that reached a status, by runbook and status "
    "(the journal's execution statuses).",
    "runbook",
    "status",
)
DETECTION_TO_ACTION = _spec(
    "detection_to_action_seconds",
    "histogram",
    "Seconds from the alert's startsAt to the runbook's first action on the engine.",
    "runbook",
    buckets=DETECTION_TO_ACTION_BUCKETS,
)
DETECTION_TO_ACTION_UNMEASURED = _spec(
    "detection_to_action_unmeasured",
    "counter",
    "Executions that acted whose alert's startsAt gives no sensible detection-to-action "
    "time, so detection_to_action_seconds did not observe it, by runbook and reason "
    "(starts_at_after_action: startsAt more than a minute after the first action; "
    "starts_at_too_old: more than a day before it).",
    "runbook",
    "reason",
)
RULE_EVALUATION = _spec(
    "rule_evaluation_seconds",
    "histogram",
    "Wall time of one evaluation of the rule catalog by the embedded rules engine.",
    buckets=RULE_EVALUATION_BUCKETS,
)
# The rules engine's scraper reports into this one (its on_error, ServiceMetrics.scrape_failed),
# by target URL
# and reason (unreachable|http_status|parse).
SCRAPE_ERRORS = _spec(
    "scrape_errors",
    "counter",
    "Failed scrapes of engine endpoints by the embedded rules engine, by target.",
    "target",
    "reason",
)
SCRAPE_DURATION = _spec(
    "scrape_duration_seconds",
    "gauge",
    "Wall time of the embedded rules engine's latest attempt to scrape each target, "
    "parse included (a timed-out attempt reads as the timeout).",
    "target",
)
SCRAPE_TARGETS_BACKED_OFF = _spec(
    "scrape_targets_backed_off",
    "gauge",
    "Targets the rules leader skipped in its latest cycle: they stopped answering and are "
    "tried again after a backoff (10 s doubling to at most 2 min).",
)
SCRAPE_TARGETS_LATE = _spec(
    "scrape_targets_late",
    "gauge",
    "Targets whose answer the rules leader's latest cycle did not wait for "
    "(rules.scrape_deadline, rules.scrape_grace): a later cycle takes it in at the time "
    "it was asked for, or counts the timeout as a failure.",
)
RULES_CYCLE = _spec(
    "rules_cycle_seconds",
    "histogram",
    "Wall time of one cycle of the rules leader: scrape every target, then evaluate "
    "the catalog. At or above the evaluation interval the scheduler skips cycles.",
    buckets=RULES_CYCLE_BUCKETS,
)
RULES_EVALUATION_INTERVAL = _spec(
    "rules_evaluation_interval_seconds",
    "gauge",
    "The configured evaluation interval of the embedded rules engine (rules.evaluation_interval).",
)
INCIDENTS_FIRING = _spec(
    "incidents_firing",
    "gauge",
    "Incidents firing now, by alert name.",
    "alert",
)
KNOB_CHANGES = _spec(
    "knob_changes",
    "counter",
    "Knob changes applied to engines by runbooks (including reverts), "
    "by engine (inventory name) and knob.",
    "engine",
    "knob",
)
BREAKER_TRIPS = _spec(
    "breaker_trips",
    "counter",
    "Changes the circuit breaker rolled back, by engine (inventory name) and reason "
    "(preemption_rate|error_rate|p99_over_sla).",
    "engine",
    "reason",
)
EXECUTIONS_HOLDING = _spec(
    "executions_holding",
    "gauge",
    "Executions holding their changes after their alert resolved, until the cause is "
    "gone (or a person releases them), by engine (inventory name) and runbook.",
    "engine",
    "runbook",
)
REVERTS_PREMATURE = _spec(
    "reverts_premature",
    "counter",
    "Reverts whose finding fired again within their watch (the fix was re-applied), "
    "by engine (inventory name) and runbook.",
    "engine",
    "runbook",
)

NOTIFICATIONS = _spec(
    "notifications",
    "counter",
    "Execution events sent to notification receivers, by receiver and outcome "
    "(delivered|failed: every retry failed).",
    "receiver",
    "outcome",
)

ALERTS_REJECTED = _spec(
    "alerts_rejected",
    "counter",
    "Alerts of stored deliveries that were not stored themselves, by reason "
    "(starts_at_out_of_range: startsAt outside years 1-9999 in UTC).",
    "reason",
)
REQUESTS_REFUSED = _spec(
    "requests_refused",
    "counter",
    "Requests refused or cut by the service's limits, by reason "
    "(body_too_large|body_timeout|header_timeout|client_disconnected|"
    "client_connections|too_many_connections).",
    "reason",
)
WEBHOOK_EVENTS_PRUNED = _spec(
    "webhook_events_pruned",
    "counter",
    "Stored Alertmanager deliveries deleted by the retention job, by limit (max_age|max_size).",
    "limit",
)

ENGINES = _spec(
    "engines",
    "gauge",
    "Engines in the service's inventory, by where they came from "
    "(static: the configured list; prometheus, file_sd: discovery).",
    "source",
)
DISCOVERY_REFRESH_FAILURES = _spec(
    "discovery_refresh_failures",
    "counter",
    "Discovery refreshes of a source that failed (its last good engines are kept), by source.",
    "source",
)

SERVICE_METRICS: tuple[MetricSpec, ...] = (
    WEBHOOKS_RECEIVED,
    WEBHOOKS_REJECTED,
    EXECUTIONS,
    DETECTION_TO_ACTION,
    DETECTION_TO_ACTION_UNMEASURED,
    RULE_EVALUATION,
    SCRAPE_ERRORS,
    SCRAPE_DURATION,
    SCRAPE_TARGETS_BACKED_OFF,
    SCRAPE_TARGETS_LATE,
    RULES_CYCLE,
    RULES_EVALUATION_INTERVAL,
    INCIDENTS_FIRING,
    KNOB_CHANGES,
    BREAKER_TRIPS,
    EXECUTIONS_HOLDING,
    REVERTS_PREMATURE,
    NOTIFICATIONS,
    ALERTS_REJECTED,
    REQUESTS_REFUSED,
    WEBHOOK_EVENTS_PRUNED,
    ENGINES,
    DISCOVERY_REFRESH_FAILURES,
)

ServiceMetric = Counter | Gauge | Histogram


def build(spec: MetricSpec, registry: CollectorRegistry) -> ServiceMetric:
    """The prometheus_client object for `spec` on `registry` (labels: extra_labels only)."""
    labels = list(spec.extra_labels)
    if spec.type == "counter":
        return Counter(spec.name, spec.help, labels, registry=registry)
    if spec.type == "histogram":
        return Histogram(spec.name, spec.help, labels, registry=registry, buckets=spec.buckets)
    return Gauge(spec.name, spec.help, labels, registry=registry)


def build_all(registry: CollectorRegistry) -> dict[MetricSpec, ServiceMetric]:
    """Every service metric on `registry`, keyed by its spec."""
    return {spec: build(spec, registry) for spec in SERVICE_METRICS}
