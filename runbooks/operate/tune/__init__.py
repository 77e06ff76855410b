"""`runbook tune`: the field reports' five tuning steps on a live engine's traffic.

    tuner = Tuner(engine, TuneLimits(sla_e2e_p99=2.0), window_seconds=30)
    report = tuner.run()      # every point measured, the setting kept, the restart flags

1. baseline: throughput, P99 (end-to-end, TTFT with the API server), preemptions
   and the OOM rate, KV usage, over one measured window at the values tune found;
2. block size: `runbook check`'s advice (rules/config_checks.py) from the
   window's length mix and the what-if fragmentation, for the next restart;
3. policy: fcfs vs tiered from the length spread and the waiting times,
   switched live and measured for a window before it is kept;
4. budget and admission: max_num_seqs, then max_num_batched_tokens, walked
   down from their startup value (never above: the agent refuses it) in
   halvings within their live floors, then one midpoint on each side of the
   best; each point is held for a window measured only from the step it took
   effect at (`/v1/state?since_step=N`, as verification.py reads it) and
   judged on the SLA and an OOM rate (preemptions per finished request) under
   0.1 %; the highest-throughput point meeting both is kept (within 2 %, a
   tie, the less restrictive one: `beats`). An autopilot
   that is on owns max_num_seqs: only the budget is walked;
5. circuit breaker: at every read of a point the breaker's absolute limits
   (breaker.judge: OOM rate > 1 %, error rate > 0.5 %) are checked; a trip, or
   a point whose window broke the SLA, steps back at once to the best point
   measured so far and ends that knob's walk.

The engine side is the `TuneEngine` protocol: `AgentEngine` talks to the
agent (journaling each change before it is made), tests give a fake.
Interrupted (Ctrl-C) or with the engine lost, `Tuner.run` puts back what
tune changed and raises `TuneStopped` saying what it restored.
"""

from __future__ import annotations

from vllm_runbook.runbooks.operate.tune.agent import (
    AgentEngine,
    Journaling,
    format_report,
)
from vllm_runbook.runbooks.operate.tune.points import (
    BREAKER_MIN_FINISHED,
    LADDER_STEPS,
    OOM_RATE_LIMIT,
    POLICY_THROUGHPUT,
    STOP_DROP,
    TIE_SHARE,
    TTFT,
    TUNED_KNOBS,
    WAIT_SHARE,
    Point,
    TuneLimits,
    TuneStopped,
    Window,
    beats,
    breach_of,
    judge_point,
    ladder,
    midpoints,
    policy_candidate,
    policy_kept,
    restart_flags,
)
from vllm_runbook.runbooks.operate.tune.walk import (
    TuneEngine,
    Tuner,
)

__all__ = [
    "BREAKER_MIN_FINISHED",
    "LADDER_STEPS",
    "OOM_RATE_LIMIT",
    "POLICY_THROUGHPUT",
    "STOP_DROP",
    "TIE_SHARE",
    "TTFT",
    "TUNED_KNOBS",
    "WAIT_SHARE",
    "AgentEngine",
    "Journaling",
    "Point",
    "TuneEngine",
    "TuneLimits",
    "TuneStopped",
    "Tuner",
    "Window",
    "beats",
    "breach_of",
    "format_report",
    "judge_point",
    "ladder",
    "midpoints",
    "policy_candidate",
    "policy_kept",
    "restart_flags",
]
