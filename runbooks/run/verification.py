"""Judging a change by what happened after it: the verification and the circuit breaker.

    report = measure(reader, spec.verification, baseline, from_step, ...)
    report["outcome"]  # improved | no measurable change | worse | unverified: why
    report["tripped"]  # the guard that got worse, or None

The before-value of a signal is what the executor read before the first
change (windowed signals over the collector's trailing window, which then
holds only time before the change). The after-value is read only from the
step the last change took effect at (the agent reports it; `/v1/state?
since_step=N` gives counter deltas and the requests finished since), over
the same length of time as the baseline window (or the deadline, when
shorter). A reading that predates the change never decides anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from vllm_runbook.rules.signals import READABLE
from vllm_runbook.runbooks.engine.sources import WINDOWED

IMPROVED: Final = "improved"
NO_CHANGE: Final = "no measurable change"
WORSE: Final = "worse"

# effect starving_served: the deadline is this many times the time the engine
# took, before the change, to admit as many requests as were starving; at least
# DRAIN_MIN_S, at most the runbook's deadline.
DRAIN_SLACK: Final = 3.0
DRAIN_MIN_S: Final = 10.0

# Signals where a higher value is worse (the circuit breaker's direction): the registry says.
HIGHER_IS_WORSE: Final = frozenset(n for n, s in READABLE.items() if s.higher_is_worse)


def judge(
    before: Any,
    after: Any,
    direction: str,
    *,
    improve_by: float,
    tolerance: float,
    effect: str = "relative",
) -> str:
    """improved / no measurable change / worse for one signal (both values read)."""
    if effect == "starving_served":
        # `before`: the requests starving at the change; `after`: those still waiting.
        return IMPROVED if float(before) > 0 and float(after) == 0 else NO_CHANGE
    sign = -1.0 if direction == "decrease" else 1.0
    move = sign * (float(after) - float(before))  # > 0: the expected way
    scale = abs(float(before))
    if scale == 0:
        # From zero no relative move exists: any move the wrong way is worse,
        # and nothing can improve a decreasing signal that is already 0.
        if move < 0:
            return WORSE
        return IMPROVED if move > 0 and direction == "increase" else NO_CHANGE
    if move >= improve_by * scale:
        return IMPROVED
    if -move > tolerance * scale:
        return WORSE
    return NO_CHANGE


def drain_deadline(deadline_s: float, starving: int, admitted_per_second: float | None) -> float:
    """The starving_served deadline: DRAIN_SLACK x the time the engine took, before
    the change, to admit `starving` requests; within [DRAIN_MIN_S, deadline_s]."""
    if not starving or not admitted_per_second:
        return deadline_s
    return min(deadline_s, max(DRAIN_MIN_S, DRAIN_SLACK * starving / admitted_per_second))


def guard_worse(signal: str, before: Any, after: Any, tolerance: float) -> bool:
    direction = "decrease" if signal in HIGHER_IS_WORSE else "increase"
    outcome = judge(before, after, direction, improve_by=1.0, tolerance=tolerance)
    return outcome == WORSE


def needed_text(signal: str, v: Any) -> str:
    """What "improved" means for this verification, in words."""
    if v.effect == "starving_served":
        return f"{signal} = 0 (every request starving at the change scheduled)"
    if v.direction == "decrease":
        return f"{signal} ≤ {1 - v.improve_by:.0%} of before"
    return f"{signal} ≥ {1 + v.improve_by:.0%} of before"


def _inconclusive(
    v: Any,
    before: Any,
    signals: Mapping[str, Any],
    baseline: Mapping[str, Any],
) -> bool:
    """No measurable change in the signal (both read) and no guard worse yet."""
    after = signals.get(v.signal)
    if before is None or after is None:
        return False
    outcome = judge(
        before, after, v.direction, improve_by=v.improve_by, tolerance=v.tolerance, effect=v.effect
    )
    if outcome != NO_CHANGE:
        return False
    return not any(
        baseline.get(g) is not None
        and signals.get(g) is not None
        and guard_worse(g, baseline[g], signals[g], v.tolerance)
        for g in v.rollback_if_worse
    )


def measure(
    read: Callable[[int | None], dict[str, Any]],
    unavailable: Callable[[], Mapping[str, str]],
    v: Any,
    baseline: Mapping[str, Any],
    baseline_unavailable: Mapping[str, str],
    from_step: int | None,
    *,
    deadline_s: float,
    window_s: float | None,
    clock: Callable[[], float],
    wait: Callable[[float], None],
    poll_s: float,
    change: Callable[[], Mapping[str, Any] | None],
    settled: Callable[[], bool] = lambda: True,
) -> dict[str, Any]:
    """Read after the change until the effect shows (instant signals) or the
    measurement period ends (windowed ones: the baseline's length, capped by
    the deadline); judge the signal and every guard on that last reading."""
    windowed = v.signal in WINDOWED or any(g in WINDOWED for g in v.rollback_if_worse)
    period = min(deadline_s, window_s) if windowed and window_s else deadline_s
    starving = v.effect == "starving_served"
    start = clock()
    before = baseline.get(v.signal)
    report: dict[str, Any] = {
        "signal": v.signal,
        "direction": v.direction,
        "effect": v.effect,
        "needed": needed_text(v.signal, v),
        "deadline_seconds": deadline_s,
        "measure_seconds": period,
        "from_step": from_step,
        "before": before,
        "after": None,
        "polls": 0,
    }
    signals: dict[str, Any] = {}
    in_effect_at: float | None = None
    while True:
        signals = read(from_step)
        report["polls"] += 1
        after = signals.get(v.signal)
        now = clock()
        facts = change() if starving else None
        if facts is not None and "drain" not in report:
            # Judged on the requests starving when the change took effect, within
            # a deadline that follows how fast the engine admitted requests then.
            before = report["before"] = facts["starving_at_change"]
            rate = facts["admitted_per_second_before"]
            period = deadline_s = drain_deadline(deadline_s, before, rate)
            report["deadline_seconds"] = report["measure_seconds"] = deadline_s
            report["drain"] = {
                "starving_at_change": before,
                "oldest_waited_seconds": facts["starving_oldest_seconds"],
                "admitted_per_second_before": rate,
            }
        if facts is not None:
            report["drain"]["admitted_since"] = facts["admitted"]
        if in_effect_at is None and settled():
            # A lower admission limit is in effect once the running requests
            # above it drained: the measurement period starts then.
            in_effect_at = now
            report["in_effect_after_seconds"] = now - start
        elapsed = now - in_effect_at if in_effect_at is not None else 0.0
        early = (
            v.signal not in WINDOWED
            and before is not None
            and after is not None
            and judge(
                before,
                after,
                v.direction,
                improve_by=v.improve_by,
                tolerance=v.tolerance,
                effect=v.effect,
            )
            == IMPROVED
        )
        if early:
            break
        if in_effect_at is not None and elapsed >= period:
            # A windowed rate that reads "no measurable change" after a window's
            # length goes on being measured, to the deadline: a longer period of
            # the same rate (a few events in one window are noise), ended as soon
            # as it is improved or something got worse.
            if not (
                windowed
                and now - start < deadline_s
                and _inconclusive(v, before, signals, baseline)
            ):
                break
            report["measured_past_the_window"] = True
        if now - start >= deadline_s:
            break
        left = (
            max(period - elapsed, poll_s)
            if in_effect_at is not None
            else deadline_s - (now - start)
        )
        wait(min(poll_s, max(0.0, left)))
    report["measured_seconds"] = clock() - (in_effect_at if in_effect_at is not None else start)
    after_unavailable = dict(unavailable())
    after = report["after"] = signals.get(v.signal)
    if in_effect_at is None:
        report["outcome"] = (
            f"not in effect: {after_unavailable.get(v.signal, 'the change was not in effect')} "
            f"at the {deadline_s:g} s deadline"
        )
    elif before is None or after is None:
        why = (
            baseline_unavailable.get(v.signal, "not read")
            if before is None
            else after_unavailable.get(v.signal, "not read")
        )
        report["outcome"] = (
            f"unverified: {v.signal} {'before' if before is None else 'after'}: {why}"
        )
    else:
        report["outcome"] = judge(
            before,
            after,
            v.direction,
            improve_by=v.improve_by,
            tolerance=v.tolerance,
            effect=v.effect,
        )
    guards: dict[str, Any] = {}
    tripped = None
    for guard in v.rollback_if_worse:
        g_before, g_after = baseline.get(guard), signals.get(guard)
        row: dict[str, Any] = {
            "before": g_before,
            "after": g_after,
            "required": guard in v.required_guards,
        }
        if g_before is None:
            row["outcome"] = f"unavailable: before: {baseline_unavailable.get(guard, 'not read')}"
        elif g_after is None:
            row["outcome"] = f"unavailable: after: {after_unavailable.get(guard, 'not read')}"
        elif guard_worse(guard, g_before, g_after, v.tolerance):
            row["outcome"] = WORSE
            tripped = tripped or guard
        else:
            row["outcome"] = "ok"
        guards[guard] = row
    report["guards"] = guards
    unread = [g for g, row in guards.items() if str(row["outcome"]).startswith("unavailable")]
    if unread:
        report["guards_unavailable"] = unread
    report["tripped"] = tripped
    return report
