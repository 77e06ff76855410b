"""The scheduler hook: per-step statistics computed inside the EngineCore.

`RunbookSchedulerMixin` is mixed in front of whatever scheduler class vLLM
chose (Scheduler, AsyncScheduler, a user class). Each step it times
`schedule()`, reads the scheduler's own state and updates the metrics of
`collector.metrics`. It never changes what the scheduler does.

The engine comes first: any exception in our code disables the collector for
that engine (one log line, `vllm_runbook_collector_up 0`) and the scheduler
goes on as if we were not there. vLLM's own exceptions pass through untouched.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from collector import metrics as M
from collector.nvml import NvmlPoller, load_pynvml
from collector.server import AgentServer
from collector.window import SlidingWindowRatio

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_PORT = 9360
TESTED_VLLM = ((0, 32), (0, 32))  # inclusive (major, minor) range


@dataclass(frozen=True)
class CollectorSettings:
    host: str = "127.0.0.1"
    port: int | None = DEFAULT_PORT  # None: no HTTP endpoint; 0: any free port
    window_seconds: float = 60.0
    nvml_interval: float = 5.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CollectorSettings:
        env = dict(os.environ) if env is None else env
        port_text = env.get("VLLM_RUNBOOK_PORT", str(DEFAULT_PORT)).strip().lower()
        port = None if port_text in ("off", "none", "-1") else int(port_text)
        return cls(
            host=env.get("VLLM_RUNBOOK_HOST", "127.0.0.1"),
            port=port,
            window_seconds=float(env.get("VLLM_RUNBOOK_WINDOW_SECONDS", "60")),
            nvml_interval=float(env.get("VLLM_RUNBOOK_NVML_INTERVAL", "5")),
        )


def check_vllm_version(version: str) -> bool:
    """True when `version` is in the tested range; logs a warning otherwise."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    low, high = TESTED_VLLM
    if not (low <= (major, minor) <= high):
        logger.warning(
            "vllm-runbook: vLLM %s is outside the tested range %d.%d-%d.%d; "
            "the collector will disable itself if the scheduler differs",
            version, *low, *high,
        )  # fmt: skip
        return False
    return True


def predicted_padded_tokens(num_tokens: int, capture_sizes: list[int]) -> int:
    """Tokens the model runner executes for a batch of `num_tokens` when it pads
    to the smallest cudagraph capture size ≥ n (eager above the largest)."""
    if not capture_sizes or num_tokens > capture_sizes[-1] or num_tokens <= 0:
        return num_tokens
    return capture_sizes[bisect.bisect_left(capture_sizes, num_tokens)]


class EngineCollector:
    """Owns one engine's metrics, windows, endpoint and NVML poller."""

    def __init__(
        self,
        scheduler: Any,
        settings: CollectorSettings | None = None,
        registry: CollectorRegistry | None = None,
        nvml: Any = "auto",
    ) -> None:
        self.settings = settings or CollectorSettings.from_env()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.enabled = True
        self.error: str | None = None
        self.start_time = time.time()

        vllm_config = scheduler.vllm_config
        served = vllm_config.model_config.served_model_name
        self.model_name = served[0] if isinstance(served, list) else str(served)
        self.dp_rank = int(vllm_config.parallel_config.data_parallel_rank or 0)
        self.labels = (self.model_name, str(self.dp_rank))
        self.block_size = int(scheduler.block_size)

        self.metrics = {spec.name: M.build(spec, self.registry) for spec in M.ALL_METRICS}
        self._bind_children()

        # KV blocks: the first KV cache group (full attention for decoder LLMs).
        kv_manager = scheduler.kv_cache_manager
        self.block_pool = kv_manager.block_pool
        group0 = kv_manager.coordinator.single_type_managers[0]
        self._req_to_blocks: dict[str, list[Any]] = group0.req_to_blocks
        # Only full attention never holds null placeholder blocks; other kinds
        # (sliding window, mamba) need the slower count.
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        self._blocks_have_nulls = type(group0) is not FullAttentionManager

        compilation = vllm_config.compilation_config
        mode = compilation.cudagraph_mode
        cudagraphs_on = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
        self.capture_sizes = (
            sorted(compilation.cudagraph_capture_sizes or []) if cudagraphs_on else []
        )

        self.hit_window = SlidingWindowRatio(self.settings.window_seconds)
        self.padding_window = SlidingWindowRatio(self.settings.window_seconds)

        self.startup_max_num_batched_tokens = int(scheduler.max_num_scheduled_tokens)
        self.startup_max_num_seqs = int(scheduler.max_num_active_reqs)
        self._known_knobs: tuple[Any, ...] = ()
        self._set_static(scheduler)
        self._wrap_prefix_cache_stats(kv_manager)

        self.server: AgentServer | None = None
        if self.settings.port is not None:
            port = self.settings.port + self.dp_rank if self.settings.port else 0
            try:
                self.server = AgentServer(
                    self.settings.host, port, self.registry, before_scrape=self.refresh_windows
                ).start()
                logger.info(
                    "vllm-runbook: agent for engine %d on %s", self.dp_rank, self.server.url
                )
            except OSError as exc:
                logger.warning(
                    "vllm-runbook: cannot serve on %s:%d (%s); set VLLM_RUNBOOK_PORT",
                    self.settings.host, port, exc,
                )  # fmt: skip

        self.nvml = NvmlPoller(
            load_pynvml() if nvml == "auto" else nvml,
            self.metrics[M.NVML_UP.name],
            self.metrics[M.GPU_MEMORY_USED.name],
            self.metrics[M.GPU_MEMORY_TOTAL.name],
            self.metrics[M.GPU_UTILIZATION.name],
            self.labels,
            self.settings.nvml_interval,
        )
        self.nvml.start()

    # -- setup ---------------------------------------------------------------

    def _bind_children(self) -> None:
        m, lv = self.metrics, self.labels
        child = lambda spec: m[spec.name].labels(*lv)  # noqa: E731
        self.c_up = child(M.COLLECTOR_UP)
        self.c_queries = child(M.PREFIX_CACHE_QUERIES)
        self.c_hits = child(M.PREFIX_CACHE_HITS)
        self.c_hit_ratio = child(M.KV_HIT_RATIO)
        self.c_fragmentation = child(M.BLOCK_FRAGMENTATION)
        self.c_padding = child(M.PADDING_RATIO)
        self.c_length_padding = child(M.LENGTH_PADDING_RATIO)
        self.c_schedule_seconds = child(M.SCHEDULE_SECONDS)
        self.c_steps = child(M.STEPS)
        self.c_scheduled_tokens = child(M.SCHEDULED_TOKENS)
        self.c_token_budget = child(M.TOKEN_BUDGET)
        self.c_step_tokens = child(M.STEP_TOKENS)
        self.c_budget_fill = child(M.BUDGET_FILL)
        self.c_padded = child(M.PADDED_TOKENS)
        self.c_unpadded = child(M.UNPADDED_TOKENS)
        self.c_running = child(M.REQUESTS_RUNNING)
        self.c_waiting = child(M.REQUESTS_WAITING)
        self.c_preemptions = child(M.PREEMPTIONS)
        self.c_blocks_used = child(M.KV_BLOCKS_USED)
        self.c_blocks_free = child(M.KV_BLOCKS_FREE)
        self.c_kv_usage = child(M.KV_CACHE_USAGE)
        self.c_max_tokens = child(M.MAX_NUM_BATCHED_TOKENS)
        self.c_max_seqs = child(M.MAX_NUM_SEQS)

    def _set_static(self, scheduler: Any) -> None:
        lv = self.labels
        self.c_up.set(1)
        self.metrics[M.ENGINE_START_TIME.name].labels(*lv).set(self.start_time)
        self.metrics[M.STARTUP_MAX_NUM_BATCHED_TOKENS.name].labels(*lv).set(
            self.startup_max_num_batched_tokens
        )
        self.metrics[M.STARTUP_MAX_NUM_SEQS.name].labels(*lv).set(self.startup_max_num_seqs)
        self.c_hit_ratio.set(math.nan)  # no lookups yet: undefined, not "0 % hits"
        self.c_padding.set(0)
        for gauge in (self.c_fragmentation, self.c_length_padding, self.c_step_tokens):
            gauge.set(0)
        # Touch counters so every series exists from the start.
        for counter in (self.c_queries, self.c_hits, self.c_preemptions, self.c_steps):
            counter.inc(0)
        self.update_knobs(scheduler)
        self.update_queues(scheduler)

    def _wrap_prefix_cache_stats(self, kv_manager: Any) -> None:
        """Count prefix-cache lookups at admission, whatever vLLM's log_stats."""
        original = kv_manager.record_prefix_cache_stats
        lookup_enabled = kv_manager.prefix_cache_lookup_enabled
        collector = self

        def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
            if collector.enabled:
                try:
                    if lookup_enabled(request):
                        collector.on_prefix_lookup(request.num_tokens, num_hits)
                except Exception as exc:
                    collector.disable(exc)
            original(request, num_hits)

        kv_manager.record_prefix_cache_stats = record_prefix_cache_stats

    # -- per-step ------------------------------------------------------------

    def on_prefix_lookup(self, num_tokens: int, num_hits: int) -> None:
        self.c_queries.inc(num_tokens)
        self.c_hits.inc(num_hits)
        self.hit_window.add(num_hits, num_tokens)
        self.c_hit_ratio.set(self.hit_window.ratio(math.nan))

    def on_schedule(self, scheduler: Any, output: Any, elapsed: float) -> None:
        """After schedule(): `request.num_computed_tokens` includes this step."""
        self.c_schedule_seconds.observe(elapsed)
        tokens = output.total_num_scheduled_tokens
        budget = scheduler.max_num_scheduled_tokens
        self.c_steps.inc()
        self.c_scheduled_tokens.inc(tokens)
        self.c_token_budget.inc(budget)
        self.c_step_tokens.set(tokens)
        self.c_budget_fill.set(tokens / budget if budget else 0.0)
        preempted = len(output.preempted_req_ids)
        if preempted:
            self.c_preemptions.inc(preempted)

        scheduled = output.num_scheduled_tokens
        req_to_blocks = self._req_to_blocks
        nulls = self._blocks_have_nulls
        computed = held = n = total_len = max_len = 0
        for request in scheduler.running:
            length = request.num_computed_tokens
            computed += length
            blocks = req_to_blocks.get(request.request_id)
            if blocks:
                held += sum(1 for b in blocks if not b.is_null) if nulls else len(blocks)
            if request.request_id in scheduled:
                n += 1
                total_len += length
                if length > max_len:
                    max_len = length
        self.c_fragmentation.set(1.0 - computed / (held * self.block_size) if held else 0.0)
        self.c_length_padding.set(1.0 - total_len / (n * max_len) if max_len else 0.0)
        self.update_queues(scheduler)
        if (scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs,
                scheduler.policy) != self._known_knobs:  # fmt: skip
            self.update_knobs(scheduler)

    def on_update(self, scheduler: Any, scheduler_output: Any, runner_output: Any) -> None:
        """After update_from_output(): padding of the executed batch, and the
        queues once finished requests have left (an idle engine steps no more)."""
        stat = getattr(runner_output, "cudagraph_stats", None)
        if stat is not None:
            unpadded, padded = stat.num_unpadded_tokens, stat.num_padded_tokens
        else:
            unpadded = scheduler_output.total_num_scheduled_tokens
            padded = predicted_padded_tokens(unpadded, self.capture_sizes)
        if padded:
            self.c_padded.inc(padded)
            self.c_unpadded.inc(unpadded)
            self.padding_window.add(padded - unpadded, padded)
            self.c_padding.set(self.padding_window.ratio())
        self.update_queues(scheduler)
        if not scheduler.running:
            self.c_fragmentation.set(0.0)

    def update_queues(self, scheduler: Any) -> None:
        self.c_running.set(len(scheduler.running))
        self.c_waiting.set(len(scheduler.waiting) + len(scheduler.kv_holding_waiting))
        pool = self.block_pool
        usable = pool.num_gpu_blocks - 1  # one block is vLLM's null block
        free = pool.get_num_free_blocks()
        self.c_blocks_free.set(free)
        self.c_blocks_used.set(usable - free)
        self.c_kv_usage.set((usable - free) / usable if usable else 0.0)

    def update_knobs(self, scheduler: Any) -> None:
        policy = scheduler.policy
        self._known_knobs = (
            scheduler.max_num_scheduled_tokens,
            scheduler.max_num_active_reqs,
            policy,
        )
        self.c_max_tokens.set(scheduler.max_num_scheduled_tokens)
        self.c_max_seqs.set(scheduler.max_num_active_reqs)
        active = getattr(policy, "value", str(policy))
        gauge = self.metrics[M.SCHEDULER_POLICY.name]
        for name in M.POLICIES:
            gauge.labels(*self.labels, name).set(1 if name == active else 0)

    def refresh_windows(self) -> None:
        """Slide the windows at scrape time, so an idle engine's ratios age out."""
        if self.enabled:
            self.c_hit_ratio.set(self.hit_window.ratio(math.nan))
            self.c_padding.set(self.padding_window.ratio())

    # -- failure -------------------------------------------------------------

    def disable(self, exc: BaseException) -> None:
        """Fail open: stop collecting for this engine, say so once."""
        if not self.enabled:
            return
        self.enabled = False
        self.error = f"{type(exc).__name__}: {exc}"
        try:
            self.c_up.set(0)
        finally:
            logger.error(
                "vllm-runbook: collector disabled for engine %d after an error; "
                "the engine keeps serving without it",
                self.dp_rank,
                exc_info=exc,
            )

    def close(self) -> None:
        self.nvml.stop()
        if self.server is not None:
            self.server.close()


class RunbookSchedulerMixin:
    """Mixed in front of a vLLM scheduler class; see the module docstring."""

    _runbook: EngineCollector | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._runbook = EngineCollector(self)
        except Exception:
            self._runbook = None
            logger.exception("vllm-runbook: collector not started; the engine runs without it")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        runbook = self._runbook
        if runbook is None or not runbook.enabled:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        elapsed = time.perf_counter() - start
        try:
            runbook.on_schedule(self, output, elapsed)
        except Exception as exc:
            runbook.disable(exc)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        runbook = self._runbook
        if runbook is not None and runbook.enabled:
            try:
                runbook.on_update(self, scheduler_output, model_runner_output)
            except Exception as exc:
                runbook.disable(exc)
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            if self._runbook is not None:
                self._runbook.close()


def with_collector(scheduler_cls: type) -> type:
    """`scheduler_cls` with the hook mixed in front (itself if already hooked)."""
    if issubclass(scheduler_cls, RunbookSchedulerMixin):
        return scheduler_cls
    return type(
        f"Runbook{scheduler_cls.__name__}",
        (RunbookSchedulerMixin, scheduler_cls),
        {"__module__": __name__},
    )
