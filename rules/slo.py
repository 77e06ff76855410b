"""Service-level objectives: the `slos:` section, their error ratios, and the
multi-window, multi-burn-rate alerts (four pairs, scaled to the SLO's window) in
both backends.

    slos:
      - name: ttft                 # letters, digits, _ (it names the alerts)
        objective: ttft            # ttft | e2e_latency | availability
        threshold: 1s              # latency objectives: a bucket boundary of vLLM's histogram
        target: 0.99               # the ratio of good requests
        window: 30d                # the error budget's window: 7d, 14d, 28d, 30d (default)
        model: llama-8b            # the engines serving this model (default: every engine)
        runbook: hot-path-backlog  # the page pairs hand off to it (`automation:` decides);
                                   # that execution verifies on `slo_burn_rate`
        buckets: [0.1, 0.5, 1, 5]  # the histogram's bounds, when vLLM's were changed

A latency objective counts a request as good when it falls in the bucket
``le=threshold`` of vLLM's histogram (``vllm:time_to_first_token_seconds``,
``vllm:e2e_request_latency_seconds``), so the threshold must be one of its
boundaries; vLLM 0.32's defaults are below (`VLLM_BUCKETS`), and an engine
started with ``--custom-histogram-buckets`` states its own with `buckets:`.
Availability counts a request as bad when vLLM finished it with
``finished_reason="error"`` (``vllm:request_success_total``; aborts by the
client and stop/length/repetition are served requests).

The error ratio over a window is one condition tree (`error_ratio`): the
Prometheus export renders it as recording rules (`RECORD_PREFIX` + ``rate1h``)
and alerts on the recorded series; the embedded evaluator compiles the same
tree. Each burn-rate pair is an alert: the error ratio over the long window
and over the short window both above ``factor x (1 - target)``; its value is
the long window's error ratio (both backends).

The embedded evaluator keeps the samples of the longest alert window (3 d for
30 days) and no more: the budget left over `window` (30 d) is read from
Prometheus (`runbook slo --prometheus URL`), where the export records it from
5-minute rates (`slo_rule_groups`). docs/rules.md ("Memory of the embedded
evaluator, and the 30-day window") gives the memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.durations import format_duration, parse_duration
from vllm_runbook.rules.errors import Problem
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.promql import PromQLRenderer, number
from vllm_runbook.rules.signals import ENGINE_LABELS, SIGNALS, Signal

Objective = Literal["ttft", "e2e_latency", "availability"]
DEFAULT_WINDOW = 30 * 86400.0
RECORD_PREFIX = "vllm_runbook:slo_error_ratio:rate"
# For dashboards: the share of the window's budget left, and the burn rate over
# each pair's long window (label `window`), per engine and SLO.
BUDGET_LEFT = "vllm_runbook:slo_budget_left:ratio"
BURN_RATE = "vllm_runbook:slo_burn_rate:ratio"
ALERT_PREFIX = "VllmSloBurn"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_DECIMAL = re.compile(r"^(\d+\.\d+|\.\d+)(ms|s)$")

# vLLM 0.32's default bucket bounds (vllm/v1/metrics/buckets.py:
# TIME_TO_FIRST_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS); a test compares them
# with the installed vLLM's.
VLLM_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "e2e_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
    ),
}  # fmt: skip
# The signal each objective reads (the one registry of series names).
SOURCE_SIGNALS: dict[str, str] = {
    "ttft": "time_to_first_token",
    "e2e_latency": "e2e_latency",
    "availability": "requests_finished",
}
ERROR_REASON = "error"


def series_of(objective: str) -> str:
    """The vLLM series (a histogram's base name, or the counter) an objective reads."""
    metric = SIGNALS[SOURCE_SIGNALS[objective]].metric
    assert metric is not None
    return metric


@dataclass(frozen=True)
class BurnPair:
    """One alert: the error budget burning at `factor` times the sustainable rate over
    both `long` and `short` (seconds); `notify` is how loud (page: critical)."""

    factor: float
    long: float
    short: float
    notify: Literal["page", "ticket"]

    @property
    def severity(self) -> str:
        return "critical" if self.notify == "page" else "warning"


# The four pairs for a 30-day window: Sloth's defaults (2 % of the budget in 1 h,
# 5 % in 6 h, 10 % in 1 d, 10 % in 3 d; factor = share x 30 d / long window); the
# SRE workbook's table ("Alerting on SLOs") has all but the 1 d / 2 h ticket.
BURN_PAIRS: tuple[BurnPair, ...] = (
    BurnPair(14.4, 3600.0, 300.0, "page"),
    BurnPair(6.0, 6 * 3600.0, 1800.0, "page"),
    BurnPair(3.0, 86400.0, 2 * 3600.0, "ticket"),
    BurnPair(1.0, 3 * 86400.0, 6 * 3600.0, "ticket"),
)
BASE_PERIOD = 30 * 86400.0  # the period BURN_PAIRS are set for
# The SLO windows (`window:`) the pairs are scaled to; any other is refused.
PERIODS: tuple[float, ...] = tuple(d * 86400.0 for d in (7, 14, 28, 30))
SHORTEST_WINDOW = 300.0  # a rate window of 5 m at least (several scrapes)
# Every window an error ratio is recorded over for a 30-day SLO (its own besides).
WINDOWS: tuple[float, ...] = tuple(sorted({w for p in BURN_PAIRS for w in (p.long, p.short)}))
# The budget group (the SLO window's error ratio, from 5-minute rates recorded each minute).
COUNT_WINDOW = 300.0
BUDGET_INTERVAL = 60.0
ERRORS_RECORD = "vllm_runbook:slo_errors:rate5m"
REQUESTS_RECORD = "vllm_runbook:slo_requests:rate5m"


def _scaled(seconds: float, scale: float) -> float:
    """A window of the 30-day table scaled to another period: to the whole minute
    (half up, as Go's Duration.Round in Pyrra), never below `SHORTEST_WINDOW`."""
    return max(SHORTEST_WINDOW, math.floor(seconds * scale / 60.0 + 0.5) * 60.0)


def burn_pairs(period: float) -> tuple[BurnPair, ...]:
    """The pairs for an SLO window of `period` seconds: the 30-day ones' windows scaled
    by period / 30 d as Pyrra scales its 28-day table (slo/rules.go, Windows), the
    factors kept, so each pair fires after the same share of the budget (2 %, 5 %,
    10 %, 10 %) whatever the period."""
    if period == BASE_PERIOD:
        return BURN_PAIRS
    scale = period / BASE_PERIOD
    return tuple(
        BurnPair(p.factor, _scaled(p.long, scale), _scaled(p.short, scale), p.notify)
        for p in BURN_PAIRS
    )


def windows(period: float) -> tuple[float, ...]:
    """Every window the pairs of an SLO window of `period` read (its own not included)."""
    return tuple(sorted({w for p in burn_pairs(period) for w in (p.long, p.short)}))


def clean(value: float) -> float:
    """`value` to 12 significant digits: 1 - 0.99 is 0.01, not 0.010000000000000009."""
    return float(f"{value:.12g}")


def span(seconds: float) -> str:
    """A window as Prometheus spells it, in days when whole (``30d``, ``1h``)."""
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{int(seconds // 86400)}d"
    return format_duration(seconds)


def _err(message: str) -> PydanticCustomError:
    return PydanticCustomError("phrase", message)


def _name(value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise _err(f"{value!r}: use lower-case letters, digits and _, starting with a letter")
    return value


def _seconds(value: object) -> float:
    """A threshold: a number (seconds) or a duration (``250ms``, ``1s``)."""
    decimal = _DECIMAL.match(value.strip()) if isinstance(value, str) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif decimal:  # 0.25s, 2.5s: a bucket bound is rarely a whole number of seconds
        seconds = float(decimal.group(1)) * (0.001 if decimal.group(2) == "ms" else 1.0)
    else:
        try:
            seconds = parse_duration(value)
        except Problem as exc:
            raise PydanticCustomError("detail", exc.message) from None
    if not seconds > 0 or math.isinf(seconds):
        raise _err("must be positive")
    return seconds


def _window(value: object, info: ValidationInfo) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "file" in (info.context or {}):
            raise PydanticCustomError("detail", f"give a unit, e.g. '{value}d'")
        seconds = float(value)
    else:
        try:
            seconds = parse_duration(value)
        except Problem as exc:
            raise PydanticCustomError("detail", exc.message) from None
    if seconds not in PERIODS:
        known = ", ".join(span(p) for p in PERIODS)
        raise PydanticCustomError(
            "detail",
            f"{span(seconds)} is not a supported SLO window: use one of {known} (the "
            "burn-rate windows are the 30-day ones scaled to it)",
        )
    return seconds


def _target(value: float) -> float:
    if not 0 < value < 1:
        raise _err(f"must be between 0 and 1 (a ratio of good requests, e.g. 0.99), got {value}")
    return value


def _buckets(value: object) -> tuple[float, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise _err("must be a list of bucket upper bounds (seconds)")
    if any(isinstance(v, bool) or not isinstance(v, int | float) or v <= 0 for v in value):
        raise _err(f"must be positive numbers (seconds), got {list(value)}")
    bounds = tuple(float(v) for v in value)
    if list(bounds) != sorted(set(bounds)):
        raise _err(f"must increase strictly, got {list(value)}")
    return bounds


def le_label(bound: float) -> str:
    """A bucket bound as prometheus_client writes it in ``le`` (Go's float format)."""
    from prometheus_client.utils import floatToGoString

    return str(floatToGoString(bound))


class SloSpec(BaseModel):
    """One objective, as written under `slos:`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, BeforeValidator(_name)]
    objective: Objective
    target: Annotated[float, AfterValidator(_target)]
    buckets: Annotated[tuple[float, ...], BeforeValidator(_buckets)] | None = None
    """The histogram's bounds (seconds) when the engines set their own."""
    threshold: Annotated[float, BeforeValidator(_seconds)] | None = Field(
        default=None, validate_default=True
    )
    """Seconds; latency objectives only: a bucket bound."""
    window: Annotated[float, BeforeValidator(_window)] = DEFAULT_WINDOW
    model: str | None = None
    runbook: str | None = None

    @field_validator("threshold", mode="after")
    @classmethod
    def _threshold_is_a_bound(cls, threshold: float | None, info: ValidationInfo) -> float | None:
        objective = info.data.get("objective")
        if objective is None:
            return threshold  # its own error is reported
        if objective == "availability":
            if threshold is not None:
                raise _err("is not used by an availability objective (it counts errors)")
            return None
        if threshold is None:
            raise PydanticCustomError("phrase", f"is needed by a {objective} objective")
        given = info.data.get("buckets")
        bounds = given or VLLM_BUCKETS[objective]
        if not any(math.isclose(threshold, b, rel_tol=1e-9) for b in bounds):
            below = [b for b in bounds if b < threshold]
            above = [b for b in bounds if b > threshold]
            near = " and ".join(
                f"{b:g} s" for b in ([below[-1]] if below else []) + ([above[0]] if above else [])
            )
            source = "the buckets given" if given else "vLLM's default buckets"
            raise PydanticCustomError(
                "detail",
                f"{threshold:g} s is not a bucket boundary of {series_of(objective)} "
                f"({source}); the nearest are {near} (an engine started with "
                "--custom-histogram-buckets: give its bounds under buckets:)",
            )
        return threshold

    @field_validator("runbook", mode="after")
    @classmethod
    def _known_runbook(cls, runbook: str | None, info: ValidationInfo) -> str | None:
        known = (info.context or {}).get("runbooks")
        if runbook is not None and known is not None and runbook not in known:
            raise PydanticCustomError(
                "detail", f"unknown runbook {runbook!r} (known: {', '.join(sorted(known))})"
            )
        return runbook

    @field_validator("buckets", mode="after")
    @classmethod
    def _buckets_of_latency(
        cls, buckets: tuple[float, ...] | None, info: ValidationInfo
    ) -> tuple[float, ...] | None:
        if buckets is not None and info.data.get("objective") == "availability":
            raise _err("is not used by an availability objective (it counts errors)")
        return buckets

    @property
    def bounds(self) -> tuple[float, ...]:
        return self.buckets or VLLM_BUCKETS.get(self.objective, ())

    @property
    def budget(self) -> float:
        """The error budget: the ratio of requests allowed to be bad."""
        return clean(1.0 - self.target)

    @property
    def pairs(self) -> tuple[BurnPair, ...]:
        """The burn-rate pairs, scaled to the SLO's window."""
        return burn_pairs(self.window)

    @property
    def le(self) -> str:
        """The ``le`` label of the good requests' bucket."""
        assert self.threshold is not None
        bound = next(b for b in self.bounds if math.isclose(self.threshold, b, rel_tol=1e-9))
        return le_label(bound)

    def describe(self) -> str:
        """The objective in words: ``99% of TTFT <= 1s over 30d``."""
        pct = f"{self.target * 100:g}%"
        what = {
            "ttft": f"of first tokens within {format_duration(self.threshold or 0)}",
            "e2e_latency": f"of requests done within {format_duration(self.threshold or 0)}",
            "availability": "of requests without an error",
        }[self.objective]
        scope = f" ({self.model})" if self.model else ""
        return f"{pct} {what} over {span(self.window)}{scope}"


def _unique(value: Any, handler: Any) -> tuple[SloSpec, ...]:
    """SLO names are unique (they name the alerts): the second use is the error."""
    errors: list[InitErrorDetails] = []
    seen: set[str] = set()
    for i, item in enumerate(value if isinstance(value, list | tuple) else ()):
        name = item.get("name") if isinstance(item, Mapping) else None
        if isinstance(name, str) and name in seen:
            dup = PydanticCustomError("phrase", f"{name!r}: an SLO of that name comes first")
            errors.append({"type": dup, "loc": (i, "name"), "input": name})
        if isinstance(name, str):
            seen.add(name)
    try:
        slos: tuple[SloSpec, ...] = handler(value)
    except ValidationError as exc:
        errors += [
            {"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": e["input"]}
            for e in exc.errors()
        ]
    if errors:
        raise ValidationError.from_exception_data("slos", errors)
    return slos


Slos = Annotated[tuple[SloSpec, ...], WrapValidator(_unique)]


# -- the error ratio, one tree for both backends ----------------------------------------


def _counter(metric: str) -> Signal:
    return Signal(metric, "counter", "requests", f"vLLM's {metric}", metric)


def error_rates(slo: SloSpec, window: float) -> tuple[C.Expr, C.Expr]:
    """(bad requests, all requests) per second over `window`, per engine."""
    scope: tuple[tuple[str, str], ...] = (("model_name", slo.model),) if slo.model else ()
    if slo.objective == "availability":
        finished = _counter(series_of("availability"))
        bad = C.Rate(C.Selector(finished, (("finished_reason", ERROR_REASON), *scope)), window)
        return bad, C.Rate(C.Selector(finished, scope), window)
    histogram = series_of(slo.objective)
    total = C.Rate(C.Selector(_counter(histogram + "_count"), scope), window)
    good = C.Rate(C.Selector(_counter(histogram + "_bucket"), (("le", slo.le), *scope)), window)
    return C.Difference(total, good), total


def error_ratio(slo: SloSpec, window: float) -> C.Expr:
    """Bad requests / all requests over `window`, per engine."""
    return C.Ratio(*error_rates(slo, window))


def alert_name(slo: SloSpec, pair: BurnPair) -> str:
    return f"{ALERT_PREFIX}_{slo.name}_{span(pair.long)}"


def burn_threshold(slo: SloSpec, pair: BurnPair) -> float:
    """The error ratio above which the budget burns at `pair.factor` times its rate."""
    return clean(pair.factor * slo.budget)


def _labels(slo: SloSpec, pair: BurnPair) -> dict[str, str]:
    return {
        "slo": slo.name,
        "long_window": span(pair.long),
        "short_window": span(pair.short),
        "burn_rate": number(pair.factor),
        "notify": pair.notify,
    }


def _texts(slo: SloSpec, pair: BurnPair) -> tuple[str, str]:
    summary = (
        f"SLO {slo.name} burns its error budget {number(pair.factor)}x too fast on "
        "{{ $labels.model_name }} engine {{ $labels.engine }}"
    )
    description = (
        f"Objective: {slo.describe()}. The error ratio over {span(pair.long)} "
        '({{ printf "%.4g" $value }}) and over ' + span(pair.short) + " are both "
        f"above {number(pair.factor)} x the budget {slo.budget:.4g}: at this rate the "
        f"{span(slo.window)} budget is gone in "
        f"{span(slo.window / pair.factor)}."
    )
    return summary, description


def slo_rules(slos: Sequence[SloSpec], *, file: str = "slos", line: int = 0) -> list[Rule]:
    """Every burn-rate pair of every SLO as a rule of the embedded evaluator.

    The page pairs of an SLO with `runbook` hand off to it (the fast burns);
    the ticket pairs run nothing."""
    rules: list[Rule] = []
    for slo in slos:
        for pair in slo.pairs:
            threshold = burn_threshold(slo, pair)
            condition = C.AllOf(
                (
                    C.Compare(error_ratio(slo, pair.long), ">", threshold),
                    C.Compare(error_ratio(slo, pair.short), ">", threshold),
                )
            )
            summary, description = _texts(slo, pair)
            rules.append(
                Rule(
                    alert=alert_name(slo, pair),
                    severity=pair.severity,
                    summary=summary,
                    description=description,
                    runbook=slo.runbook if pair.notify == "page" else None,
                    for_seconds=0.0,
                    labels=_labels(slo, pair),
                    params={"threshold": threshold},
                    condition=condition,
                    group="slo",
                    file=file,
                    line=line,
                )
            )
    return rules


def record_name(window: float) -> str:
    return RECORD_PREFIX + span(window)


def slo_rule_groups(
    slos: Sequence[SloSpec],
    *,
    runbook_url_base: str | None = None,
    annotations: bool = True,
    engine_labels: Sequence[str] = ENGINE_LABELS,
    budget_interval: float = BUDGET_INTERVAL,
) -> list[dict[str, object]]:
    """Two Prometheus rule groups per SLO.

    ``vllm-runbook-slo-<name>``: its error ratio recorded over every window of its
    burn pairs, the burn rates, then its four burn-rate alerts on those records (one
    group, so the alerts read the records of the same evaluation: a group's rules
    run in order).

    ``vllm-runbook-slo-<name>-budget`` (every `budget_interval`): the bad and all
    requests' 5-minute rates, the SLO window's error ratio as the ratio of their
    sums over the window (Sloth's ``sum_over_time`` of the 5 m record, weighted by
    requests), and the budget left: the window is read from two series recorded
    once a minute, not from the raw series at every evaluation."""
    render = PromQLRenderer(engine_labels)
    groups: list[dict[str, object]] = []
    for slo in slos:
        rules: list[dict[str, object]] = []
        pairs = slo.pairs
        labels = {"slo": slo.name}
        for window in windows(slo.window):
            rules.append(
                {
                    "record": record_name(window),
                    "expr": render.expr(error_ratio(slo, window)),
                    "labels": dict(labels),
                }
            )
        selector = f'{{slo="{slo.name}"}}'
        budget = number(slo.budget)
        for pair in pairs:
            rules.append(
                {
                    "record": BURN_RATE,
                    "expr": f"{record_name(pair.long)}{selector} / {budget}",
                    "labels": {"slo": slo.name, "window": span(pair.long)},
                }
            )
        for rule, pair in zip(slo_rules([slo]), pairs, strict=True):
            threshold = number(burn_threshold(slo, pair))
            expr = (
                f"{record_name(pair.long)}{selector} > {threshold}"
                f" and {record_name(pair.short)}{selector} > {threshold}"
            )
            out: dict[str, object] = {
                "alert": rule.alert,
                "expr": expr,
                "for": "0s",
                "labels": rule.alert_labels,
            }
            if annotations:
                notes = {"summary": rule.summary, "description": rule.description}
                if rule.runbook and runbook_url_base is not None:
                    notes["runbook_url"] = f"{runbook_url_base.rstrip('/')}/{rule.runbook}"
                out["annotations"] = notes
            rules.append(out)
        groups.append({"name": f"vllm-runbook-slo-{slo.name}", "rules": rules})
        bad, total = error_rates(slo, COUNT_WINDOW)
        period = span(slo.window)
        budget_rules: list[dict[str, object]] = [
            {"record": ERRORS_RECORD, "expr": render.expr(bad), "labels": dict(labels)},
            {"record": REQUESTS_RECORD, "expr": render.expr(total), "labels": dict(labels)},
            {
                "record": record_name(slo.window),
                "expr": f"sum_over_time({ERRORS_RECORD}{selector}[{period}])"
                f" / sum_over_time({REQUESTS_RECORD}{selector}[{period}])",
                "labels": dict(labels),
            },
            {
                "record": BUDGET_LEFT,
                "expr": f"1 - {record_name(slo.window)}{selector} / {budget}",
                "labels": dict(labels),
            },
        ]
        groups.append(
            {
                "name": f"vllm-runbook-slo-{slo.name}-budget",
                "interval": format_duration(budget_interval),
                "rules": budget_rules,
            }
        )
    return groups


# -- burn rates and the budget, for `runbook slo` --------------------------------------


@dataclass(frozen=True)
class SloStatus:
    """One SLO on one engine: error ratios by window, what they mean for the budget."""

    slo: SloSpec
    engine: Mapping[str, str]  # the engine labels
    error_ratios: Mapping[float, float | None]  # window -> ratio (None: no requests)

    def burn_rate(self, window: float) -> float | None:
        ratio = self.error_ratios.get(window)
        return None if ratio is None or math.isnan(ratio) else ratio / self.slo.budget

    @property
    def budget_left(self) -> float | None:
        """The share of the window's error budget not spent (negative: overspent)."""
        burn = self.burn_rate(self.slo.window)
        return None if burn is None else 1.0 - burn

    def firing(self) -> list[BurnPair]:
        """The pairs whose condition holds on these ratios (as both backends decide)."""
        out = []
        for pair in self.slo.pairs:
            limit = burn_threshold(self.slo, pair)
            long, short = self.error_ratios.get(pair.long), self.error_ratios.get(pair.short)
            if long is not None and short is not None and long > limit and short > limit:
                out.append(pair)
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "slo": self.slo.name,
            "objective": self.slo.describe(),
            "target": self.slo.target,
            "engine": dict(self.engine),
            "budget_left": self.budget_left,
            "error_ratio": {span(w): r for w, r in self.error_ratios.items()},
            "burn_rate": {span(w): self.burn_rate(w) for w in self.error_ratios},
            "firing": [
                {"alert": alert_name(self.slo, p), "severity": p.severity, "notify": p.notify}
                for p in self.firing()
            ],
        }


# -- the SLO an alert names, for the runbook it hands off to ----------------------------


def slo_of_alert(slos: Sequence[SloSpec], alertname: str) -> tuple[SloSpec, BurnPair] | None:
    """The SLO and burn pair of one of its alerts (`alert_name`), or None."""
    for slo in slos:
        for pair in slo.pairs:
            if alert_name(slo, pair) == alertname:
                return slo, pair
    return None


def slo_counts(slo: SloSpec, metrics_text: str) -> tuple[float, float] | None:
    """(bad, all) requests of `slo` so far, from vLLM's `/metrics` text (cumulative
    counters, summed over the engine's series of its model); None when the
    text has no such series. The burn rate between two readings is
    (Δbad / Δall) / (1 - target)."""
    from prometheus_client.parser import text_string_to_metric_families

    metric = series_of(slo.objective)
    if slo.objective == "availability":
        names = {metric, metric.removesuffix("_total") + "_total"}
    else:
        names = {metric + "_bucket", metric + "_count"}
    bad = total = good = 0.0
    seen = False
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name not in names:
                continue
            if slo.model is not None and sample.labels.get("model_name") != slo.model:
                continue
            if slo.objective == "availability":
                seen = True
                total += sample.value
                if sample.labels.get("finished_reason") == ERROR_REASON:
                    bad += sample.value
            elif sample.name.endswith("_count"):
                seen = True
                total += sample.value
            elif _same_bound(sample.labels.get("le"), slo):
                good += sample.value
    if not seen:
        return None
    return (bad if slo.objective == "availability" else total - good), total


def _same_bound(le: str | None, slo: SloSpec) -> bool:
    try:
        return le is not None and math.isclose(float(le), slo.threshold or 0.0, rel_tol=1e-9)
    except ValueError:
        return False
