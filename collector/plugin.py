"""vLLM general plugin: hooks the collector into every engine by itself.

Registered under the `vllm.general_plugins` entry point group, so vLLM calls
`register()` in every process; in the EngineCore it runs before the scheduler
is built (EngineCore.__init__). We wrap `SchedulerConfig.get_scheduler_cls`
so the class vLLM picks (Scheduler, AsyncScheduler, or a user's) comes back
with the hook mixed in. Where the user already chose our class with
`--scheduler-cls vllm_runbook.collector.scheduler.RunbookAutoScheduler`, nothing changes.

It also installs the start-up hook of the warm-up at engine start
(collector/warmup.py, opt-in): once vLLM built the engine core, before the
core reports ready.

Disable with `VLLM_PLUGINS=` (an empty allow-list) or by naming only other
plugins there.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_runbook.collector")

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    try:
        import vllm
        from vllm.config.scheduler import SchedulerConfig
        from vllm_runbook.collector.hook import with_collector
        from vllm_runbook.collector.settings import check_vllm_version

        check_vllm_version(getattr(vllm, "__version__", "unknown"))
        original = SchedulerConfig.get_scheduler_cls

        @functools.wraps(original)
        def get_scheduler_cls(self: SchedulerConfig) -> type:
            scheduler_cls = original(self)
            try:
                return with_collector(scheduler_cls)
            except Exception:
                logger.exception("vllm-runbook: cannot hook %s; running without", scheduler_cls)
                return scheduler_cls

        SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
        _install_start_hook()
        _registered = True
    except Exception:  # never stop vLLM from starting
        logger.exception("vllm-runbook: plugin registration failed; engine runs without it")


def _install_start_hook() -> None:
    """The start-up hook of the warm-up (collector/warmup.py): a no-op unless
    VLLM_RUNBOOK_WARMUP is on where the collector starts. Without it the
    collector still runs."""
    try:
        from vllm.v1.engine.core import EngineCore, EngineCoreProc
        from vllm_runbook.collector.warmup import install_start_hook

        install_start_hook(EngineCore, EngineCoreProc)
    except Exception:
        logger.exception("vllm-runbook: no start-up hook; the warm-up at start cannot run")
