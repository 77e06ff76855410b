"""The PromQL of each signal, shared by the dashboards, and the rules' thresholds.

A signal is queried the same way on the engine overview and on the fleet
view, so both are written once here. `RuleNotes` reads the rule catalog
(with its default parameters) so that a panel's description and threshold
line say what the rules actually compare, not a number copied by hand.
Plain strings and dataclasses: nothing here needs Grafana's SDK.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.metrics import MetricSpec
from vllm_runbook.dashboards import catalog as V
from vllm_runbook.rules import Rule, load_catalog
from vllm_runbook.rules.model import ParamValue
from vllm_runbook.rules.signals import ENGINE_LABELS

# Grafana multi-value variables become a regex alternation with `=~`.
ENGINE_MATCHERS: tuple[tuple[str, str], ...] = (
    ("model_name", "$model_name"),
    ("engine", "$engine"),
)
BY_ENGINE = f"by ({', '.join(ENGINE_LABELS)})"
ENGINE_LEGEND = "{{instance}} {{model_name}}/{{engine}}"
RATE = "$__rate_interval"


def selector(
    spec: MetricSpec,
    part: str = "",
    *,
    engine: bool = True,
    matchers: Sequence[tuple[str, str]] = (),
) -> str:
    """`name{model_name=~"$model_name", engine=~"$engine", ...}` for `spec`.

    `part` is a histogram's `_bucket`/`_sum`/`_count`; counters gain `_total`.
    `engine=False` leaves out the engine filter (the service's own metrics).
    """
    name = spec.name + part if part else spec.series_name
    pairs = [f'{k}=~"{v}"' for k, v in (ENGINE_MATCHERS if engine else ())]
    pairs += [f'{k}=~"{v}"' for k, v in matchers]
    return f"{name}{{{', '.join(pairs)}}}" if pairs else name


def rate(spec: MetricSpec, part: str = "", window: str = RATE, **kw: Any) -> str:
    return f"rate({selector(spec, part, **kw)}[{window}])"


def quantile(
    q: float,
    spec: MetricSpec,
    by: Sequence[str] = ENGINE_LABELS,
    window: str = RATE,
    **kw: Any,
) -> str:
    """The q-quantile of a histogram over `window`, per `by` (default: per engine)."""
    labels = ", ".join((*by, "le"))
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(spec, '_bucket', window, **kw)}))"


@dataclass(frozen=True)
class Threshold:
    """A value a rule compares against, drawn as a line across the panel."""

    value: float
    color: str = "red"
    # "above": the rule fires above the value (green below it); "below": the reverse.
    direction: Literal["above", "below"] = "above"


def per_engine(expr: str, agg: str = "max") -> str:
    return f"{agg} {BY_ENGINE} ({expr})"


def sum_rate(spec: M.MetricSpec, part: str = "", window: str = RATE, **kw: Any) -> str:
    return per_engine(rate(spec, part, window, **kw), "sum")


def over_time(fn: str, spec: M.MetricSpec, window: str) -> str:
    return f"{fn}_over_time({selector(spec)}[{window}])"


def gauge(spec: M.MetricSpec) -> str:
    return per_engine(selector(spec))


def per_tier(spec: M.MetricSpec) -> str:
    """A per-tier gauge, one series per engine and tier."""
    by_tier = BY_ENGINE.removesuffix(")") + ", tier)"
    return f"max {by_tier} ({selector(spec)})"


# --- throughput and latency (vLLM's own series) -----------------------------


def generation_throughput() -> str:
    return sum_rate(V.GENERATION_TOKENS)


def prompt_throughput() -> str:
    return sum_rate(V.PROMPT_TOKENS)


def latency(q: float, spec: M.MetricSpec, window: str = RATE) -> str:
    return quantile(q, spec, window=window)


def error_ratio() -> str:
    errors = sum_rate(V.REQUEST_SUCCESS, matchers=[("finished_reason", "error")])
    return f"{errors} / {sum_rate(V.REQUEST_SUCCESS)}"


def preemptions_per_finished_request() -> str:
    return f"{sum_rate(M.PREEMPTIONS)} / {sum_rate(V.REQUEST_SUCCESS)}"


# --- the collector's signals -------------------------------------------------


def hit_ratio_over_rate_window() -> str:
    return f"{sum_rate(M.PREFIX_CACHE_HITS)} / {sum_rate(M.PREFIX_CACHE_QUERIES)}"


def budget_fill_over_rate_window() -> str:
    return f"{sum_rate(M.SCHEDULED_TOKENS)} / {sum_rate(M.TOKEN_BUDGET)}"


def mean_schedule_seconds() -> str:
    return f"{sum_rate(M.SCHEDULE_SECONDS, '_sum')} / {sum_rate(M.SCHEDULE_SECONDS, '_count')}"


def gpu_memory_fraction() -> str:
    by_gpu = BY_ENGINE.removesuffix(")") + ", gpu)"
    used = f"max {by_gpu} ({selector(M.GPU_MEMORY_USED)})"
    total = f"max {by_gpu} ({selector(M.GPU_MEMORY_TOTAL)})"
    return f"{used} / {total}"


def per_gpu(spec: M.MetricSpec) -> str:
    return f"max {BY_ENGINE.removesuffix(')')}, gpu) ({selector(spec)})"


def knob_changes(window: str = "1m") -> str:
    """Where an effective knob changed: a runbook (or an operator) acted on the engine."""
    knobs = (M.MAX_NUM_BATCHED_TOKENS, M.MAX_NUM_SEQS, M.SCHEDULER_POLICY)
    parts = [f"{per_engine(f'changes({selector(k)}[{window}])')} > 0" for k in knobs]
    return " or ".join(parts)


# --- the rules' thresholds -----------------------------------------------------


def _fmt(value: ParamValue) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


class RuleNotes:
    """Thresholds and sentences about them, from the rule catalog's defaults."""

    def __init__(self, rules: Sequence[Rule] | None = None) -> None:
        rules = list(rules) if rules is not None else load_catalog().bind()
        self._by_key = {(r.alert, r.severity): r for r in rules}
        self._by_alert: dict[str, Rule] = {}
        for r in rules:
            self._by_alert.setdefault(r.alert, r)

    def rule(self, alert: str, severity: str | None = None) -> Rule:
        return self._by_key[(alert, severity)] if severity else self._by_alert[alert]

    def param(self, alert: str, name: str, severity: str | None = None) -> ParamValue:
        return self.rule(alert, severity).params[name]

    def number(self, alert: str, name: str, severity: str | None = None) -> float:
        value = self.param(alert, name, severity)
        assert isinstance(value, int | float), (alert, name, value)
        return float(value)

    def threshold(
        self,
        alert: str,
        name: str = "threshold",
        *,
        severity: str | None = None,
        color: str = "red",
        below: bool = False,
    ) -> Threshold:
        return Threshold(self.number(alert, name, severity), color, "below" if below else "above")

    def note(self, alert: str, text: str, severity: str | None = None) -> str:
        """`Rule <alert> (<severity>, runbook <rb>): <text with {param}s filled in>.`"""
        rule = self.rule(alert, severity)
        params = {k: _fmt(v) for k, v in rule.params.items()}
        # Relative changes (`by_at_least`) read better as percentages: {drop_pct} = "10%".
        params |= {
            f"{k}_pct": f"{v * 100:g}%"
            for k, v in rule.params.items()
            if isinstance(v, int | float)
        }
        acts = f"runbook {rule.runbook}" if rule.runbook else "diagnose only"
        return f"Rule {alert} ({rule.severity}, {acts}): {text.format(**params)}."
