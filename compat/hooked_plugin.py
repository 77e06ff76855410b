"""pytest plugin for vLLM's own scheduler tests: vLLM's classes replaced by
the hooked ones (`-p compat.hooked_plugin`, with the repository on the path).

At load, before any test module imports them, `Scheduler` and
`AsyncScheduler` in their vLLM modules become `with_collector(...)` of
themselves, the classes the plugin hands vLLM in production
(`SchedulerConfig.get_scheduler_cls` is wrapped the same way). A test module's
`from vllm.v1.core.sched.scheduler import Scheduler` then gets the hooked
class, and so does `tests/v1/core/utils.create_scheduler`.

A hook that disabled itself would pass every test trivially: after each test
every hooked scheduler the test built must still have its collector running
(`runbook_collector.enabled`), else the test errors with the collector's
error. `COMPAT_UNHOOKED=1` loads nothing (the same tests with vLLM's classes:
the baseline the hooked run is compared with).

The matrix runs offline with stand-ins for the hub models the tests name
(compat/standin_models.py). A test that fails because it names a model that
is not there never reached a scheduler: it is reported as skipped, with the
reason "offline: ...", and counted apart.

The collector runs as in an engine, without its HTTP endpoint
(VLLM_RUNBOOK_PORT=off) and with no GPU to poll.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import pytest

HOOKED = os.environ.get("COMPAT_UNHOOKED", "") != "1"
_built: list[weakref.ref[Any]] = []


def _install() -> None:
    os.environ["VLLM_RUNBOOK_PORT"] = "off"
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched import async_scheduler, scheduler
    from vllm_runbook.collector.hook import RunbookSchedulerMixin, with_collector
    from vllm_runbook.collector.plugin import register

    register()  # the production path: SchedulerConfig.get_scheduler_cls hooked
    assert getattr(SchedulerConfig.get_scheduler_cls, "__wrapped__", None) is not None
    original_init = RunbookSchedulerMixin.__init__

    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _built.append(weakref.ref(self))

    RunbookSchedulerMixin.__init__ = tracked_init  # type: ignore[method-assign]
    scheduler.Scheduler = with_collector(scheduler.Scheduler)  # type: ignore[misc]
    async_scheduler.AsyncScheduler = with_collector(async_scheduler.AsyncScheduler)  # type: ignore[misc]


if HOOKED:
    _install()


def pytest_report_header() -> str:
    return f"vllm-runbook compat: scheduler classes {'HOOKED' if HOOKED else 'vLLM own'}"


OFFLINE_ERRORS = (
    "Invalid repository ID or local directory",
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
    "Cannot find the requested files in the disk cache",
    "We couldn't connect to 'https://huggingface.co'",
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and call.excinfo is not None:
        text = str(call.excinfo.getrepr(style="short"))
        if any(marker in text for marker in OFFLINE_ERRORS):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, "offline: " + OFFLINE_REASON)
    return report


OFFLINE_REASON = "names a hub model the offline stand-in cache does not hold"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    result = yield
    if not HOOKED:
        return result
    alive = [s for s in (ref() for ref in _built) if s is not None]
    _built.clear()
    for sched in alive:
        collector = sched.runbook_collector
        if collector is None:
            pytest.fail("vllm-runbook: the collector did not start in a hooked scheduler")
        if not collector.enabled:
            pytest.fail(f"vllm-runbook: the collector disabled itself: {collector.error}")
    item.user_properties.append(("hooked_schedulers", len(alive)))
    return result
