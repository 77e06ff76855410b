"""The second waiting queue, `kv_holding_waiting`, on a vLLM that calls it
`skipped_waiting` (0.30).

Both hold the waiting requests vLLM set aside (waiting for remote KV, for
structured-output compilation, for async dependencies); the collector counts
them as waiting, rebuilds them on a policy switch and orders them in the
tiered policy. Here `kv_holding_waiting` reads and replaces `skipped_waiting`.
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "kv_holding_waiting"


def needed(scheduler_cls: type) -> bool:
    from vllm_runbook.collector.adapters import assigned_in_init

    return not assigned_in_init(scheduler_cls, ATTRIBUTE) and assigned_in_init(
        scheduler_cls, "skipped_waiting"
    )


class HoldingQueueFromSkippedWaiting:
    @property
    def kv_holding_waiting(self) -> Any:
        return self.skipped_waiting

    @kv_holding_waiting.setter
    def kv_holding_waiting(self, queue: Any) -> None:
        self.skipped_waiting = queue


MIXIN = HoldingQueueFromSkippedWaiting
