"""`runbook serve`'s heap and Python's cyclic garbage collector.

A full collection walks every object the collector tracks. At 1,000 engines
the service holds about 1.1 million: ~650,000 from its imports and ~450,000
for the rules' windows (a Series, its arrays and labels per series, 60,000
series). Each full collection then took 0.2 s of the cycle's thread, about
every other cycle (`python benchmarks/rules_eval.py`; docs/benchmarks.md),
though none of those objects is garbage: the imports live as long as the
process, the windows as long as their engines.

So the service moves them out of the collector's generations twice
(`gc.freeze`): once its app is built, before it serves, and once the rules'
first cycle has filled the windows. Objects frozen are still freed when
their last reference goes (an engine that leaves, its series with it: the
windows hold no reference cycles); only cyclic garbage among them would
stay, and what is alive at those two moments is the process' own
long-lived state. Objects made later (engines discovered, each cycle's
garbage) are collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("vllm_runbook.service")


def freeze(moment: str) -> int:
    """Move every object alive now out of the collector's generations; how many
    are frozen in all (logged with `moment`)."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d long-lived objects left out of garbage collection", moment, frozen)
    return frozen
