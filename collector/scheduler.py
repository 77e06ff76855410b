"""Explicit scheduler classes, for `--scheduler-cls` when the plugin is off.

    vllm serve MODEL --scheduler-cls vllm_runbook.collector.scheduler.RunbookScheduler

`RunbookAsyncScheduler` is the same for async scheduling (vLLM's default on
GPU). With the plugin loaded these are left as they are.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_runbook.collector.hook import RunbookSchedulerMixin


class RunbookScheduler(RunbookSchedulerMixin, Scheduler):
    pass


class RunbookAsyncScheduler(RunbookSchedulerMixin, AsyncScheduler):
    pass
