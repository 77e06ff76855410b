"""Where a step's resumed requests are, on every vLLM the matrix covers.

vLLM <= 0.33 schedules a request resumed after preemption among the cached
ones and names it in `CachedRequestData.resumed_req_ids` (its new blocks
replace its old ones). vLLM 0.34 re-sends a resumed request in full among
the new ones (`scheduled_new_reqs`) and has no such field: the cached
requests are then never resumed ones. Read once per step, so the choice is
made once, from the class (a field, not a version string).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from operator import attrgetter
from typing import Any

NONE: frozenset[str] = frozenset()


def resumed_ids_reader() -> Callable[[Any], Collection[str]]:
    """A function of a step's `scheduled_cached_reqs`: the ids resumed there."""
    try:
        from vllm.v1.core.sched.output import CachedRequestData

        fields = CachedRequestData.__dataclass_fields__
    except Exception:  # not vLLM's dataclass: read the attribute where it is
        return lambda cached: getattr(cached, "resumed_req_ids", NONE)
    if "resumed_req_ids" in fields:
        return attrgetter("resumed_req_ids")  # in C: the hook calls it every step
    return _none


def _none(cached: Any) -> Collection[str]:
    return NONE
