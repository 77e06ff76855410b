"""Schedulers whose vllm-runbook hook the benchmark switches off and on, for
`collector_overhead.py`'s one-engine tables: between rounds (`Toggled*`),
or every few steps inside a round (`StepToggled*`, below).

The engine is started with the plugin as installed and `scheduler_cls` one of
these: the plugin wraps a `Toggled*` class like vLLM's own, and leaves a
`StepToggled*` one, already hooked, as it is (the toggle in front of the
hook's wrappers). For `Toggled*`: at the first request of a
round, when the engine holds no request, the EngineCore reads the file named
by VLLM_RUNBOOK_BENCH_HOOK_FLAG: "on" enables the collector, anything else
disables it, which is the path a collector takes after an error (the mixin
then calls vLLM's methods at once). One file read per round, in both states.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_runbook.collector.scheduler import RunbookAsyncScheduler, RunbookScheduler

FLAG_ENV = "VLLM_RUNBOOK_BENCH_HOOK_FLAG"
STEP_LOG_ENV = "VLLM_RUNBOOK_BENCH_STEP_LOG"
# µs of busy wait in each schedule() of the step toggle's third kind, which is
# then "busy" (hook off, a known cost on the engine thread) instead of "off B".
BUSY_ENV = "VLLM_RUNBOOK_BENCH_BUSY_US"
BLOCK_STEPS = 16  # steps per block of the step toggle
KINDS = ("on", "off A", "off B")


class _Toggle:
    requests: dict[str, Any]

    def add_request(self, request: Any) -> None:
        if not self.requests:  # a new round: the engine is idle
            collector = getattr(self, "runbook_collector", None)
            path = os.environ.get(FLAG_ENV)
            if collector is not None and path:
                with open(path, encoding="utf-8") as f:
                    collector.enabled = f.read().strip() == "on"
                collector.error = None
        super().add_request(request)  # type: ignore[misc]


class ToggledScheduler(_Toggle, Scheduler):
    pass


class ToggledAsyncScheduler(_Toggle, AsyncScheduler):
    pass


def busy_wait(seconds: float) -> None:
    """Holds the engine thread for `seconds`, as work of that size would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Blocks:
    """The step toggle's bookkeeping: the block under way, and the measured
    blocks as (round, kind, seconds, output tokens, steps)."""

    def __init__(self, path: str, busy: float = 0.0) -> None:
        self.path = path
        self.busy = busy  # seconds of busy wait a step in the third kind's blocks
        self.round = -1
        self.block = 0  # blocks begun this round
        self.step = BLOCK_STEPS  # steps of the block under way begun (full: begin one)
        self.kind = 0
        self.start: float | None = None  # the block's measured part began (its 2nd step)
        self.tokens = 0
        self.records: list[tuple[int, int, float, int, int]] = []
        self.errors: list[str] = []

    def new_round(self) -> None:
        """The engine holds no request: the records so far go to the log, the
        block under way is dropped (its steps ran into the idle time)."""
        with open(self.path, "a", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps({"block": record}) + "\n")
            for error in self.errors:
                f.write(json.dumps({"error": error}) + "\n")
        self.records, self.errors = [], []
        self.round += 1
        self.block, self.step, self.start = 0, BLOCK_STEPS, None

    def begin(self, scheduler: Any) -> None:
        """The next block, its kind rotated by round and block; the collector
        switched on for "on" only (off: the path a collector takes after an
        error, as the round toggle's)."""
        self.kind = (self.round + self.block) % len(KINDS)
        self.block += 1
        self.step, self.start = 0, None
        collector = getattr(scheduler, "runbook_collector", None)
        if collector is None:
            self.errors.append("no collector")
            return
        if collector.error is not None:  # failed in the block before: the run is void
            self.errors.append(str(collector.error))
            collector.error = None
        collector.enabled = self.kind == 0


class _StepToggle:
    """Outermost (the hook's wrappers inside): the hook switched on or off for
    blocks of BLOCK_STEPS steps in rotated order, inside every round.

    A block's measured part runs from the start of its second step to the
    start of the next block: its first step, where the collector catches up
    on the requests it did not see while off, and the steps a round ends
    with are left out, in every kind alike. Its tokens are the output tokens
    sampled in those steps. The toggle's own work is the same in every kind.

    With BUSY_ENV set, the third kind's blocks ("busy") run with the hook off
    and a busy wait of that many µs at the start of each schedule(): a
    known cost on the engine thread, read by the same measure as the hook.
    """

    _runbook_blocks: _Blocks | None = None
    requests: dict[str, Any]

    def add_request(self, request: Any) -> None:
        if not self.requests:  # a new round: the engine is idle
            blocks = self._runbook_blocks
            if blocks is None:
                busy = float(os.environ.get(BUSY_ENV) or 0) / 1e6
                blocks = self._runbook_blocks = _Blocks(os.environ[STEP_LOG_ENV], busy)
            blocks.new_round()
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        blocks = self._runbook_blocks
        if blocks is not None:
            if blocks.step == BLOCK_STEPS:  # a block ends where the next begins
                if blocks.start is not None:
                    blocks.records.append(
                        (
                            blocks.round,
                            blocks.kind,
                            now - blocks.start,
                            blocks.tokens,
                            BLOCK_STEPS - 1,
                        )
                    )
                blocks.begin(self)
            elif blocks.step == 1:
                blocks.start, blocks.tokens = now, 0
            blocks.step += 1
            if blocks.kind == 2 and blocks.busy:  # the known cost, in the step it delays
                busy_wait(blocks.busy)
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        blocks = self._runbook_blocks
        if blocks is not None and blocks.step >= 2:  # a measured step
            blocks.tokens += sum(map(len, model_runner_output.sampled_token_ids))
        return result


class StepToggledScheduler(_StepToggle, RunbookScheduler):
    pass


class StepToggledAsyncScheduler(_StepToggle, RunbookAsyncScheduler):
    pass
