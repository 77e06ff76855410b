"""Schedulers whose vllm-runbook hook the benchmark switches off and on
between rounds, for `collector_overhead.py`'s same-engine table.

The engine is started with the plugin as installed and `scheduler_cls` one of
these (the plugin wraps it like vLLM's own class). At the first request of a
round, when the engine holds no request, the EngineCore reads the file named
by VLLM_RUNBOOK_BENCH_HOOK_FLAG: "on" enables the collector, anything else
disables it, which is the path a collector takes after an error (the mixin
then calls vLLM's methods at once). One file read per round, in both states.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

FLAG_ENV = "VLLM_RUNBOOK_BENCH_HOOK_FLAG"


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
