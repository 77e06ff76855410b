"""The three dashboards: engine overview, fleet, runbook activity.

Each panel's description says what the signal means and which rule compares
it against what (`RuleNotes`, read from the rule catalog). Metric names come
from the catalogs (vllm_runbook.collector.metrics,
vllm_runbook.runbooks.service.metric_specs, and the few
vLLM series in vllm_runbook.dashboards.catalog); nothing here retypes a metric name.
Panels are the Grafana Foundation SDK's builders (Grafana's own types), in the
common style of vllm_runbook.dashboards.builder.

The module is long (about 1,400 lines) and stays one: it is one declaration per
dashboard, each a list of its rows and panels read top to bottom as Grafana
shows them; the shared builders and queries are in builder.py and queries.py.
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import bargauge, stat
from grafana_foundation_sdk.builders.dashboard import QueryVariable
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from vllm_runbook.collector import metrics as M
from vllm_runbook.dashboards import catalog as V
from vllm_runbook.dashboards import queries as Q
from vllm_runbook.dashboards.builder import (
    Graph,
    PromAnnotation,
    bands,
    bar_gauge,
    dashboard,
    prom,
    query_variable,
    stat_panel,
    table_panel,
    thresholds,
)
from vllm_runbook.dashboards.queries import (
    ENGINE_LABELS,
    ENGINE_LEGEND,
    Threshold,
    quantile,
    rate,
    selector,
)
from vllm_runbook.rules.promql import to_promql
from vllm_runbook.rules.slo import ALERT_PREFIX as SLO_ALERT_PREFIX
from vllm_runbook.rules.slo import BURN_PAIRS as SLO_PAIRS
from vllm_runbook.runbooks.service import metric_specs as S
from vllm_runbook.runbooks.store.models import ExecutionStatus

ENGINE_UID = "vllm-runbook-engine"
FLEET_UID = "vllm-runbook-fleet"
ACTIVITY_UID = "vllm-runbook-activity"

TOP_N = 5
ENGINE_LABELS_TEXT = ", ".join(ENGINE_LABELS)


def variables() -> list[QueryVariable]:
    up = M.COLLECTOR_UP.name
    return [
        query_variable("model_name", "Model", f"label_values({up}, model_name)"),
        query_variable(
            "engine", "Engine (DP rank)", f'label_values({up}{{model_name=~"$model_name"}}, engine)'
        ),
    ]


def runbook_annotations() -> list[PromAnnotation]:
    executions = S.EXECUTIONS.series_name
    return [
        PromAnnotation(
            name="Knob changes",
            expr=Q.knob_changes(),
            title="Knob changed on {{instance}} {{model_name}}/{{engine}}",
            text="max_num_batched_tokens, max_num_seqs or the scheduling policy changed: "
            "a runbook (or an operator) acted. `runbook history` has the details.",
            color="orange",
        ),
        PromAnnotation(
            name="Runbook executions (all engines)",
            expr=f"sum by (runbook, status) (changes({executions}[1m])) > 0",
            title="Runbook {{runbook}}: {{status}}",
            text="An execution reached this status (from runbook serve).",
            tags=("runbook", "status"),
            color="purple",
        ),
    ]


# The queue-health findings, marked where their condition holds (the rule's own
# PromQL, before its `for`): where a policy switch or a stall shows on the panels.
QUEUE_FINDINGS = (
    ("VllmHotPathBacklog", "red"),
    ("VllmRequestStarvation", "yellow"),
    ("VllmEngineStalled", "dark-red"),
    ("VllmEngineStuck", "purple"),
)


def finding_annotations(notes: Q.RuleNotes) -> list[PromAnnotation]:
    return [
        PromAnnotation(
            name=f"Finding {alert}",
            expr=to_promql(notes.rule(alert).condition),
            title=f"{alert} on {{{{instance}}}} {{{{model_name}}}}/{{{{engine}}}}",
            text=notes.rule(alert).summary.split(" on ")[0]
            + f" (runbook {notes.rule(alert).runbook}).",
            color=color,
        )
        for alert, color in QUEUE_FINDINGS
    ]


def increase(series: str, window: str, by: str) -> str:
    return f"sum by ({by}) (increase({series}[{window}]))"


def events(series: str, window: str, by: str) -> str:
    """How many times a service counter moved per `window`, only where it did.

    The service starts its counters at 0 for every runbook, status, engine and
    knob it knows (so the first event counts); `> 0` keeps those zero series out
    of the bars and legends."""
    return f"{increase(series, window, by)} > 0"


def service_rate(spec: M.MetricSpec, by: str) -> str:
    return f"sum by ({by}) ({rate(spec, engine=False)})"


def p50_p99(spec: M.MetricSpec) -> list[Builder[variants.Dataquery]]:
    return [
        prom(Q.latency(0.5, spec), "p50 " + ENGINE_LEGEND),
        prom(Q.latency(0.99, spec), "p99 " + ENGINE_LEGEND),
    ]


class Panels:
    """Every engine signal as a panel; the engine and fleet views share them."""

    def __init__(self, notes: Q.RuleNotes) -> None:
        self.n = notes

    def throughput(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Throughput",
                "Tokens per second generated (output) and processed as prompt (prefill), "
                "from vLLM's own counters. "
                + n.note(
                    "VllmThroughputDrop",
                    "fires when generation throughput over {window} is at least {drop_pct} below "
                    "the {baseline} that ended {window} + {for} earlier while requests wait, "
                    "for {for}",
                )
                + " "
                + n.note(
                    "VllmInsufficientWarmup",
                    "fires in the first {warmup} while the engine generates tokens without a "
                    "finished warm-up at start and no request waited over {window}, for {for}",
                ),
                width,
            )
            .with_target(prom(Q.generation_throughput(), "generated " + ENGINE_LEGEND))
            .with_target(prom(Q.prompt_throughput(), "prompt " + ENGINE_LEGEND))
        )

    def e2e_latency(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "End-to-end latency P50 / P99",
                "Time from a request's arrival to its last token (vLLM's histogram). "
                + n.note(
                    "VllmLatencySpike",
                    "fires when the P99 over {window} is above {p99_sla_seconds} s (the dashed "
                    "line) or at least {earlier_rise_pct} above its value {earlier} earlier, "
                    "while the queue grows, for {for}",
                )
                + " "
                + n.note(
                    "VllmLatencyRiseFlatLoad",
                    "fires when the P99 rose by {earlier_rise_pct} against {earlier} earlier while "
                    "the finished-request rate stayed within {load_min}..{load_max} of its "
                    "earlier value and the queue did not grow, for {for}",
                )
                + " "
                + n.note(
                    "VllmBatchTooLarge",
                    "fires when the P99 rose by {latency_rise_pct} against {earlier} earlier while "
                    "the prefix hit ratio fell by {hit_fall_pct} against the {baseline} that "
                    "ended {window} + {for} earlier",
                ),
                width,
            )
            .targets(p50_p99(V.E2E_REQUEST_LATENCY))
            .unit("s")
            .rule_lines(n.threshold("VllmLatencySpike", "p99_sla_seconds"))
        )

    def ttft(self) -> Graph:
        return (
            Graph(
                "Time to first token P50 / P99",
                "Time from a request's arrival to its first output token: queueing plus prefill "
                "(vLLM's histogram). No rule uses it directly; it rises first when prefill "
                "competes with decode for the token budget.",
                12,
            )
            .targets(p50_p99(V.TIME_TO_FIRST_TOKEN))
            .unit("s")
        )

    def inter_token(self) -> Graph:
        return (
            Graph(
                "Inter-token latency P50 / P99",
                "Time between two output tokens of a request (vLLM's histogram): the decode step "
                "time users feel while streaming. A larger batch raises it; a smaller token budget "
                "lowers it at the cost of throughput. No rule uses it directly.",
                12,
            )
            .targets(p50_p99(V.INTER_TOKEN_LATENCY))
            .unit("s")
        )

    def queue(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Queue depth",
                "Requests waiting to be scheduled (including preempted ones) and running, from "
                "the collector inside the scheduler. "
                + n.note(
                    "VllmEngineStalled",
                    "fires when requests waited for the whole {window} while no token was "
                    "scheduled (a flat line of waiting requests with the steps panel at 0), "
                    "for {for}",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.REQUESTS_WAITING), "waiting " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.REQUESTS_RUNNING), "running " + ENGINE_LEGEND))
        )

    def heartbeat(self, width: int = 12) -> Graph:
        n = self.n
        by_reason = Q.BY_ENGINE.removesuffix(")") + ", reason)"
        return (
            Graph(
                "Scheduler heartbeat",
                f"{M.LAST_STEP_AGE.help} Below it, the stall reason while one holds: "
                f"{M.ENGINE_STALL_REASON.help} "
                + n.note(
                    "VllmEngineStuck",
                    "fires when the collector says stalled (or, without it, vLLM's token "
                    "counters stood still for {window} while its gauges said requests run or "
                    "wait), for {for}; the runbook drains the engine at its router",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.LAST_STEP_AGE), "step age " + ENGINE_LEGEND))
            .with_target(
                prom(
                    f"max {by_reason} ({Q.selector(M.ENGINE_STALL_REASON)}) > 0",
                    "stalled: {{reason}} " + ENGINE_LEGEND,
                )
            )
            .with_target(prom(Q.gauge(M.ENGINE_STALLED), "stalled " + ENGINE_LEGEND))
            .unit("s")
        )

    def tier_waiting(self, width: int = 8) -> Graph:
        n = self.n
        return (
            Graph(
                "Waiting per tier (hot / warm / cold)",
                f"{M.TIER_REQUESTS_WAITING.help} "
                + n.note(
                    "VllmHotPathBacklog",
                    "fires when more than {threshold} hot requests wait (dashed line), for {for}",
                ),
                width,
            )
            .with_target(prom(Q.per_tier(M.TIER_REQUESTS_WAITING), "{{tier}} " + ENGINE_LEGEND))
            .min(0)
            .rule_lines(n.threshold("VllmHotPathBacklog", color="orange"))
        )

    def tier_running(self, width: int = 8) -> Graph:
        return (
            Graph(
                "Running per tier",
                f"{M.TIER_REQUESTS_RUNNING.help} Under the tiered policy a tier at its "
                "admission limit admits no more while another tier waits.",
                width,
            )
            .with_target(prom(Q.per_tier(M.TIER_REQUESTS_RUNNING), "{{tier}} " + ENGINE_LEGEND))
            .min(0)
        )

    def tier_oldest_waiting(self, width: int = 8) -> Graph:
        n = self.n
        return (
            Graph(
                "Oldest waiting per tier",
                f"{M.TIER_OLDEST_WAITING.help} Under the tiered policy a request moves up a "
                "tier for every aging period it waits (default 30 s). "
                + n.note(
                    "VllmRequestStarvation",
                    "fires when one has waited more than {threshold_seconds} s (dashed line), "
                    "for {for}",
                ),
                width,
            )
            .with_target(prom(Q.per_tier(M.TIER_OLDEST_WAITING), "{{tier}} " + ENGINE_LEGEND))
            .unit("s")
            .min(0)
            .rule_lines(n.threshold("VllmRequestStarvation", "threshold_seconds"))
        )

    def tier_queue_time(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Queue time to first schedule per tier (P50 / P99)",
                f"{M.TIER_QUEUE_SECONDS.help} The priority queue's wait time per path that the "
                "field reports watch: the tiered policy keeps the hot tier's low.",
                width,
            )
            .targets(
                [
                    prom(
                        quantile(q, M.TIER_QUEUE_SECONDS, by=(*ENGINE_LABELS, "tier")),
                        f"p{int(q * 100)} {{{{tier}}}} " + ENGINE_LEGEND,
                    )
                    for q in (0.5, 0.99)
                ]
            )
            .unit("s")
            .min(0)
        )

    def tier_deadlines(self, width: int = 12) -> Graph:
        by_tier = Q.BY_ENGINE.removesuffix(")") + ", tier)"
        return (
            Graph(
                "Tier deadlines missed (demoted / aborted per second)",
                f"{M.TIER_DEADLINE_DEMOTIONS.help} {M.TIER_DEADLINE_ABORTS.help}",
                width,
            )
            .targets(
                [
                    prom(
                        f"sum {by_tier} ({Q.rate(spec)})",
                        f"{what} {{{{tier}}}} " + ENGINE_LEGEND,
                    )
                    for what, spec in (
                        ("demoted", M.TIER_DEADLINE_DEMOTIONS),
                        ("aborted", M.TIER_DEADLINE_ABORTS),
                    )
                ]
            )
            .min(0)
        )

    def oldest_waiting(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Oldest waiting request",
                f"{M.OLDEST_WAITING.help} vLLM's histograms record a request's queue time only "
                "once it is scheduled, so a starving request is invisible there; here it is a "
                "line that climbs (e.g. low-priority requests behind a high-priority stream). "
                "latency-spike switches to FCFS and verifies that the waiting requests get in.",
                width,
            )
            .with_target(prom(Q.gauge(M.OLDEST_WAITING), ENGINE_LEGEND))
            .unit("s")
            .min(0)
        )

    def longest_sequence(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Longest sequence in the batch",
                f"{M.MAX_SEQUENCE_TOKENS.help} The field reports' first check for memory "
                "pressure (oom-pressure shows it before acting).",
                width,
            )
            .with_target(prom(Q.gauge(M.MAX_SEQUENCE_TOKENS), ENGINE_LEGEND))
            .min(0)
        )

    def finished_by_reason(self, width: int = 12) -> Graph:
        by_reason = Q.BY_ENGINE.removesuffix(")") + ", reason)"
        return (
            Graph(
                "Requests finished by reason",
                f"{M.REQUESTS_FINISHED.help} Per second, counted inside the engine (the "
                "error-rate runbook reads the recent reasons).",
                width,
            )
            .with_target(
                prom(
                    f"sum {by_reason} ({Q.rate(M.REQUESTS_FINISHED)})",
                    ENGINE_LEGEND + " {{reason}}",
                )
            )
            .unit("reqps")
            .min(0)
        )

    def request_times(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Queue and end-to-end time in the engine (P99)",
                "Per finished request, recorded at its finish by the collector: time from its "
                "arrival in the engine to its first schedule (queue) and to its finish (end to "
                "end). A request that never got scheduled counts its whole wait as queue time.",
                width,
            )
            .with_target(
                prom(Q.latency(0.99, M.REQUEST_QUEUE_SECONDS), "queue p99 " + ENGINE_LEGEND)
            )
            .with_target(prom(Q.latency(0.99, M.REQUEST_E2E_SECONDS), "e2e p99 " + ENGINE_LEGEND))
            .unit("s")
            .min(0)
        )

    def error_rate(self) -> Graph:
        n = self.n
        return (
            Graph(
                "Error rate",
                'Share of finished requests that ended with finished_reason="error" (vLLM\'s '
                "counter). "
                + n.note(
                    "VllmErrorRateHigh",
                    "fires when the share over {window} is above {threshold} (dashed line), "
                    "for {for}",
                ),
                12,
            )
            .with_target(prom(Q.error_ratio(), ENGINE_LEGEND))
            .unit("percentunit")
            .rule_lines(n.threshold("VllmErrorRateHigh", color="orange"))
        )

    def oom_rate(self) -> Graph:
        n = self.n
        return (
            Graph(
                "Preemptions per finished request (OOM rate)",
                "vLLM V1 answers KV cache exhaustion by preempting a request (its blocks are "
                "freed and it is recomputed later), so this is the engine's OOM rate. "
                + n.note(
                    "VllmOOMRateHigh",
                    "fires when it is above {threshold} over {window} (dashed line), for {for}",
                ),
                12,
            )
            .with_target(prom(Q.preemptions_per_finished_request(), ENGINE_LEGEND))
            .rule_lines(n.threshold("VllmOOMRateHigh", color="orange"))
        )

    def kv_usage(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "KV cache usage",
                M.KV_CACHE_USAGE.help
                + " "
                + n.note(
                    "VllmOOMPressure",
                    "fires when usage peaked at or above {kv_usage} (dashed line) within {window} "
                    "while requests were preempted, for {for}",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.KV_CACHE_USAGE), ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.KV_CACHE_USAGE_PEAK), ENGINE_LEGEND + " peak"))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(n.threshold("VllmOOMPressure", "kv_usage"))
        )

    def preemptions(self, width: int = 12) -> Graph:
        n = self.n
        return Graph(
            "Preemptions",
            M.PREEMPTIONS.help
            + " Per second. "
            + n.note(
                "VllmOOMPressure",
                "any preemption within {window} together with KV usage at or above {kv_usage}",
            )
            + " The oom-pressure runbook halves the token budget, then caps max_num_seqs.",
            width,
        ).with_target(prom(Q.sum_rate(M.PREEMPTIONS), ENGINE_LEGEND))

    def hit_ratio(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Prefix cache hit ratio",
                "Tokens found / looked up in the prefix cache at admission: the collector's "
                "sliding-window gauge, and the same ratio over the panel's rate interval. "
                "Empty (NaN) while nothing is looked up. "
                + n.note(
                    "VllmKVCacheHitRatioLow",
                    "fires when the gauge stays below {threshold} (dashed line) for {for}",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.KV_HIT_RATIO), "window " + ENGINE_LEGEND))
            .with_target(prom(Q.hit_ratio_over_rate_window(), "rate " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(n.threshold("VllmKVCacheHitRatioLow", below=True))
        )

    def fragmentation(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "KV block fragmentation",
                M.BLOCK_FRAGMENTATION.help
                + " "
                + n.note(
                    "VllmBlockFragmentationHigh",
                    "fires when its {window} average is above {threshold} (dashed line) for {for}; "
                    "the fix is a smaller block_size at the next restart",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.BLOCK_FRAGMENTATION), ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .rule_lines(n.threshold("VllmBlockFragmentationHigh", color="orange"))
        )

    def fragmentation_what_if(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Fragmentation at other block sizes (what-if)",
                M.BLOCK_FRAGMENTATION_AT.help
                + " The field reports sweep block_size until fragmentation is below 15 %; "
                "this is that sweep without a restart (block_size itself needs one).",
                width,
            )
            .with_target(
                prom(
                    f"max by ({', '.join((*ENGINE_LABELS, 'block_size'))}) "
                    f"({selector(M.BLOCK_FRAGMENTATION_AT)})",
                    "block {{block_size}} " + ENGINE_LEGEND,
                )
            )
            .unit("percentunit")
            .min(0)
            .max(1)
        )

    def kv_block_residency(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "KV block residency (vLLM's --kv-cache-metrics)",
                "Medians over the rate interval of vLLM's sampled KV blocks, observed when a "
                "block is evicted: its lifetime (allocation to eviction), its idle time before "
                "eviction (since its allocation or latest prefix-cache hit) and the gap between "
                "two prefix-cache hits on it. Empty unless vLLM runs with --kv-cache-metrics. "
                "The idle time is how long the cache keeps a block nobody uses: the field "
                "reports' block reuse needs a prefix still cached when it comes back. "
                + n.note(
                    "VllmKVCacheRetentionShort",
                    "fires when the idle time's median over {window} is below {idle_seconds} s "
                    "(dashed line) while blocks are reused, for {for}",
                ),
                width,
            )
            .targets(
                [
                    prom(Q.latency(0.5, V.KV_BLOCK_IDLE_BEFORE_EVICT), "idle " + ENGINE_LEGEND),
                    prom(Q.latency(0.5, V.KV_BLOCK_LIFETIME), "lifetime " + ENGINE_LEGEND),
                    prom(Q.latency(0.5, V.KV_BLOCK_REUSE_GAP), "reuse gap " + ENGINE_LEGEND),
                ]
            )
            .unit("s")
            .rule_lines(
                n.threshold("VllmKVCacheRetentionShort", "idle_seconds", color="orange", below=True)
            )
        )

    def kv_blocks(self) -> Graph:
        return (
            Graph(
                "KV blocks used / free",
                f"{M.KV_BLOCKS_USED.help} {M.KV_BLOCKS_FREE.help} The KV cache is sized at start "
                "and never grows: when free blocks run out, requests are preempted.",
                12,
            )
            .with_target(prom(Q.gauge(M.KV_BLOCKS_USED), "used " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.KV_BLOCKS_FREE), "free " + ENGINE_LEGEND))
        )

    def padding(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Padding and length padding",
                f"Padding: {M.PADDING_RATIO.help} Length padding: {M.LENGTH_PADDING_RATIO.help} "
                "The field reports' padding ratio is the length padding. "
                + n.note(
                    "VllmPaddingHigh",
                    "fires when length padding averages above {threshold} over {window} for {for}",
                    "warning",
                )
                + " "
                + n.note(
                    "VllmPaddingHigh",
                    "above {threshold} while the P99 rose by {latency_rise_pct} against {earlier} "
                    "earlier",
                    "critical",
                )
                + " "
                + n.note(
                    "VllmCudagraphPaddingHigh",
                    "fires when the CUDA graph padding averages above {threshold} over {window} "
                    "for {for} (never without graphs)",
                ),
                width,
            )
            .with_target(prom(Q.gauge(M.PADDING_RATIO), "padding " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.LENGTH_PADDING_RATIO), "length padding " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(
                n.threshold("VllmPaddingHigh", severity="warning", color="orange"),
                n.threshold("VllmPaddingHigh", severity="critical", color="red"),
            )
        )

    def spec_decode_acceptance(self, width: int = 12) -> Graph:
        n = self.n
        accepted, drafted = V.SPEC_DECODE_ACCEPTED_TOKENS, V.SPEC_DECODE_DRAFT_TOKENS
        return (
            Graph(
                "Speculative decoding acceptance",
                "Draft tokens the target model accepted / draft tokens proposed, over the rate "
                "interval (vLLM's spec-decode counters; empty without speculative decoding). "
                + n.note(
                    "VllmSpecDecodeAcceptanceLow",
                    "fires when it stays below {threshold} (the reports' draft-model overlap) "
                    "over {window} for {for}",
                    "info",
                )
                + " "
                + n.note(
                    "VllmSpecDecodeAcceptanceLow",
                    "below {threshold}, the reports' validator floor",
                    "warning",
                ),
                width,
            )
            .with_target(prom(f"{Q.sum_rate(accepted)} / {Q.sum_rate(drafted)}", ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(
                n.threshold(
                    "VllmSpecDecodeAcceptanceLow", severity="info", color="orange", below=True
                ),
                n.threshold(
                    "VllmSpecDecodeAcceptanceLow", severity="warning", color="red", below=True
                ),
            )
        )

    def schedule_time(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Schedule time",
                "Wall time of one scheduler.schedule() call: mean and P99 over the rate interval. "
                "It grows with the number of requests and blocks the scheduler walks. "
                + n.note(
                    "VllmKVFragmentationSuspected",
                    "fires when the mean over {window} rose by {schedule_rise_pct} against the "
                    "{baseline} that ended {window} + {for} earlier while generation "
                    "throughput fell by {throughput_fall_pct}, for {for}",
                ),
                width,
            )
            .with_target(prom(Q.mean_schedule_seconds(), "mean " + ENGINE_LEGEND))
            .with_target(prom(Q.latency(0.99, M.SCHEDULE_SECONDS), "p99 " + ENGINE_LEGEND))
            .unit("s")
        )

    def budget_fill(self, width: int = 12) -> Graph:
        n = self.n
        return (
            Graph(
                "Token budget fill",
                "Scheduled tokens / token budget offered (max_num_batched_tokens per step): over "
                "the rate interval, and for the latest step. "
                + n.note(
                    "VllmBatchUtilizationLow",
                    "fires when the fill over {window} is below {threshold} (dashed line) while "
                    "requests waited the whole time, for {for}",
                ),
                width,
            )
            .with_target(prom(Q.budget_fill_over_rate_window(), "rate " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.BUDGET_FILL), "latest step " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .rule_lines(n.threshold("VllmBatchUtilizationLow", color="orange", below=True))
        )

    def steps(self) -> Graph:
        return (
            Graph(
                "Scheduler steps and tokens per step",
                f"Steps per second ({M.STEPS.help}), tokens per step over the rate interval, "
                f"and the latest step's tokens ({M.STEP_TOKENS.help}). Tokens per step near the "
                "token budget means prefill-heavy steps; a few per running request means decode. "
                "No rule uses them directly.",
                12,
            )
            .with_target(prom(Q.sum_rate(M.STEPS), "steps/s " + ENGINE_LEGEND))
            .with_target(
                prom(
                    f"{Q.sum_rate(M.SCHEDULED_TOKENS)} / {Q.sum_rate(M.STEPS)}",
                    "tokens/step " + ENGINE_LEGEND,
                )
            )
            .with_target(prom(Q.gauge(M.STEP_TOKENS), "latest step " + ENGINE_LEGEND))
        )

    def executed_tokens(self) -> Graph:
        return (
            Graph(
                "Executed tokens: padded and unpadded",
                f"Tokens per second executed with padding ({M.PADDED_TOKENS.help}) and without "
                f"({M.UNPADDED_TOKENS.help}) The gap is the padding the padding ratio measures; "
                "the two lines coincide on CPU and in eager mode.",
                12,
            )
            .with_target(prom(Q.sum_rate(M.PADDED_TOKENS), "padded " + ENGINE_LEGEND))
            .with_target(prom(Q.sum_rate(M.UNPADDED_TOKENS), "unpadded " + ENGINE_LEGEND))
        )

    def token_budget_knob(self, width: int = 8) -> Graph:
        return (
            Graph(
                "Token budget (max_num_batched_tokens)",
                "The effective token budget per step and the value the engine started with (the "
                "ceiling: runbooks only lower it, then restore). A step down is a runbook "
                "(oom-pressure halves it) or an operator (`runbook set`).",
                width,
            )
            .with_target(prom(Q.gauge(M.MAX_NUM_BATCHED_TOKENS), "effective " + ENGINE_LEGEND))
            .with_target(
                prom(Q.gauge(M.STARTUP_MAX_NUM_BATCHED_TOKENS), "startup " + ENGINE_LEGEND)
            )
            .stepped()
        )

    def max_num_seqs_knob(self, width: int = 8) -> Graph:
        return (
            Graph(
                "Admission limit (max_num_seqs)",
                "The effective limit on running sequences and the startup value (the ceiling). "
                "oom-pressure caps it at what the KV cache holds, then hands it over to the "
                "autopilot (steps up and down while it is on); batch-too-large and kv-hit-low "
                "lower it. An engine whose autopilot is in advisory mode also draws the value "
                "it would set (nothing applied).",
                width,
            )
            .with_target(prom(Q.gauge(M.MAX_NUM_SEQS), "effective " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.STARTUP_MAX_NUM_SEQS), "startup " + ENGINE_LEGEND))
            .with_target(
                prom(Q.gauge(M.AUTOPILOT_ADVISED_MAX_NUM_SEQS), "autopilot advice " + ENGINE_LEGEND)
            )
            .stepped()
        )

    def autopilot(self, width: int = 12) -> Graph:
        return (
            Graph(
                "Autopilot (on/off, peak KV usage band)",
                f"{M.AUTOPILOT_ENABLED.help} While on, it keeps the peak KV cache usage between "
                "the target and the upper edge: it climbs max_num_seqs while requests wait "
                "below the target and cuts it on a preemption or a peak above the edge.",
                width,
            )
            .with_target(prom(Q.gauge(M.AUTOPILOT_ENABLED), "on " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.AUTOPILOT_KV_TARGET), "target " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.AUTOPILOT_KV_HIGH), "upper edge " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.KV_CACHE_USAGE_PEAK), "peak KV usage " + ENGINE_LEGEND))
            .min(0)
            .max(1)
            .stepped()
        )

    def autopilot_changes(self, width: int = 12) -> Graph:
        by = Q.BY_ENGINE.removesuffix(")") + ", direction)"
        return (
            Graph(
                "Autopilot changes of max_num_seqs",
                f"{M.AUTOPILOT_CHANGES.help} Counted over Grafana's rate interval (at least "
                "four scrapes: a shorter window can hold one sample and show nothing); the "
                "steps they make are on the admission limit panel beside.",
                width,
            )
            .with_target(
                prom(
                    f"sum {by} (increase({selector(M.AUTOPILOT_CHANGES)}[{Q.RATE}]))",
                    "{{direction}} " + ENGINE_LEGEND,
                )
            )
            .decimals(0)
            .bars()
        )

    def policy_knob(self, width: int = 8) -> Graph:
        by_policy = Q.BY_ENGINE.removesuffix(")") + ", policy)"
        return (
            Graph(
                "Scheduling policy",
                f"{M.SCHEDULER_POLICY.help} latency-spike switches to fcfs and restores the "
                "previous policy when the alert resolves.",
                width,
            )
            .with_target(
                prom(
                    f"max {by_policy} ({selector(M.SCHEDULER_POLICY)})",
                    "{{policy}} " + ENGINE_LEGEND,
                )
            )
            .min(0)
            .max(1)
            .decimals(0)
            .stepped()
        )

    def gpu_memory(self) -> Graph:
        n = self.n
        return (
            Graph(
                "GPU memory used / total",
                "Memory in use per GPU as a fraction of its total (NVML). "
                + n.note(
                    "VllmOOMPressure",
                    "fires when any GPU is at or above {gpu_memory} (dashed line)",
                )
                + " "
                + n.note(
                    "VllmGPUMemoryImbalance",
                    "fires when use differs by more than {threshold_pct} of the fullest GPU, "
                    "for {for}",
                )
                + " "
                + n.note(
                    "VllmGPUMemoryLeak",
                    "fires when memory in use grew by {growth_pct} against {earlier} earlier "
                    "while the load stayed flat",
                ),
                8,
            )
            .with_target(prom(Q.gpu_memory_fraction(), "GPU {{gpu}} " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(n.threshold("VllmOOMPressure", "gpu_memory"))
        )

    def gpu_memory_bytes(self) -> Graph:
        return (
            Graph(
                "GPU memory in use",
                f"{M.GPU_MEMORY_USED.help} A steady rise under flat load is what VllmGPUMemoryLeak "
                f"looks for (see the panel beside). Peak: {M.GPU_MEMORY_USED_PEAK.help}",
                8,
            )
            .with_target(prom(Q.per_gpu(M.GPU_MEMORY_USED), "GPU {{gpu}} " + ENGINE_LEGEND))
            .with_target(
                prom(Q.per_gpu(M.GPU_MEMORY_USED_PEAK), "peak GPU {{gpu}} " + ENGINE_LEGEND)
            )
            .unit("bytes")
        )

    def gpu_dram_utilization(self) -> Graph:
        return (
            Graph(
                "GPU memory bandwidth (DRAM busy)",
                f"{M.GPU_DRAM_UTILIZATION.help} The field reports saw DRAM bandwidth "
                "utilisation rise from 45 % to 78 % from batch 8 to 16, and only to 82 % at 32: "
                "near saturation a larger batch adds little throughput. No rule uses it.",
                8,
            )
            .with_target(prom(Q.per_gpu(M.GPU_DRAM_UTILIZATION), "GPU {{gpu}} " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
        )

    def gpu_utilization(self) -> Graph:
        n = self.n
        return (
            Graph(
                "GPU utilisation",
                f"{M.GPU_UTILIZATION.help} "
                + n.note(
                    "VllmGPUComputeSkew",
                    "fires when one GPU of an engine averages at least {high} over {window} while "
                    "another is at most {low} (dashed lines), for {for}",
                ),
                8,
            )
            .with_target(prom(Q.per_gpu(M.GPU_UTILIZATION), "GPU {{gpu}} " + ENGINE_LEGEND))
            .unit("percentunit")
            .min(0)
            .max(1)
            .rule_lines(
                n.threshold("VllmGPUComputeSkew", "low", color="orange"),
                n.threshold("VllmGPUComputeSkew", "high", color="red"),
            )
        )

    def engine_config(self) -> Any:
        labels = M.CONFIG_INFO_LABELS
        legend = " · ".join(f"{label} {{{{{label}}}}}" for label in labels)
        return table_panel(
            "Engine configuration",
            f"{M.ENGINE_CONFIG_INFO.help} One row per engine; what `runbook check` judges.",
            24,
            6,
        ).with_target(
            prom(
                f"max by ({', '.join((*ENGINE_LABELS, *labels))}) "
                f"({selector(M.ENGINE_CONFIG_INFO)})",
                "{{instance}} {{model_name}}/{{engine}}: " + legend,
                instant=True,
            )
        )

    def config_numbers(self) -> stat.Panel:
        return (
            stat_panel(
                "Configuration: KV cache and limits",
                f"Block size: {M.CONFIG_BLOCK_SIZE.help} KV blocks: {M.CONFIG_NUM_GPU_BLOCKS.help} "
                f"Memory: {M.CONFIG_GPU_MEMORY_UTILIZATION.help} Context: "
                f"{M.CONFIG_MAX_MODEL_LEN.help} Chunked prefill: {M.CONFIG_CHUNKED_PREFILL.help}",
                9,
            )
            .with_target(prom(Q.gauge(M.CONFIG_BLOCK_SIZE), "block size " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.CONFIG_NUM_GPU_BLOCKS), "KV blocks " + ENGINE_LEGEND))
            .with_target(
                prom(Q.gauge(M.CONFIG_GPU_MEMORY_UTILIZATION), "memory util " + ENGINE_LEGEND)
            )
            .with_target(prom(Q.gauge(M.CONFIG_MAX_MODEL_LEN), "max_model_len " + ENGINE_LEGEND))
            .with_target(
                prom(Q.gauge(M.CONFIG_CHUNKED_PREFILL), "chunked prefill " + ENGINE_LEGEND)
            )
        )

    def config_sm_count(self) -> stat.Panel:
        return stat_panel(
            "GPU SMs",
            f"GPU-only: {M.CONFIG_GPU_SM_COUNT.help} (no data on a CPU engine).",
            3,
        ).with_target(prom(Q.gauge(M.CONFIG_GPU_SM_COUNT), "SMs " + ENGINE_LEGEND))

    def gpu_hardware(self) -> Any:
        labels = ("gpu", *M.GPU_HARDWARE_LABELS)
        legend = " · ".join(f"{label} {{{{{label}}}}}" for label in labels)
        return table_panel(
            "GPU hardware",
            f"GPU-only: {M.GPU_HARDWARE_INFO.help} One row per GPU; `runbook check`'s "
            "hardware line warns at compute capability 7.5 (Turing) or lower and at a link "
            "of PCIe 3.0 or lower (the field reports' hardware limits).",
            12,
        ).with_target(
            prom(
                f"max by ({', '.join((*ENGINE_LABELS, *labels))}) "
                f"({selector(M.GPU_HARDWARE_INFO)})",
                "{{instance}} {{model_name}}/{{engine}}: " + legend,
                instant=True,
            )
        )

    def request_lengths(self) -> Graph:
        return (
            Graph(
                "Prompt and output lengths P10 / P50 / P90",
                "vLLM's own per-request histograms (vllm:request_prompt_tokens, "
                "vllm:request_generation_tokens) over the rate interval, in tokens; "
                "interpolated inside vLLM's 1-2-5 buckets.",
                12,
            )
            .with_target(
                prom(quantile(0.1, V.REQUEST_PROMPT_TOKENS), "prompt P10 " + ENGINE_LEGEND)
            )
            .with_target(
                prom(quantile(0.5, V.REQUEST_PROMPT_TOKENS), "prompt P50 " + ENGINE_LEGEND)
            )
            .with_target(
                prom(quantile(0.9, V.REQUEST_PROMPT_TOKENS), "prompt P90 " + ENGINE_LEGEND)
            )
            .with_target(
                prom(quantile(0.5, V.REQUEST_GENERATION_TOKENS), "output P50 " + ENGINE_LEGEND)
            )
            .with_target(
                prom(quantile(0.9, V.REQUEST_GENERATION_TOKENS), "output P90 " + ENGINE_LEGEND)
            )
            .unit("none")
        )

    def length_spread(self) -> Graph:
        return (
            Graph(
                "Prompt length spread and long prompts",
                f"Spread: {M.PROMPT_LENGTH_SPREAD.help} Long: {M.LONG_PROMPT_RATIO.help} "
                "Exact from the engine's arrivals (vLLM's buckets are too coarse for a ratio).",
                12,
            )
            .with_target(prom(Q.gauge(M.PROMPT_LENGTH_SPREAD), "P90/P10 " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.LONG_PROMPT_RATIO), "share > 8k " + ENGINE_LEGEND))
            .min(0)
        )

    def agent_health(self) -> Graph:
        return (
            Graph(
                "Agent health", f"collector_up: {M.COLLECTOR_UP.help} nvml_up: {M.NVML_UP.help}", 12
            )
            .with_target(prom(Q.gauge(M.COLLECTOR_UP), "collector " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.NVML_UP), "nvml " + ENGINE_LEGEND))
            .min(0)
            .max(1)
            .decimals(0)
            .stepped()
        )

    def warmup(self) -> Graph:
        n = self.n
        return (
            Graph(
                "Warm-up at engine start",
                "Progress of the collector's warm-up before the engine reports ready "
                f"(VLLM_RUNBOOK_WARMUP; zeros when off): requests done of planned "
                f"({M.WARMUP_REQUESTS_DONE.help}), steps ({M.WARMUP_STEPS.help}), tokens "
                f"({M.WARMUP_TOKENS.help}), seconds ({M.WARMUP_SECONDS.help}) and done "
                f"({M.WARMUP_DONE.help}) "
                + n.note(
                    "VllmInsufficientWarmup",
                    "fires only while done is 0",
                ),
                12,
            )
            .with_target(prom(Q.gauge(M.WARMUP_REQUESTS_PLANNED), "planned " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.WARMUP_REQUESTS_DONE), "done " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.WARMUP_STEPS), "steps " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.WARMUP_TOKENS), "tokens " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.WARMUP_SECONDS), "seconds " + ENGINE_LEGEND))
            .with_target(prom(Q.gauge(M.WARMUP_DONE), "warmed up " + ENGINE_LEGEND))
            .min(0)
        )

    def uptime(self) -> stat.Panel:
        n = self.n
        return (
            stat_panel(
                "Engine uptime",
                "Time since the engine's scheduler started. "
                + n.note(
                    "VllmInsufficientWarmup",
                    "only looks at the first {warmup}",
                ),
                12,
            )
            .with_target(prom(f"time() - {Q.gauge(M.ENGINE_START_TIME)}", ENGINE_LEGEND))
            .unit("s")
        )


def engine_overview(notes: Q.RuleNotes) -> dict[str, Any]:
    p = Panels(notes)
    return dashboard(
        uid=ENGINE_UID,
        title="vLLM engine overview",
        description="One engine (or a few) in depth: vLLM's throughput and latency, the "
        "collector's scheduler and KV cache signals, the effective knobs, GPUs.",
        variables=variables(),
        annotations=[*runbook_annotations(), *finding_annotations(notes)],
        rows=[
            (
                "Throughput and latency",
                [
                    p.throughput(),
                    p.e2e_latency(),
                    p.ttft(),
                    p.inter_token(),
                    p.queue(),
                    p.heartbeat(),
                    p.oldest_waiting(),
                    p.error_rate(),
                    p.finished_by_reason(),
                    p.request_times(),
                ],
            ),
            (
                "Tiers: hot < 256 prompt tokens, warm < 1,024, cold (any policy)",
                [
                    p.tier_waiting(),
                    p.tier_running(),
                    p.tier_oldest_waiting(),
                    p.tier_queue_time(),
                    p.tier_deadlines(),
                ],
            ),
            (
                "KV cache",
                [
                    p.kv_usage(),
                    p.preemptions(),
                    p.hit_ratio(),
                    p.fragmentation(),
                    p.fragmentation_what_if(),
                    p.kv_block_residency(),
                    p.kv_blocks(),
                    p.oom_rate(),
                    p.longest_sequence(),
                ],
            ),
            (
                "Batching and scheduling",
                [p.padding(), p.schedule_time(), p.budget_fill(), p.steps(), p.executed_tokens()],
            ),
            ("Speculative decoding (empty without it)", [p.spec_decode_acceptance(24)]),
            (
                "Knobs (effective values: a runbook's change is a step)",
                [
                    p.token_budget_knob(),
                    p.max_num_seqs_knob(),
                    p.policy_knob(),
                    p.autopilot(),
                    p.autopilot_changes(),
                ],
            ),
            (
                "GPUs (GPU-only: empty without an NVIDIA GPU)",
                [
                    p.gpu_memory(),
                    p.gpu_memory_bytes(),
                    p.gpu_utilization(),
                    p.gpu_dram_utilization(),
                ],
            ),
            (
                "Configuration and workload (as the engine resolved and sees them)",
                [
                    p.engine_config(),
                    p.config_numbers(),
                    p.config_sm_count(),
                    p.gpu_hardware(),
                    p.request_lengths(),
                    p.length_spread(),
                ],
            ),
            ("Agent", [p.agent_health(), p.uptime(), p.warmup()]),
        ],
    )


def _top(title: str, description: str, expr: str, unit: str, line: Threshold) -> bargauge.Panel:
    return (
        bar_gauge(title, description, 6)
        .with_target(prom(expr, instant=True))
        .unit(unit)
        .thresholds(thresholds(line))
    )


def fleet(notes: Q.RuleNotes) -> dict[str, Any]:
    p = Panels(notes)
    n = notes
    frag_window = str(n.param("VllmBlockFragmentationHigh", "window"))
    latency_window = str(n.param("VllmLatencySpike", "window"))
    firing = S.INCIDENTS_FIRING.name
    average_fragmentation = Q.over_time("avg", M.BLOCK_FRAGMENTATION, frag_window)
    top_fragmentation = (
        _top(
            f"Top {TOP_N}: block fragmentation",
            f"The engines with the highest KV block fragmentation averaged over {frag_window}, as "
            "the rule computes it. "
            + n.note("VllmBlockFragmentationHigh", "fires above {threshold} for {for}"),
            f"topk({TOP_N}, {Q.per_engine(average_fragmentation)})",
            "percentunit",
            n.threshold("VllmBlockFragmentationHigh", color="orange"),
        )
        .min(0)
        .max(1)
    )
    lowest_hit = (
        _top(
            f"Bottom {TOP_N}: prefix cache hit ratio",
            "The engines with the lowest prefix cache hit ratio (collector's window gauge). "
            + n.note("VllmKVCacheHitRatioLow", "fires below {threshold} for {for}"),
            f"bottomk({TOP_N}, {Q.gauge(M.KV_HIT_RATIO)})",
            "percentunit",
            n.threshold("VllmKVCacheHitRatioLow", below=True),
        )
        .min(0)
        .max(1)
    )
    top_latency = _top(
        f"Top {TOP_N}: P99 end-to-end latency",
        f"The engines with the highest P99 end-to-end latency over {latency_window}, as the "
        "rule computes it. " + n.note("VllmLatencySpike", "uses an SLA of {p99_sla_seconds} s"),
        f"topk({TOP_N}, {Q.latency(0.99, V.E2E_REQUEST_LATENCY, latency_window)})",
        "s",
        n.threshold("VllmLatencySpike", "p99_sla_seconds"),
    )
    top_kv = (
        _top(
            f"Top {TOP_N}: KV cache usage",
            "The engines closest to KV exhaustion now. "
            + n.note("VllmOOMPressure", "fires at {kv_usage} with preemptions"),
            f"topk({TOP_N}, {Q.gauge(M.KV_CACHE_USAGE)})",
            "percentunit",
            n.threshold("VllmOOMPressure", "kv_usage"),
        )
        .min(0)
        .max(1)
    )
    return dashboard(
        uid=FLEET_UID,
        title="vLLM fleet",
        description="Every engine side by side: what fires, which engines are worst, and "
        "the engine signals across engines.",
        variables=variables(),
        annotations=runbook_annotations(),
        rows=[
            (
                "Now",
                [
                    bar_gauge(
                        "Firing incidents",
                        "Incidents firing now by alert name, as runbook serve knows them (from "
                        "Alertmanager's webhooks or its embedded rules engine); red from 1.",
                        8,
                    )
                    .with_target(prom(f"sum by (alert) ({firing})", "{{alert}}", instant=True))
                    .decimals(0)
                    .thresholds(thresholds(Threshold(1, "red"))),
                    stat_panel(
                        "Engines",
                        "Engines reporting (agents scraped) and engines whose collector hook "
                        "works (collector_up = 1).",
                        5,
                    )
                    .with_target(prom(f"count({selector(M.COLLECTOR_UP)})", "reporting"))
                    .with_target(prom(f"sum({selector(M.COLLECTOR_UP)})", "hook working"))
                    .decimals(0),
                    stat_panel(
                        "Requests", "Requests running and waiting over all selected engines.", 5
                    )
                    .with_target(prom(f"sum({selector(M.REQUESTS_RUNNING)})", "running"))
                    .with_target(prom(f"sum({selector(M.REQUESTS_WAITING)})", "waiting"))
                    .decimals(0),
                    stat_panel(
                        "Generation throughput",
                        "Tokens per second generated by all selected engines.",
                        6,
                    ).with_target(prom(f"sum({Q.generation_throughput()})", "tokens/s")),
                ],
            ),
            ("Worst engines", [top_fragmentation, lowest_hit, top_latency, top_kv]),
            ("SLOs", slo_row()),
            (
                "Across engines",
                [
                    p.throughput(8),
                    p.e2e_latency(8),
                    p.queue(8),
                    p.oldest_waiting(8),
                    p.kv_usage(8),
                    p.preemptions(8),
                    p.hit_ratio(8),
                    p.fragmentation(8),
                    p.budget_fill(8),
                    p.padding(8),
                    p.schedule_time(8),
                    p.token_budget_knob(8),
                    p.max_num_seqs_knob(8),
                ],
            ),
        ],
    )


def slo_row() -> list[Builder[Any]]:
    """The configuration's SLOs (rules/slo.py's records and alerts, where Prometheus
    loads `runbook rules export --config` with `slos:`): budget left, burn rates,
    the burn-rate alerts firing."""
    legend = "{{slo}} {{instance}}"
    colors = ("red", "orange", "yellow", "blue")
    pairs = [Threshold(p.factor, color) for p, color in zip(SLO_PAIRS, colors, strict=True)]
    firing = [("alertname", f"{SLO_ALERT_PREFIX}_.*"), ("alertstate", "firing")]
    alerts = selector(V.ALERTS, matchers=firing)
    budget_left = f"min by (slo, {ENGINE_LABELS_TEXT}) ({selector(V.SLO_BUDGET_LEFT)})"
    burn_rate = f"max by (slo, window, {ENGINE_LABELS_TEXT}) ({selector(V.SLO_BURN_RATE)})"
    return [
        bar_gauge(
            "SLO error budget left",
            "Per SLO and engine: the share of the error budget of the SLO's window (30 days by "
            "default) not yet spent; red below 0 (overspent), orange below 0.25. From "
            "the recording rules of the configuration's slos: (runbook rules export --config).",
            8,
        )
        .with_target(prom(budget_left, legend, instant=True))
        .unit("percentunit")
        .max(1)
        .thresholds(bands("red", (0, "orange"), (0.25, "green"))),
        Graph(
            "SLO burn rates",
            "Per SLO and engine: the error ratio over each burn-rate pair's long window (1h, "
            "6h, 1d, 3d) divided by the error budget; 1 spends the budget exactly over the "
            "window. The lines: the pairs' factors (14.4 and 6 page, 3 and 1 open a ticket), "
            "each firing when its short window burns as fast too.",
            10,
        )
        .with_target(prom(burn_rate, "{{slo}} {{window}} {{instance}}"))
        .rule_lines(*pairs),
        bar_gauge(
            "SLO burn-rate alerts firing",
            "The SLO burn-rate alerts firing now, by alert (VllmSloBurn_<slo>_<long window>), "
            "from Prometheus' ALERTS; red from 1, empty while every SLO burns slower than its "
            "pairs.",
            6,
        )
        .with_target(prom(f"count by (alertname) ({alerts})", "{{alertname}}", instant=True))
        .decimals(0)
        .thresholds(thresholds(Threshold(1, "red"))),
    ]


def runbook_activity(notes: Q.RuleNotes) -> dict[str, Any]:
    p = Panels(notes)
    executions = S.EXECUTIONS.series_name
    undone = "|".join(
        (ExecutionStatus.REVERTED, ExecutionStatus.ROLLED_BACK, ExecutionStatus.REFUSED)
    )
    in_range = increase(executions, "$__range", "runbook, status")
    return dashboard(
        uid=ACTIVITY_UID,
        title="vLLM runbook activity",
        description="What runbook serve did: executions and their outcome, how fast it acted, "
        "what it changed on which engine, and the alerts and webhooks behind it.",
        variables=variables(),
        annotations=runbook_annotations(),
        rows=[
            (
                "Executions",
                [
                    Graph(
                        "Executions by runbook and status",
                        "Runbook executions reaching a status per interval (succeeded, failed, "
                        "rolled_back, reverted, refused, ...), stacked.",
                        16,
                    )
                    .with_target(
                        prom(
                            events(executions, "$__interval", "runbook, status"),
                            "{{runbook}} {{status}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                    table_panel(
                        "Executions in the time range",
                        "Executions per runbook and status over the dashboard's time range.",
                        8,
                    ).with_target(
                        prom(
                            f"round({in_range}) > 0",
                            "{{runbook}} {{status}}",
                            instant=True,
                        )
                    ),
                    Graph(
                        "Reverts, rollbacks and refusals",
                        f"{ExecutionStatus.ROLLED_BACK}: the circuit breaker undid a runbook's "
                        "change because errors or OOMs got worse after it. "
                        f"{ExecutionStatus.REVERTED}: the change was undone when the alert "
                        f"resolved or by `runbook revert`. {ExecutionStatus.REFUSED}: a "
                        "guardrail (cooldown, max runs per hour, blast radius, approval) "
                        "said no.",
                        12,
                    )
                    .with_target(
                        prom(
                            events(
                                f'{executions}{{status=~"{undone}"}}',
                                "$__interval",
                                "runbook, status",
                            ),
                            "{{runbook}} {{status}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                    Graph(
                        "Detection to action P50 / P99",
                        f"{S.DETECTION_TO_ACTION.help} startsAt is when the rule fired (after "
                        "its `for`), so this is Alertmanager's grouping wait, the delivery and "
                        "the runbook's checks.",
                        12,
                    )
                    .targets(
                        [
                            prom(
                                # >= 0 drops the NaN of runbooks that did not act in the window.
                                quantile(q, S.DETECTION_TO_ACTION, by=("runbook",), engine=False)
                                + " >= 0",
                                f"p{round(q * 100)} {{{{runbook}}}}",
                            )
                            for q in (0.5, 0.99)
                        ]
                    )
                    .unit("s"),
                ],
            ),
            (
                "What changed on the engines",
                [
                    Graph("Knob changes by engine and knob", S.KNOB_CHANGES.help, 12)
                    .with_target(
                        prom(
                            events(S.KNOB_CHANGES.series_name, "$__interval", "engine, knob"),
                            "{{engine}} {{knob}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                    Graph("Circuit breaker trips by engine and reason", S.BREAKER_TRIPS.help, 12)
                    .with_target(
                        prom(
                            events(S.BREAKER_TRIPS.series_name, "$__interval", "engine, reason"),
                            "{{engine}} {{reason}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                    Graph(
                        "Fixes holding after their alert resolved",
                        S.EXECUTIONS_HOLDING.help,
                        12,
                    )
                    .with_target(
                        prom(
                            f"sum by (engine, runbook) ({S.EXECUTIONS_HOLDING.name})",
                            "{{engine}} {{runbook}}",
                        )
                    )
                    .decimals(0)
                    .min(0),
                    Graph("Premature reverts (re-applied)", S.REVERTS_PREMATURE.help, 12)
                    .with_target(
                        prom(
                            events(
                                S.REVERTS_PREMATURE.series_name, "$__interval", "engine, runbook"
                            ),
                            "{{engine}} {{runbook}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                    p.policy_knob(12),
                    p.token_budget_knob(12),
                    p.max_num_seqs_knob(12),
                ],
            ),
            (
                "Alerts, webhooks and the rules engine",
                [
                    Graph("Firing incidents by alert", S.INCIDENTS_FIRING.help, 12)
                    .with_target(prom(f"sum by (alert) ({S.INCIDENTS_FIRING.name})", "{{alert}}"))
                    .decimals(0)
                    .stepped(),
                    Graph(
                        "Webhooks received and rejected",
                        f"Received: {S.WEBHOOKS_RECEIVED.help} Rejected: "
                        f"{S.WEBHOOKS_REJECTED.help} Per second.",
                        12,
                    )
                    .with_target(
                        prom(
                            service_rate(S.WEBHOOKS_RECEIVED, "status"),
                            "received {{status}}",
                        )
                    )
                    .with_target(
                        prom(
                            service_rate(S.WEBHOOKS_REJECTED, "reason"),
                            "rejected {{reason}}",
                        )
                    ),
                    Graph(
                        "Limits: alerts and requests refused, deliveries pruned",
                        f"Alerts: {S.ALERTS_REJECTED.help} Requests: {S.REQUESTS_REFUSED.help} "
                        f"Pruned: {S.WEBHOOK_EVENTS_PRUNED.help} "
                        f"Unmeasured: {S.DETECTION_TO_ACTION_UNMEASURED.help} Per second.",
                        24,
                    )
                    .with_target(
                        prom(
                            service_rate(S.ALERTS_REJECTED, "reason"),
                            "alerts rejected {{reason}}",
                        )
                    )
                    .with_target(
                        prom(
                            service_rate(S.DETECTION_TO_ACTION_UNMEASURED, "reason"),
                            "detection to action unmeasured {{reason}}",
                        )
                    )
                    .with_target(
                        prom(
                            service_rate(S.REQUESTS_REFUSED, "reason"),
                            "requests refused {{reason}}",
                        )
                    )
                    .with_target(
                        prom(
                            service_rate(S.WEBHOOK_EVENTS_PRUNED, "limit"),
                            "pruned {{limit}}",
                        )
                    ),
                    Graph("Rule evaluation time P50 / P99", S.RULE_EVALUATION.help, 12)
                    .targets(
                        [
                            prom(
                                quantile(q, S.RULE_EVALUATION, by=(), engine=False),
                                f"p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ]
                    )
                    .unit("s"),
                    Graph(
                        "Scrape errors by target", f"{S.SCRAPE_ERRORS.help} Per second.", 12
                    ).with_target(
                        prom(
                            service_rate(S.SCRAPE_ERRORS, "target"),
                            "{{target}}",
                        )
                    ),
                    Graph(
                        "Notifications by receiver",
                        f"{S.NOTIFICATIONS.help} A failed one is also in `runbook history ID` "
                        "and on the on-call page.",
                        12,
                    )
                    .with_target(
                        prom(
                            events(
                                S.NOTIFICATIONS.series_name,
                                "$__interval",
                                "receiver, outcome",
                            ),
                            "{{receiver}} {{outcome}}",
                        )
                    )
                    .decimals(0)
                    .bars(stacked=True),
                ],
            ),
            (
                "Is the rules leader keeping up?",
                [
                    Graph(
                        "Rules cycle time P50 / P99 against the interval",
                        f"{S.RULES_CYCLE.help} The interval line is "
                        f"{S.RULES_EVALUATION_INTERVAL.name}: a P99 approaching it means the "
                        "evaluator is about to fall behind (fewer engines per replica, a "
                        "longer interval, or the Prometheus rule export for the fleet).",
                        8,
                    )
                    .targets(
                        [
                            prom(
                                quantile(q, S.RULES_CYCLE, by=(), engine=False),
                                f"p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ]
                    )
                    .with_target(prom(f"max({S.RULES_EVALUATION_INTERVAL.name})", "interval"))
                    .unit("s"),
                    Graph(
                        f"Slowest scrape targets (top {TOP_N})",
                        f"{S.SCRAPE_DURATION.help} The cycle waits for its slowest "
                        "target, up to its deadline or grace (then the target is late).",
                        8,
                    )
                    .with_target(
                        prom(
                            f"topk({TOP_N}, max by (target) ({S.SCRAPE_DURATION.name}))",
                            "{{target}}",
                        )
                    )
                    .unit("s"),
                    Graph(
                        "Scrape targets backed off and late",
                        f"Backed off: {S.SCRAPE_TARGETS_BACKED_OFF.help} "
                        f"Late: {S.SCRAPE_TARGETS_LATE.help}",
                        8,
                    )
                    .with_target(prom(f"sum({S.SCRAPE_TARGETS_BACKED_OFF.name})", "backed off"))
                    .with_target(prom(f"sum({S.SCRAPE_TARGETS_LATE.name})", "late"))
                    .decimals(0)
                    .stepped(),
                ],
            ),
            (
                "Which engines does the service know?",
                [
                    Graph(
                        "Engines in the inventory, by source",
                        f"{S.ENGINES.help} Every replica holds the same inventory: the "
                        "largest is shown. A fleet that scales shows here without a "
                        "configuration change.",
                        12,
                    )
                    .with_target(prom(f"max by (source) ({S.ENGINES.name})", "{{source}}"))
                    .decimals(0)
                    .stepped(),
                    Graph(
                        "Discovery refresh failures",
                        f"{S.DISCOVERY_REFRESH_FAILURES.help} Per second. While a source "
                        "fails the service acts on the engines it found last.",
                        12,
                    ).with_target(
                        prom(service_rate(S.DISCOVERY_REFRESH_FAILURES, "source"), "{{source}}")
                    ),
                ],
            ),
        ],
    )


DASHBOARDS = {
    "engine-overview.json": engine_overview,
    "fleet.json": fleet,
    "runbook-activity.json": runbook_activity,
}
