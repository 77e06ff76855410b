"""A real vLLM `Scheduler` built with mock configs, stepped without an engine.

As vLLM's own `cpu_test` scheduler tests do (tests/v1/core/utils.py
`create_scheduler`): the configs come from `EngineArgs` for the tiny local
model (its config is read, no weight is loaded), the KV cache is a
`KVCacheConfig` of `num_blocks` blocks with no tensors, and the model
runner's answer is a `ModelRunnerOutput` that samples one token for every
request whose prompt is computed. Runs on any vLLM the matrix covers, the GPU
wheel included (with VLLM_TARGET_DEVICE=cpu): `make compat` runs these files
in every version's environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _no_agent_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """No agent endpoint for these schedulers: nothing listens. Set per test, not
    at import: the whole suite collects this file, and the engine tests need theirs."""
    monkeypatch.setenv("VLLM_RUNBOOK_PORT", "off")


BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def model_dir(tiny_model: Path) -> str:
    return str(tiny_model)


def build_scheduler(
    model_dir: str,
    *,
    hooked: bool = True,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    num_blocks: int = 1000,
    block_size: int = BLOCK_SIZE,
    enable_prefix_caching: bool = False,
    policy: str = "fcfs",
    env: dict[str, str] | None = None,
    scheduler_cls: type | None = None,
) -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_runbook.collector.hook import with_collector

    args = EngineArgs(
        model=model_dir,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        enable_chunked_prefill=True,
        enable_prefix_caching=enable_prefix_caching,
        block_size=block_size,
        scheduling_policy=policy,  # type: ignore[arg-type]
        skip_tokenizer_init=True,
    )
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    try:  # vLLM >= 0.30 registers the KV cache spec managers per config
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    except ImportError:  # pragma: no cover - older vLLM
        pass
    else:
        register_all_kvcache_specs(vllm_config)
    cls = scheduler_cls or Scheduler
    if hooked:
        cls = with_collector(cls)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=True,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Step:
    scheduled: dict[str, int]  # request id -> tokens scheduled this step
    preempted: list[str] = field(default_factory=list)
    running: int = 0  # requests running right after schedule()


def make_request(
    request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0
) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)  # as vLLM's own tests do (idempotent per process)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=request_id,
        prompt_token_ids=[3 + (i % 500) for i in range(prompt_len)],
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def step(scheduler: Any) -> Step:
    """One schedule() and the model runner's answer: one sampled token for
    every request whose prompt is now computed."""
    from vllm.v1.outputs import ModelRunnerOutput

    output = scheduler.schedule()
    running = len(scheduler.running)
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([7] if done else [])
    fields = dict(
        req_ids=ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM <= 0.33
        fields["req_id_to_index"] = {rid: i for i, rid in enumerate(ids)}
    runner = ModelRunnerOutput(**fields)
    scheduler.update_from_output(output, runner)
    preempted = sorted(getattr(output, "preempted_req_ids", None) or [])
    return Step(dict(output.num_scheduled_tokens), preempted, running)


def run_until_idle(scheduler: Any, limit: int = 500) -> Iterator[Step]:
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            return
        yield step(scheduler)
    raise AssertionError(f"still busy after {limit} steps")
