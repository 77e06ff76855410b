"""The memory utilisation the KV cache is sized with, on every vLLM the
matrix covers.

vLLM <= 0.33 always sets `CacheConfig.gpu_memory_utilization` (0.9 by
default). vLLM 0.34 leaves it None unless the user sets it and resolves it
through `resolved_gpu_memory_utilization`: the value set, else 1.0 with the
extensible KV cache (the default on CUDA and ROCm: the cache is sized from
the memory actually free after warm-up, not from a fraction), else the
platform's default. Feature-detected: the property, not a version string.
"""

from __future__ import annotations

from typing import Any


def memory_utilization(cache: Any) -> tuple[float, bool]:
    """(the utilisation vLLM sizes the KV cache with, whether that cache is
    the extensible one, sized from measured free memory)."""
    if not hasattr(type(cache), "resolved_gpu_memory_utilization"):  # vLLM <= 0.33
        return float(cache.gpu_memory_utilization), False
    extensible = bool(getattr(cache, "enable_extensible_kv_cache", False))
    return float(cache.resolved_gpu_memory_utilization), extensible
