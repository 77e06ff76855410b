"""The end of the story: the summary table, the executions, the timeline
picture, and the verdict (exit 0 when detected, fixed, verified, reverted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.runbooks.demo.live import Demo, EventFeed, runs_of
from vllm_runbook.runbooks.demo.report import (
    History,
    effect,
    execution_lines,
    format_phase_table,
    phase_rows,
    reverts_of,
    timeline_png,
)
from vllm_runbook.runbooks.demo.traffic import Request, Traffic
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.run.render import format_verification
from vllm_runbook.runbooks.store.models import ExecutionStatus


def conclude(
    demo: Demo,
    signals: Path,
    feed: EventFeed,
    traffic: Traffic,
    starved: list[Request],
    low: list[Request],
    final: AgentState,
    story_s: float,
    measured: dict[str, str],
) -> int:
    """Print the summary and the verdict. `starved`: the low-priority batch that
    waited for the fix; `low`: every low-priority request sent; `measured`: per
    alert that never fired, what its phase measured instead."""
    history = History.load(signals)
    executions = sorted(feed.executions.values(), key=lambda e: e.id)
    # report.py reads the journal's `to_dict` shape (`runbook report` reads the
    # journal): the API's models dump to it field for field.
    journal = [e.model_dump(mode="json") for e in executions]
    reverts = reverts_of(journal)
    origin = history.samples[0]["t"] if history.samples else None
    print("\nsummary (times from the first sample)")
    for line in format_phase_table(phase_rows(history)):
        print("  " + line)
    print()
    for e, row in zip(executions, journal, strict=True):
        if e.reverts_id is None:
            for line in execution_lines(row, reverts.get(e.id), history, origin):
                print("  " + line)
    effect = starvation_effect(feed, starved)
    if effect is not None:
        print("  " + effect[0])

    picture = demo.directory / "demo-timeline.png"
    try:
        timeline_png(
            history,
            journal,
            picture,
            title="vllm-runbook demo: KV pressure and starvation, detected, fixed, reverted",
        )
        print(f"\ntimeline picture: {picture}")
    except Exception as exc:  # the story's verdict does not depend on the picture
        print(f"\ntimeline picture not drawn: {exc}")
        picture = Path()
    print(f"journal: runbook history --db sqlite:///{demo.directory / 'runbook.db'}")
    if executions:
        print(
            f"one execution: runbook report {executions[0].id} "
            f"--db sqlite:///{demo.directory / 'runbook.db'}"
        )

    problems = story_problems(feed, traffic, low, final, picture, measured)
    problems += verdict_disagreements(feed, history, starved, effect)
    if effect is not None and effect[1]:
        # Timing on a loaded machine decides whether the low-priority requests
        # were still stuck when the policy switched; the story (detection,
        # action, recovery) does not depend on it, so say it, don't fail.
        print(f"note: {effect[1]}")
    for e in runs_of(feed, "latency-spike"):
        if e.verification and nothing_starving_at_switch(e.verification):
            print(
                f"note: latency-spike #{e.id}: no request was waiting for its first "
                "schedule when the switch took effect (the starved ones were admitted "
                "between the checks and the switch): its verification had nothing to judge"
            )
    print(f"\nstory: {story_s:.0f} s")
    if problems:
        print("demo: FAILED: " + "; ".join(problems))
        return ExitCode.FAILED
    print("demo: ok: detected, fixed, verified and reverted")
    return ExitCode.OK


def starvation_effect(feed: EventFeed, low: list[Request]) -> tuple[str, str | None] | None:
    """The starved requests' story: (line, problem or None); None without a switch."""
    from vllm_runbook.runbooks.demo.report import step_time

    switch = next(
        (
            s
            for e in runs_of(feed, "latency-spike")
            for s in e.steps
            if s.action == "set_policy" and s.status in ("applied", "reverted")
        ),
        None,
    )
    done = [r for r in low if r.t1 is not None and r.ok]
    if switch is None or not done:
        return None
    switched = step_time(switch.model_dump(mode="json")) or 0.0
    early = [r for r in done if (r.t1 or 0.0) < switched]
    waited = max(min(switched, r.t1 or switched) - r.t0 for r in done)
    served = max((r.t1 or 0.0) - switched for r in done)
    line = (
        f"starved: {len(low)} low-priority requests waited {waited:.1f} s under `priority` "
        f"behind the high-priority stream; all done {served:.1f} s after the switch to FCFS"
    )
    if early:
        return line, f"no starvation: {len(early)} low-priority requests done before the switch"
    return line, None


def nothing_starving_at_switch(verification: dict[str, Any]) -> bool:
    """The FCFS switch took effect after the starved requests had been admitted
    (the queue moved between the checks and the switch: timing on a loaded
    machine): the verification found none waiting for its first schedule at
    the change, so it had nothing to judge. Said, not failed."""
    drain = verification.get("drain") or {}
    return (
        verification.get("outcome") == "no measurable change"
        and drain.get("starving_at_change") == 0
    )


def verdict_disagreements(
    feed: EventFeed,
    history: History,
    starved: list[Request],
    starvation: tuple[str, str | None] | None,
) -> list[str]:
    """Where a runbook's verification disagrees with the effect this demo measured
    and printed (the story fails on any): each fix must be judged improved by
    its shipped signal, and the judgement must match what happened."""
    problems = []
    for runbook in ("oom-pressure", "latency-spike"):
        judged = [(e, e.verification) for e in runs_of(feed, runbook) if e.verification]
        for e, v in judged:
            if runbook == "latency-spike" and nothing_starving_at_switch(v):
                continue  # said as a note (conclude): the verification had nothing to judge
            if v.get("outcome") != "improved":
                problems.append(
                    f"{runbook} #{e.id}: verification {format_verification(v)}, "
                    "not improved"
                    + (
                        f", but the demo measured the fix work ({starvation[0]})"
                        if runbook == "latency-spike" and starvation and not starvation[1]
                        else ""
                    )
                )
    spike = [e for e in runs_of(feed, "latency-spike") if e.verification]
    if spike and (spike[0].verification or {}).get("outcome") == "improved":
        waiting = [r for r in starved if r.t1 is None or not r.ok]
        if waiting:
            problems.append(
                f"latency-spike #{spike[0].id}: verification improved, but the demo "
                f"measured {len(waiting)} of the {len(starved)} starved requests not served"
            )
    oom = [e for e in runs_of(feed, "oom-pressure") if e.verification]
    if oom and (oom[0].verification or {}).get("outcome") == "improved":
        measured = effect(history, oom[0].model_dump(mode="json"))
        rows = {label: (b, a) for label, b, a in measured}
        before, after = rows.get("preemptions/min", (None, None))
        if before is not None and after is not None and after >= before > 0:
            problems.append(
                f"oom-pressure #{oom[0].id}: verification improved, but the demo measured "
                f"preemptions/min {before:.1f} → {after:.1f}"
            )
    return problems


HOLD_PROBLEMS = ("not holding", "flipped")


def story_problems(
    feed: EventFeed,
    traffic: Traffic,
    low: list[Request],
    final: AgentState,
    picture: Path,
    measured: dict[str, str] | None = None,
) -> list[str]:
    problems = []
    fired = feed.fired
    for alert, runbook in (
        ("VllmOOMPressure", "oom-pressure"),
        ("VllmRequestStarvation", "latency-spike"),
    ):
        if alert not in fired:
            why = (measured or {}).get(alert)
            problems.append(f"no detection: {alert} never fired" + (f" ({why})" if why else ""))
        runs = runs_of(feed, runbook)
        acted = [e for e in runs if any(s.status in ("applied", "reverted") for s in e.steps)]
        if not acted:
            problems.append(f"no action: {runbook} changed nothing")
        elif not all(e.status == ExecutionStatus.REVERTED for e in acted):
            states = ", ".join(f"#{e.id} {e.status}" for e in acted)
            problems.append(f"no recovery: {runbook} not reverted ({states})")
    # The switch held while the stream outlasted it (runbooks/demo/story.py, 3b).
    problems += [f"{key}: {why}" for key, why in (measured or {}).items() if key in HOLD_PROBLEMS]
    if len(low) < 8 or not all(r.ok for r in low):
        problems.append("the starved low-priority requests did not all complete")
    failed = [r for r in traffic.requests if r.ok is False]
    if failed:
        problems.append(f"{len(failed)} requests failed (first: {failed[0].error})")
    if final.knobs != final.startup:
        problems.append(
            f"knobs not back at startup: {final.knobs.model_dump()} vs {final.startup.model_dump()}"
        )
    if not picture.is_file():
        problems.append("no timeline picture")
    return problems
