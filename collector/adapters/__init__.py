"""Where a vLLM version the matrix covers needs different code: one small
module per concern, each a mixin the hook puts in front of a scheduler class
that lacks what the collector reads (feature-detected, no version strings).

    admission.py     max_num_active_reqs: the admission limit (vLLM >= 0.31);
                     vLLM 0.30 has only max_num_running_reqs
    holding_queue.py kv_holding_waiting: the second waiting queue (vLLM >= 0.31);
                     vLLM 0.30 calls it skipped_waiting
    memory_utilization.py  the KV cache's memory utilisation: set in vLLM <= 0.33,
                     resolved from None (and the extensible KV cache) in 0.34
                     (a function engine_config.py calls, not a scheduler mixin)
    resumed_requests.py    a step's resumed requests: named among the cached ones
                     up to vLLM 0.33, sent among the new ones in 0.34 (a reader
                     StepStats picks once)

The rest of the collector reads the names of the newest vLLM.
"""

from __future__ import annotations

from vllm_runbook.collector.adapters import admission, holding_queue

ADAPTERS = (admission, holding_queue)


def assigned_in_init(cls: type, attribute: str) -> bool:
    """Whether some `__init__` in `cls`'s MRO assigns `self.<attribute>`."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None and attribute in code.co_names:
            return True
    return False


def adapters_for(scheduler_cls: type) -> tuple[type, ...]:
    """The adapter mixins `scheduler_cls` needs (none for the newest vLLM)."""
    return tuple(a.MIXIN for a in ADAPTERS if a.needed(scheduler_cls))
