"""The scheduler hook: the collector's entry points inside vLLM's scheduler.

`RunbookSchedulerMixin` is mixed in front of whatever scheduler class vLLM
chose (Scheduler, AsyncScheduler, a user class). It builds the engine's
collector (engine_collector.py) and, each step, times `schedule()`, applies
queued knob changes and the autopilot's decision between steps, and hands
the scheduler's output to the collector's per-step methods, which only
update plain numbers (no metric objects, no models). It never changes what
the scheduler does.

Most steps take the fast path: while no part has anything to do between
steps (no command queued, no tiered policy, no autopilot, no change
settling), the collector is `quiet` and a step is the lock, the timer and
the statistics alone; a part that has more to do sets its own state, then
wakes the collector (engine_collector.py, `settle_quiet`).

The engine comes first: any exception in our code disables the collector for
that engine (one log line, `vllm_runbook_collector_up 0`) and the scheduler
goes on as if we were not there. vLLM's own exceptions pass through untouched.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector.adapters import adapters_for
from vllm_runbook.collector.engine_collector import EngineCollector

if TYPE_CHECKING:
    from typing import Protocol

    from vllm_runbook.collector.vllm_types import VllmScheduler

    class HookedScheduler(VllmScheduler, Protocol):
        """The mixin's `self`: always in front of a vLLM scheduler (what the
        collector reads of one), with this engine's collector."""

        runbook_collector: EngineCollector | None

        def _runbook_schedule(self, collector: EngineCollector, args: Any, kwargs: Any) -> Any: ...


logger = logging.getLogger("vllm_runbook.collector")

# schedule()'s timer. Its second read is also the step's time for the
# collector's heartbeat and windows, which other threads compare with
# time.monotonic(): perf_counter where it is that clock (Linux, macOS), so a
# step reads the clock twice, not three times; monotonic elsewhere.
_STEP_CLOCK = (
    time.perf_counter
    if time.get_clock_info("perf_counter").implementation
    == time.get_clock_info("monotonic").implementation
    else time.monotonic
)


class RunbookSchedulerMixin:
    """Mixed in front of a vLLM scheduler class; see the module docstring."""

    # This engine's collector; None when it could not start.
    runbook_collector: EngineCollector | None = None

    def __init__(self: HookedScheduler, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.runbook_collector = EngineCollector(self)
        except Exception:
            self.runbook_collector = None
            logger.exception("vllm-runbook: collector not started; the engine runs without it")

    def schedule(self: HookedScheduler, *args: Any, **kwargs: Any) -> Any:
        collector = self.runbook_collector
        if collector is None or not collector.enabled:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        if not collector.quiet:
            return self._runbook_schedule(collector, args, kwargs)
        # The fast path: no part has anything to do before or after this step
        # but the statistics (engine_collector.py, `settle_quiet`).
        stats = collector.stats
        with collector.lock:
            try:
                free_before = stats.free_blocks()
            except Exception as exc:
                collector.disable(exc)
                return super().schedule(*args, **kwargs)  # type: ignore[misc]
            start = _STEP_CLOCK()
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            now = _STEP_CLOCK()
        try:
            stats.on_schedule(self, output, now - start, free_before, now)
            if output.scheduled_new_reqs:  # their queue times
                collector.requests.on_schedule(self, output)
            if now >= collector.next_sample_at:  # about once a second
                collector.sample(now)
        except Exception as exc:
            collector.disable(exc)
        return output

    def _runbook_schedule(
        self: HookedScheduler, collector: EngineCollector, args: Any, kwargs: Any
    ) -> Any:
        """schedule() when a part has something to do (the slow path)."""
        control = collector.control
        with control.lock:
            try:
                if control.pending:  # knob changes land between steps only
                    control.drain()
                free_before = collector.stats.free_blocks()
            except Exception as exc:
                collector.disable(exc)
                return super().schedule(*args, **kwargs)  # type: ignore[misc]
            if collector.autopilot.pending is not None:
                try:
                    collector.autopilot_driver.apply()
                except Exception as exc:
                    collector.autopilot_driver.failed(exc)
            # After the autopilot: the tier limits scale with this step's max_num_seqs.
            tiered = control.tiered
            if tiered:
                try:
                    control.begin_tiered_step()
                except Exception as exc:
                    collector.disable(exc)
                    with contextlib.suppress(Exception):
                        control.end_tiered_step()  # the queues go on, in order, without limits
                    return super().schedule(*args, **kwargs)  # type: ignore[misc]
            start = _STEP_CLOCK()
            try:
                output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            finally:
                if tiered:
                    try:
                        control.end_tiered_step()
                    except Exception as exc:
                        collector.disable(exc)
            now = _STEP_CLOCK()
        try:
            collector.on_schedule(self, output, now - start, free_before, now)
        except Exception as exc:
            collector.disable(exc)
            return output
        if collector.autopilot.observing:
            try:
                collector.autopilot_driver.observe(self, output, free_before)
            except Exception as exc:
                collector.autopilot_driver.failed(exc)
        try:
            collector.settle_quiet()
        except Exception as exc:
            collector.disable(exc)
        return output

    def update_from_output(
        self: HookedScheduler, scheduler_output: Any, model_runner_output: Any
    ) -> Any:
        collector = self.runbook_collector
        if collector is None:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if collector.quiet and collector.enabled:  # the fast path (see schedule)
            with collector.lock:
                result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
            try:
                collector.stats.on_update(self, scheduler_output, model_runner_output)
            except Exception as exc:
                collector.disable(exc)
            return result
        if not collector.enabled:
            result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        else:
            with collector.control.lock:
                result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
            try:
                collector.stats.on_update(self, scheduler_output, model_runner_output)
                if collector.changes.settling is not None:
                    collector.changes.check_settled(self)
            except Exception as exc:
                collector.disable(exc)
        if collector.control.abort_outputs:
            # Requests aborted at their tier's deadline: their clients learn it
            # here, even if the collector failed since.
            try:
                collector.control.deliver_aborts(result)
            except Exception as exc:
                collector.disable(exc)
        return result

    # The queues a policy switch rebuilds are also touched here.
    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        collector = self.runbook_collector
        if collector is None:
            return super().add_request(*args, **kwargs)  # type: ignore[misc]
        with collector.control.lock:
            result = super().add_request(*args, **kwargs)  # type: ignore[misc]
        if collector.enabled:
            try:
                collector.requests.on_add_request(args[0] if args else kwargs["request"])
            except Exception as exc:
                collector.disable(exc)
        return result

    def finish_requests(self: HookedScheduler, *args: Any, **kwargs: Any) -> Any:
        collector = self.runbook_collector
        if collector is None:
            return super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        with collector.control.lock:
            result = super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        if collector.enabled:
            try:
                if collector.changes.settling is not None:
                    collector.changes.check_settled(self)
            except Exception as exc:
                collector.disable(exc)
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        # With reset_running_requests it preempts every running request onto
        # `waiting`: a policy switch rebuilding that queue at the same time
        # (the HTTP thread, while the engine is paused) would lose them.
        collector = self.runbook_collector
        if collector is None:
            return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        with collector.control.lock:
            return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        collector = self.runbook_collector
        if collector is not None and collector.enabled:
            if not collector.quiet and collector.autopilot.observing:
                try:
                    collector.autopilot_driver.on_request_finished(request)
                except Exception as exc:
                    collector.autopilot_driver.failed(exc)
            try:
                collector.stats.on_request_freed(request.request_id)
                collector.requests.on_request_finished(request)
            except Exception as exc:
                collector.disable(exc)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            if self.runbook_collector is not None:
                self.runbook_collector.close()


def with_collector(scheduler_cls: type) -> type:
    """`scheduler_cls` with the hook mixed in front (itself if already hooked),
    and the adapters an older vLLM's class needs (collector/adapters/)."""
    if issubclass(scheduler_cls, RunbookSchedulerMixin):
        return scheduler_cls
    return type(
        f"Runbook{scheduler_cls.__name__}",
        (RunbookSchedulerMixin, *adapters_for(scheduler_cls), scheduler_cls),
        {"__module__": __name__},
    )
