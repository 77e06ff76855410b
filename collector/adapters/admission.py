"""The admission limit, `max_num_active_reqs`, on a vLLM without it (0.30).

vLLM >= 0.31 admits requests up to `max_num_active_reqs`, apart from the
model runner's slots (`max_num_running_reqs`); the collector's max_num_seqs
knob and the autopilot set it, and the requests above it drain. vLLM 0.30 has
only `max_num_running_reqs`, and asserts after every schedule() that no more
requests run than it says: set below the running count it would stop the
engine. Here `max_num_active_reqs` is the limit the collector sets, and
before each schedule() `max_num_running_reqs` becomes max(limit, requests
running): none is admitted above the limit, the running ones drain, and at
the startup value nothing changes (no more than it ever run).
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "max_num_active_reqs"


def needed(scheduler_cls: type) -> bool:
    from vllm_runbook.collector.adapters import assigned_in_init

    return not assigned_in_init(scheduler_cls, ATTRIBUTE) and assigned_in_init(
        scheduler_cls, "max_num_running_reqs"
    )


class AdmissionLimitFromRunningReqs:
    _runbook_admission_limit: int | None = None

    @property
    def max_num_active_reqs(self) -> int:
        limit = self._runbook_admission_limit
        return int(self.max_num_running_reqs if limit is None else limit)

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, limit: int) -> None:
        self._runbook_admission_limit = int(limit)
        self._runbook_apply_admission_limit()

    def _runbook_apply_admission_limit(self) -> None:
        limit = self._runbook_admission_limit
        if limit is not None:
            running = len(self.running)  # type: ignore[attr-defined]
            self.max_num_running_reqs = max(limit, running)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._runbook_apply_admission_limit()
        return super().schedule(*args, **kwargs)  # type: ignore[misc]


MIXIN = AdmissionLimitFromRunningReqs
