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
    in_engine: tuple[int, float] | None = None,
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
        requests_in_engine_peak=None if in_engine is None else in_engine[0],
        requests_in_engine_mean=None if in_engine is None else in_engine[1],
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
        # The fake agent has no NVML: tests/rules/test_rules_hardware_check.py polls one.
        "hardware": ("n/a", "n/a"),
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
        "hardware": "n/a",
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
    assert results["hardware"] == (
        "n/a",
        "CPU engine: no GPU, no compute capability or PCIe link to judge",
    )
    assert results["block size"][0] == results["scheduling policy"][0] == "n/a"
    assert results["chunked prefill"] == ("pass", "")  # on: nothing to measure first


def test_block_size_by_length_mix() -> None:
    assert recommended_block_size(120, 600) == 8  # 50-300-token chat
    assert recommended_block_size(2000, 6000) == 16
    assert recommended_block_size(3000, 9000) == 16
    assert recommended_block_size(3200, 12_000) == 32  # documents over 3k tokens
    assert recommended_block_size(20_000, 40_000) == 64
    assert recommended_block_size(50_000, 100_000) == 128


def checks_of(s: AgentState) -> dict[str, Any]:
    return {r.name: r for r in run_config_checks(s)}


def test_the_token_budget_warns_above_the_reports_safe_2048() -> None:
    assert checks_of(state())["token budget"].status == "pass"  # 2048 itself
    result = checks_of(state(knobs={"max_num_batched_tokens": 2560}))["token budget"]
    assert (result.status, result.limit, result.note) == (
        "warn",
        "<= 2048 (2000-3000)",
        "above the reports' safe threshold 2048 (their edge: 0% OOM at 2048, 5.2% at 4096), "
        "though inside their best range 2000-3000",
    )
    assert checks_of(state(knobs={"max_num_batched_tokens": 4096}))["token budget"].note == (
        "above the reports' best range 2000-3000 and their safe threshold 2048: per-step "
        "activation memory is their first OOM cause"
    )


def test_documents_over_3k_tokens_get_the_reports_32() -> None:
    docs = state(prompts=lengths(3100, 4000, 8000, 11_000), what_if={"16": 0.01, "32": 0.02})
    result = checks_of(docs)["block size"]
    assert (result.status, result.shown) == ("pass", "16 (frag 1%)")
    assert result.note.endswith(
        "32 for documents over 3k tokens, 64 for 32k contexts, 128 beyond 64k; this mix "
        "(P50 prompt 4000, P99 context 11400) → 32 (fragmentation there 2%); restart to change"
    )


def test_block_64_comes_with_its_memory_note() -> None:
    long = state(prompts=lengths(20_000, 30_000, 33_000, 34_000), what_if={"16": 0.01, "64": 0.02})
    assert checks_of(long)["block size"].note.endswith(
        "→ 64 (fragmentation there 2%); restart to change; block size 64 costs about 5% more "
        "memory (the reports): keep it as headroom, --gpu-memory-utilization 0.8"
    )
    # An engine that runs 64: the utilisation the reports call critical is 0.05 lower.
    at_64 = {"block_size": 64, "gpu_memory_utilization": 0.82}
    result = checks_of(state(config=at_64))["memory headroom"]
    assert (result.status, result.note) == (
        "warn",
        "above 0.8, the reports' critical point (block size 64: about 5% more memory, the reports)",
    )
    result = checks_of(state(config={**at_64, "gpu_memory_utilization": 0.8}))["memory headroom"]
    assert (result.status, result.note) == (
        "pass",
        "at least 20% headroom (block size 64: about 5% more memory, the reports)",
    )
    assert (
        checks_of(state(config={**at_64, "gpu_memory_utilization": 0.86}))["memory headroom"].status
        == "fail"
    )


def test_max_num_seqs_on_an_a100_is_judged_by_the_reports_measurement() -> None:
    a100 = "the reports' A100: 72 best (+11% throughput over 64), above 80 the L1 cache hit "
    a100 += "rate falls (108 SMs x 1.5 = 162 is the rule of thumb it overrides)"
    for seqs, status in ((72, "pass"), (80, "pass"), (81, "warn"), (160, "warn")):
        result = checks_of(state(knobs={"max_num_seqs": seqs}))["max_num_seqs"]
        assert (result.status, result.note) == (status, a100), seqs
    h100 = {"device_name": "NVIDIA H100 80GB HBM3", "sm_count": 132}
    result = checks_of(state(config=h100, knobs={"max_num_seqs": 150}))["max_num_seqs"]
    assert (result.status, result.note) == (
        "pass",
        "132 SMs → 198; the reports' only measurement, on an A100, found less: above 80 "
        "(not 162) the L1 hit rate fell",
    )
    result = checks_of(state(config=h100, knobs={"max_num_seqs": 200}))["max_num_seqs"]
    assert result.status == "warn"


def test_tiered_is_advised_only_above_20_requests_at_once() -> None:
    spread = lengths(100, 400, 900, 1500)  # 9:1
    few = checks_of(state(prompts=spread, in_engine=(12, 6.5)))["scheduling policy"]
    assert (few.status, few.note) == (
        "pass",
        "lengths spread 4:1 or more, but at most 12 requests in the engine at once (mean 6.5) "
        "in the window: the reports' hybrid policy costs about 2 ms of scheduling a step "
        "against 15-30 ms saved, a gain that shows above 20 concurrent requests",
    )
    many = checks_of(state(prompts=spread, in_engine=(21, 14.0)))["scheduling policy"]
    assert (many.status, many.note) == (
        "warn",
        "prompt lengths P90/P10 of 4:1 or more hurt batching (the reports), at most 21 "
        "requests in the engine at once (mean 14.0); `runbook set policy=tiered` groups them",
    )
    tiered = checks_of(state(knobs={"policy": "tiered"}, prompts=spread, in_engine=(5, 2.0)))
    assert tiered["scheduling policy"].status == "pass"
    assert tiered["scheduling policy"].note.endswith("; fcfs costs less scheduling here")


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


def test_chunked_prefill_on_cites_the_reports_ab_for_the_prompts_that_arrive() -> None:
    long = checks_of(state(long_ratio=0.02))["chunked prefill"]
    assert (long.status, long.note) == (
        "pass",
        "2.0% of prompts are above 8192 tokens: the reports' A/B measured 8k prefills "
        "320 → 290 ms, 32k 2,100 → 1,250 ms with it on",
    )
    short = checks_of(state())["chunked prefill"]
    assert (short.status, short.note) == (
        "pass",
        "no prompt above 8192 tokens: the reports' A/B measured about 5% less short-prompt "
        "throughput with it on; `benchmarks/chunked_prefill.py` runs that A/B on two engines",
    )
