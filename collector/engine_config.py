"""The engine's configuration as vLLM resolved it, read once at start.

What `runbook check` and the tuning advice judge (block size, memory
utilisation, chunked prefill, the token budget, ...), exported as one info
series (string labels), a few numeric gauges that rules compare, and the
`config` part of `/v1/state`. The fields are declared once, by the wire
model (collector/agent_api.py's EngineConfig); this module reads them. Values
are read from the engine's VllmConfig after vLLM resolved its defaults (the
KV blocks are known by then: the scheduler is built after the KV cache).
Where there is no GPU the device fields are None and `device_reason` says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import EngineConfig
from vllm_runbook.collector.exporter import Sample

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import VllmScheduler


def read_engine_config(
    scheduler: VllmScheduler, device: tuple[str | None, int | None, str | None]
) -> EngineConfig:
    """From the scheduler's VllmConfig; `device`: (name, SM count, why missing).
    Built once, at engine start (not in a step)."""
    from vllm_runbook.collector.adapters.memory_utilization import memory_utilization
    from vllm_runbook.collector.settings import vllm_version

    config = scheduler.vllm_config
    cache, sched, model = config.cache_config, config.scheduler_config, config.model_config
    parallel, compilation = config.parallel_config, config.compilation_config
    spec = config.speculative_config
    mode = compilation.cudagraph_mode
    try:
        from vllm.platforms import current_platform

        platform = str(current_platform.device_type)
    except Exception:
        platform = "unknown"
    name, sm_count, reason = device
    utilization, extensible = memory_utilization(cache)
    if platform == "cpu":
        reason = "CPU engine: no GPU"
    return EngineConfig(
        block_size=int(scheduler.block_size),
        # vLLM's block pool counts one null block; the usable blocks are one fewer.
        num_gpu_blocks=int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1,
        num_cpu_blocks=None if cache.num_cpu_blocks is None else int(cache.num_cpu_blocks),
        gpu_memory_utilization=utilization,
        max_model_len=int(model.max_model_len),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_active_seqs=None
        if getattr(sched, "max_num_active_seqs", None) is None
        else int(sched.max_num_active_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        long_prefill_token_threshold=int(sched.long_prefill_token_threshold or 0),
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        enforce_eager=bool(model.enforce_eager),
        cudagraph_mode="NONE" if mode is None else str(getattr(mode, "name", mode)),
        cudagraph_capture_sizes=sorted(compilation.cudagraph_capture_sizes or []),
        kv_cache_dtype=str(cache.cache_dtype),
        dtype=str(model.dtype).removeprefix("torch."),
        quantization=None if model.quantization is None else str(model.quantization),
        tensor_parallel_size=int(parallel.tensor_parallel_size or 1),
        pipeline_parallel_size=int(parallel.pipeline_parallel_size or 1),
        data_parallel_size=int(parallel.data_parallel_size or 1),
        speculative_method=None if spec is None else str(getattr(spec, "method", None)),
        num_speculative_tokens=None
        if spec is None
        else int(getattr(spec, "num_speculative_tokens", 0) or 0),
        scheduling_policy=str(getattr(sched.policy, "value", sched.policy)),
        vllm_version=vllm_version(),
        platform=platform,
        device_name=None if platform == "cpu" else name,
        sm_count=None if platform == "cpu" else sm_count,
        device_reason=reason,
        extensible_kv_cache=extensible,
    )


def info_label_values(config: EngineConfig) -> tuple[str, ...]:
    """The info series' label values, in metrics.CONFIG_INFO_LABELS order
    (None: the empty string, which Prometheus treats as no label)."""
    return tuple(_label(getattr(config, label)) for label in M.CONFIG_INFO_LABELS)


def config_samples(config: EngineConfig) -> list[Sample]:
    """The info series and the numeric gauges rules compare."""
    samples = [
        Sample(M.ENGINE_CONFIG_INFO, 1.0, info_label_values(config)),
        Sample(M.CONFIG_BLOCK_SIZE, config.block_size),
        Sample(M.CONFIG_NUM_GPU_BLOCKS, config.num_gpu_blocks),
        Sample(M.CONFIG_GPU_MEMORY_UTILIZATION, config.gpu_memory_utilization),
        Sample(M.CONFIG_MAX_MODEL_LEN, config.max_model_len),
        Sample(M.CONFIG_CHUNKED_PREFILL, 1.0 if config.enable_chunked_prefill else 0.0),
    ]
    if config.sm_count is not None:
        samples.append(Sample(M.CONFIG_GPU_SM_COUNT, config.sm_count))
    return samples


def _label(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
