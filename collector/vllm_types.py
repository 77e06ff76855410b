"""What the collector reads of vLLM's scheduler, as structural types.

The collector imports no vLLM class at module level (it loads on every vLLM of
the matrix, collector/vllm_matrix.json, and only inside the engine), so these
Protocols name vLLM's classes by the members the collector reads, nothing more:
vllm.v1.core.sched.scheduler.Scheduler (`VllmScheduler`), its KV cache manager,
block pool and request queues, and vllm.v1.request.Request (`Request`). Read-only
members are properties (an attribute or a property satisfies them). A member an
older vLLM lacks is given by an adapter (collector/adapters/); one read with
getattr and a default (num_lookahead_tokens, _pause_state, ...) is left out.

What writes into the scheduler (control.py's EngineControl: the knobs, the
queues it swaps on a policy switch) keeps its `Any`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol


class Request(Protocol):
    """vllm.v1.request.Request: one request in the engine."""

    @property
    def request_id(self) -> str: ...

    @property
    def status(self) -> Any:
        """vllm.v1.request.RequestStatus."""
        ...

    @property
    def arrival_time(self) -> float:
        """Unix time (seconds) the API server received it."""
        ...

    @property
    def priority(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed (this step's included, after schedule())."""
        ...


class RequestQueue(Protocol):
    """vllm.v1.core.sched.request_queue.RequestQueue (FCFS or priority), or the
    tiered policy's queue (tiers.py's TieredRequestQueue)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class KVCacheBlock(Protocol):
    """vllm.v1.core.kv_cache_utils.KVCacheBlock."""

    @property
    def is_null(self) -> bool:
        """vLLM's placeholder block (sliding window, mamba), holding no KV."""
        ...


class SingleTypeKVCacheManager(Protocol):
    """One KV cache group's manager (vllm.v1.core.single_type_kv_cache_manager)."""

    @property
    def req_to_blocks(self) -> Mapping[str, Sequence[KVCacheBlock]]:
        """Request id → the blocks it holds in this group."""
        ...


class KVCacheCoordinator(Protocol):
    @property
    def single_type_managers(self) -> Sequence[SingleTypeKVCacheManager]:
        """One per KV cache group; the first is full attention for decoder LLMs."""
        ...


class BlockPool(Protocol):
    """vllm.v1.core.block_pool.BlockPool."""

    @property
    def num_gpu_blocks(self) -> int:
        """KV cache blocks allocated, vLLM's null block included."""
        ...

    def get_num_free_blocks(self) -> int: ...


class KVCacheManager(Protocol):
    """vllm.v1.core.kv_cache_manager.KVCacheManager."""

    @property
    def block_pool(self) -> BlockPool: ...

    @property
    def coordinator(self) -> KVCacheCoordinator: ...

    # `request`: vLLM's own Request (the one vLLM passes), hence Any.
    def prefix_cache_lookup_enabled(self, request: Any) -> bool: ...

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Wrapped by the collector (engine_collector.py) to count prefix-cache
        lookups at admission."""
        ...


class VllmScheduler(Protocol):
    """vllm.v1.core.sched.scheduler.Scheduler (or AsyncScheduler, or a user's
    subclass), with the hook (hook.py) mixed in front: what the collector's
    readers take (step_stats.py, request_tracking.py's RequestTracker, queues.py,
    autopilot_driver.py, engine_config.py, state.py, engine_collector.py)."""

    @property
    def vllm_config(self) -> Any:
        """vllm.config.VllmConfig, as vLLM resolved it."""
        ...

    @property
    def scheduler_config(self) -> Any:
        """vllm.config.SchedulerConfig: the scheduler's own copy (control.py makes
        one at start and writes the knobs into it)."""
        ...

    @property
    def block_size(self) -> int:
        """KV cache block size, tokens."""
        ...

    @property
    def kv_cache_manager(self) -> KVCacheManager: ...

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every request in the engine (waiting, running, held), by id."""
        ...

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def waiting(self) -> RequestQueue: ...

    @property
    def kv_holding_waiting(self) -> RequestQueue:
        """The waiting requests vLLM set aside (remote KV, grammar, async
        dependencies); `skipped_waiting` in vLLM 0.30 (adapters/holding_queue.py)."""
        ...

    @property
    def max_num_active_reqs(self) -> int:
        """The admission limit in effect (the live max_num_seqs); vLLM 0.30 has
        only max_num_running_reqs (adapters/admission.py)."""
        ...

    @property
    def max_num_scheduled_tokens(self) -> int:
        """The token budget per step in effect (the live max_num_batched_tokens)."""
        ...

    def get_num_unfinished_requests(self) -> int: ...
