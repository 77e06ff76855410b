"""The autopilot wired to one engine: fed after each step, its decision applied
before the next, through the bounded live-change path (control.py).

The controller itself (autopilot.py) only decides, from plain numbers. Its
failures fail open: the autopilot turns off, the knobs stay where they are,
the engine and the collector go on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.autopilot import Autopilot
from vllm_runbook.collector.exporter import Sample

if TYPE_CHECKING:
    from vllm_runbook.collector.control import EngineControl
    from vllm_runbook.collector.step_stats import StepStats
    from vllm_runbook.collector.vllm_types import Request, VllmScheduler

logger = logging.getLogger("vllm_runbook.collector")


class AutopilotDriver:
    """Data sources: the scheduler (queues, admission limit, budget), the step
    statistics (step count, KV usage) and the control that applies changes."""

    def __init__(
        self,
        autopilot: Autopilot,
        scheduler: VllmScheduler,
        stats: StepStats,
        control: EngineControl,
        dp_rank: int = 0,
    ) -> None:
        self.autopilot = autopilot
        self.scheduler = scheduler
        self.stats = stats
        self.control = control
        self.dp_rank = dp_rank

    # -- engine thread -----------------------------------------------------------

    def observe(self, scheduler: VllmScheduler, output: Any, free_before: int) -> None:
        """After schedule() and the step statistics: feed the controller this step."""
        autopilot = self.autopilot
        self.autopilot.observe(
            self.stats.steps,
            # Advisory: the limit it would have set is the one it reasons from.
            autopilot.limit if autopilot.advisory else scheduler.max_num_active_reqs,
            self.control.autopilot_ceiling(),
            len(scheduler.running),
            len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
            len(output.preempted_req_ids),
            self.stats.kv_usage(free_before),
        )

    def apply(self) -> None:
        """Before schedule(), under the scheduler lock: its pending decision."""
        decision = self.autopilot.pending
        self.autopilot.pending = None
        # Advisory: the decision is only its `limit`, exported; nothing is applied.
        if decision is not None and self.autopilot.enabled:
            applied = self.control.apply_autopilot(decision.limit)
            self.autopilot.limit = applied
            logger.debug(
                "vllm-runbook: engine %d autopilot: max_num_seqs %d (%s) from step %d",
                self.dp_rank,
                applied,
                decision.reason,
                self.stats.steps + 1,
            )

    def on_request_finished(self, request: Request) -> None:
        """A request's lifetime (its output tokens and prefill steps) sets the epoch."""
        budget = self.scheduler.max_num_scheduled_tokens or 1
        self.autopilot.on_request_finished(
            request.num_output_tokens, -(-request.num_prompt_tokens // budget)
        )

    def failed(self, exc: BaseException) -> None:
        """Fail open: the autopilot turns off, the knobs stay, the engine and
        the collector go on."""
        autopilot = self.autopilot
        if not autopilot.observing:
            return
        autopilot.disable()
        autopilot.error = f"{type(exc).__name__}: {exc}"
        logger.error(
            "vllm-runbook: autopilot turned off for engine %d after an error (%s); "
            "the engine keeps serving with max_num_seqs %d",
            self.dp_rank,
            autopilot.error,
            int(self.scheduler.max_num_active_reqs),
        )

    # -- any thread ----------------------------------------------------------------

    def samples(self) -> list[Sample]:
        autopilot = self.autopilot
        return [
            Sample(M.AUTOPILOT_ENABLED, 1.0 if autopilot.enabled else 0.0),
            Sample(M.AUTOPILOT_KV_TARGET, autopilot.target),
            Sample(M.AUTOPILOT_KV_HIGH, autopilot.high),
            Sample(M.AUTOPILOT_CHANGES, autopilot.changes_up, ("up",)),
            Sample(M.AUTOPILOT_CHANGES, autopilot.changes_down, ("down",)),
            *(
                [Sample(M.AUTOPILOT_ADVISED_MAX_NUM_SEQS, float(autopilot.limit))]
                if autopilot.advisory
                else []
            ),
        ]
