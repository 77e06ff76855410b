"""vllm-runbook collector: the in-process vLLM plugin.

Imports nothing from `rules` or `runbooks`; depends on vllm, prometheus-client
and (optionally) pynvml. See `vllm_runbook.collector.plugin` for how it loads.
"""

from vllm_runbook.collector.metrics import ALL_METRICS, METRICS_BY_NAME, MetricSpec

__all__ = ["ALL_METRICS", "METRICS_BY_NAME", "MetricSpec"]
