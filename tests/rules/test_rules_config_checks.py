"""`runbook check`'s configuration checks: exact verdicts for good and bad settings."""

from __future__ import annotations

from typing import Any

from vllm_runbook.collector.agent_api import AgentState, EngineConfig, LengthSummary, Workload
from vllm_runbook.rules.config_checks import recommended_block_size, run_config_checks

from tests.fake_agent import STARTUP, agent_state

GPU_CONFIG: dict[str, Any] = dict(
    block_size=16,
    num_gpu_blocks=10_000,
    num_cpu_blocks=None,
    gpu_memory_utilization=0.85,
    max_model_len=8192,
    max_num_seqs=64,
    max_num_active_seqs=None,
    max_num_batched_tokens=2048,
    enable_chunked_prefill=True,
    long_prefill_token_threshold=0,
    enable_prefix_caching=True,
    enforce_eager=False,
    cudagraph_mode="FULL_AND_PIECEWISE",
    cudagraph_capture_sizes=[1, 2, 4, 8],
    kv_cache_dtype="auto",
    dtype="bfloat16",
    quantization=None,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    data_parallel_size=1,
    speculative_method=None,
    num_speculative_tokens=None,
    scheduling_policy="fcfs",
    vllm_version="0.32.0",
    platform="cuda",
    device_name="NVIDIA A100-SXM4-80GB",
    sm_count=108,
    device_reason=None,
)


def lengths(p10: int, p50: int, p90: int, p99: int) -> LengthSummary:
    return LengthSummary(count=100, p10=p10, p50=p50, p90=p90, p99=p99, max=p99)


def state(
    config: dict[str, Any] | None = None,
    knobs: dict[str, Any] | None = None,
    prompts: LengthSummary | None = None,
    long_ratio: float | None = 0.0,
    what_if: dict[str, float] | None = None,
    running: int = 24,
) -> AgentState:
    prompts = prompts or lengths(100, 400, 900, 1500)
    base = agent_state(
        {**STARTUP, "max_num_batched_tokens": 2048, "max_num_seqs": 64, "policy": "fcfs",
         **(knobs or {})},
        {
            "block_fragmentation_at_block_size": what_if or {"16": 0.05, "32": 0.09},
            "requests_running": running,
        },
    )  # fmt: skip
    workload = Workload(
        window_seconds=60,
        requests_arrived=100,
        prompt_tokens=prompts,
        output_tokens=lengths(100, 200, 300, 400),
        prompt_length_spread_ratio=None if prompts.p10 is None else prompts.p90 / prompts.p10,  # type: ignore[operator]
        long_prompt_ratio=long_ratio,
    )
    return base.model_copy(
        update={"config": EngineConfig(**{**GPU_CONFIG, **(config or {})}), "workload": workload}
    )


def verdicts(s: AgentState) -> dict[str, tuple[str, str]]:
    return {r.name: (r.status, r.shown) for r in run_config_checks(s)}


def test_good_settings_pass() -> None:
    assert verdicts(state(prompts=lengths(300, 400, 900, 1500))) == {
        "token budget": ("pass", "2048"),
        "block size": ("pass", "16 (frag 5%)"),
        "chunked prefill": ("pass", "on"),
        "memory headroom": ("pass", "0.85"),
        "max_num_seqs": ("pass", "64"),
        "scheduling policy": ("pass", "fcfs (3.0:1)"),
    }


def test_bad_settings_warn_and_fail_with_the_reports_reasons() -> None:
    results = {
        r.name: r
        for r in run_config_checks(
            state(
                config={"gpu_memory_utilization": 0.95, "enable_chunked_prefill": False,
                        "block_size": 32},
                knobs={"max_num_batched_tokens": 8192, "max_num_seqs": 256},
                long_ratio=0.02,
                what_if={"16": 0.05, "32": 0.18},
            )
        )
    }  # fmt: skip
    assert {name: r.status for name, r in results.items()} == {
        "token budget": "warn",
        "block size": "warn",
        "chunked prefill": "fail",
        "memory headroom": "fail",
        "max_num_seqs": "warn",
        "scheduling policy": "warn",  # P90/P10 = 900/100 = 9:1
    }
    assert "safe threshold 2048" in results["token budget"].note
    assert results["block size"].shown == "32 (frag 18%)"
    assert "→ 16 (fragmentation there 5%)" in results["block size"].note
    assert "2.0% of prompts are above 8192 tokens" in results["chunked prefill"].note
    assert "OOM risk" in results["memory headroom"].note
    assert "108 SMs x 1.5 = 162" in results["max_num_seqs"].note
    # A warning is not a failure: warn ≠ fail in the exit code (only fail counts).
    assert results["memory headroom"].value == 0.95


def test_on_cpu_and_without_traffic_the_checks_say_why() -> None:
    cpu = state(
        config={"platform": "cpu", "device_name": None, "sm_count": None,
                "device_reason": "CPU engine: no GPU", "gpu_memory_utilization": 0.2},
        prompts=LengthSummary(count=0, p10=None, p50=None, p90=None, p99=None, max=None),
        long_ratio=None,
    )  # fmt: skip
    results = {r.name: (r.status, r.note) for r in run_config_checks(cpu)}
    assert results["memory headroom"] == (
        "n/a",
        "CPU engine: gpu_memory_utilization is the share of RAM for the KV cache",
    )
    assert results["max_num_seqs"] == ("n/a", "CPU engine: no GPU")
    assert results["block size"][0] == results["scheduling policy"][0] == "n/a"
    assert results["chunked prefill"] == ("pass", "")  # on: nothing to measure first


def test_block_size_by_length_mix() -> None:
    assert recommended_block_size(120, 600) == 8  # 50-300-token chat
    assert recommended_block_size(2000, 6000) == 16
    assert recommended_block_size(20_000, 40_000) == 64
    assert recommended_block_size(50_000, 100_000) == 128


def test_on_an_idle_engine_the_block_size_is_judged_on_the_median_request() -> None:
    """Nothing runs: the live fragmentation reads 0 at every size, so the window's
    median request (P50 prompt + P50 output) is laid into blocks instead."""
    s = state(config={"block_size": 128}, prompts=lengths(100, 200, 300, 400), running=0)
    result = {r.name: r for r in run_config_checks(s)}["block size"]
    # 200 + 200 = 400 tokens: 4 blocks of 128 (512, 22 % empty), 50 blocks of 8 (400).
    assert (result.status, result.shown) == ("warn", "128 (frag 22% at the P50 context 400)")
    assert "→ 8 (fragmentation there 0%); restart to change" in result.note
    ok = state(config={"block_size": 8}, prompts=lengths(100, 200, 300, 400), running=0)
    result = {r.name: r for r in run_config_checks(ok)}["block size"]
    assert (result.status, result.shown) == ("pass", "8 (frag 0% at the P50 context 400)")


def test_vllm_034s_extensible_kv_cache_is_not_judged_as_a_fraction() -> None:
    """vLLM 0.34 on CUDA sizes the KV cache from the memory free after
    warm-up (gpu_memory_utilization resolves to 1.0): the reports' headroom
    rule is for a fixed fraction, so it says n/a instead of an OOM risk."""
    extensible = state(config={"gpu_memory_utilization": 1.0, "extensible_kv_cache": True})
    results = {r.name: (r.status, r.note) for r in run_config_checks(extensible)}
    assert results["memory headroom"] == (
        "n/a",
        "extensible KV cache: vLLM sizes it from the memory free after warm-up, not a fraction",
    )
    fixed = state(config={"gpu_memory_utilization": 1.0})
    assert {r.name: r.status for r in run_config_checks(fixed)}["memory headroom"] == "fail"
