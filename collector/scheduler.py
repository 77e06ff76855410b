"""Explicit scheduler classes, for `--scheduler-cls` when the plugin is off.

    vllm serve MODEL --scheduler-cls vllm_runbook.collector.scheduler.RunbookAutoScheduler

`RunbookAutoScheduler` is the one to name: it builds `RunbookAsyncScheduler`
when the engine runs async scheduling (vLLM's default on GPU) and
`RunbookScheduler` otherwise (CPU, pipeline parallelism, pooling models, ...).
Naming the synchronous class on a GPU engine would cost its async scheduling:
vLLM warns that a custom class which does not extend `AsyncScheduler` runs
with "degraded performance due to async scheduling being disabled".
With the plugin loaded these are left as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_runbook.collector.adapters import adapters_for
from vllm_runbook.collector.hook import RunbookSchedulerMixin


class RunbookScheduler(RunbookSchedulerMixin, *adapters_for(Scheduler), Scheduler):  # type: ignore[misc]
    pass


_ASYNC_ADAPTERS = adapters_for(AsyncScheduler)


class RunbookAsyncScheduler(RunbookSchedulerMixin, *_ASYNC_ADAPTERS, AsyncScheduler):  # type: ignore[misc]
    pass


if TYPE_CHECKING:  # mypy: the installed vLLM's schedulers are what the collector reads of one
    from vllm_runbook.collector.vllm_types import VllmScheduler

    _READ: tuple[type[VllmScheduler], ...] = (Scheduler, AsyncScheduler)


def scheduler_class_for(vllm_config: Any) -> type[RunbookScheduler | RunbookAsyncScheduler]:
    """The hooked class matching the engine's scheduling mode, as vLLM resolved it."""
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return RunbookAsyncScheduler
    return RunbookScheduler


class RunbookAutoScheduler(RunbookScheduler):
    """Builds the hooked scheduler that matches the engine's configuration.

    vLLM instantiates the class named by `--scheduler-cls` once, with its
    `vllm_config`; `async_scheduling` is resolved by then. The object built is
    a `RunbookAsyncScheduler` or a `RunbookScheduler` (not an instance of this
    class, so Python does not initialise it twice).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return scheduler_class_for(kwargs["vllm_config"])(*args, **kwargs)
