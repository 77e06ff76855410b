"""A step's condition (`when:` and `acts_only_if:`) as text and as a test of a
value, and the verification an SLO's burn-rate alert asks for instead of the
runbook's own (its alert is named in the execution's `who`)."""

from __future__ import annotations

from collections.abc import Sequence
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
