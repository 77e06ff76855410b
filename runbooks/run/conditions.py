"""A step's condition (`when:` and `acts_only_if:`) as text and as a test of a
value, the verification an SLO's burn-rate alert asks for instead of the
runbook's own (its alert is named in the execution's `who`), and the span of
the alert's episode the checks read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from vllm_runbook.rules.slo import BurnPair, SloSpec, slo_of_alert
from vllm_runbook.runbooks.engine.sources import SLO_BURN_RATE
from vllm_runbook.runbooks.model.spec import Condition, Verification


def describe_condition(when: Condition) -> str:
    op, bound = (">", when.above) if when.above is not None else ("<", when.below)
    wait = f" after {when.after_seconds} s" if when.after_seconds else ""
    return f"{when.signal} {op} {bound:g}{wait}"


def holds(when: Condition, value: Any) -> bool:
    if when.above is not None:
        return bool(value > when.above)
    assert when.below is not None
    return bool(value < when.below)


def alert_name(who: str) -> str | None:
    """The alert that started an execution: its `who` is ``alertmanager:<alertname>``
    (the webhook) or ``rules:<alertname>`` (the embedded evaluator)."""
    source, _, alertname = who.partition(":")
    return alertname if source in ("alertmanager", "rules") and alertname else None


def episode_seconds(
    who: str,
    starts_at: datetime | None,
    for_seconds: Mapping[str, float],
    now: datetime,
) -> float | None:
    """The span the checks read the alert's episode over: from when its condition
    began to hold (startsAt minus the rule's `for`; 0 for an alert the rules do not
    know) to `now`. None without an alert: the collector's window. The agent widens
    a shorter span to its window and caps it at what it keeps."""
    alert = alert_name(who)
    if alert is None or starts_at is None:
        return None
    return max(0.0, (now - starts_at).total_seconds() + for_seconds.get(alert, 0.0))


def alert_slo(slos: Sequence[SloSpec], who: str) -> tuple[SloSpec, BurnPair] | None:
    """The SLO and burn pair whose alert started an execution: its `who` is
    ``alertmanager:<alertname>`` (the webhook) or ``rules:<alertname>`` (the
    embedded evaluator)."""
    source, _, alertname = who.partition(":")
    if source not in ("alertmanager", "rules"):
        return None
    return slo_of_alert(slos, alertname)


def slo_verification(v: Verification) -> Verification:
    """The runbook's verification judged on the SLO's burn rate: it must fall
    (by `improve_by` of the alert's rate); deadline, tolerance and guards stay."""
    return v.model_copy(
        update={"signal": SLO_BURN_RATE, "direction": "decrease", "effect": "relative"}
    )
