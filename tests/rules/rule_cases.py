"""Synthetic series for every rule of the catalog: where it must fire and where not.

`fires_at` is the exact oracle under Prometheus 2 ranges (closed [t-w, t],
what Debian's promtool 2.42 uses), worked out from the series in the
comments; `fires_at_left_open` is the oracle under Prometheus 3's left-open
ranges where that differs. Samples every 30 s, evaluations every 30 s; a
sample index i is at i * 30 s. The critical variant of VllmPaddingHigh has
its own cases.
"""

from __future__ import annotations

from collections.abc import Iterable

from rule_harness import Case, series
from vllm_runbook.collector import metrics as M

KV_HIT = M.KV_HIT_RATIO.series_name
FRAG = M.BLOCK_FRAGMENTATION.series_name
PADDING = M.PADDING_RATIO.series_name
LENGTH_PADDING = M.LENGTH_PADDING_RATIO.series_name
SCHED_SUM = M.SCHEDULE_SECONDS.name + "_sum"
SCHED_COUNT = M.SCHEDULE_SECONDS.name + "_count"
KV_USAGE = M.KV_CACHE_USAGE_PEAK.series_name
PREEMPT = M.PREEMPTIONS.series_name
WAITING = M.REQUESTS_WAITING.series_name
RUNNING = M.REQUESTS_RUNNING.series_name
STALLED = M.ENGINE_STALLED.series_name
TIER_WAITING = M.TIER_REQUESTS_WAITING.series_name
TIER_OLDEST = M.TIER_OLDEST_WAITING.series_name
SCHEDULED = M.SCHEDULED_TOKENS.series_name
BUDGET = M.TOKEN_BUDGET.series_name
START = M.ENGINE_START_TIME.series_name
WARMUP_DONE = M.WARMUP_DONE.series_name
GPU_USED = M.GPU_MEMORY_USED.series_name
GPU_TOTAL = M.GPU_MEMORY_TOTAL.series_name
GPU_UTIL = M.GPU_UTILIZATION.series_name
GEN = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds_bucket"
REUSE_GAP_COUNT = "vllm:kv_block_reuse_gap_seconds_count"
DRAFT = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
FINISHED = "vllm:request_success_total"
E2E = "vllm:e2e_request_latency_seconds_bucket"
H, M2 = 3600.0, 60.0


def latency(fast_until: int, n: int, slow_bucket: str = "2.5") -> list[tuple[str, str]]:
    """10 requests a scrape: <= 0.5 s up to sample `fast_until`, then in `slow_bucket`."""
    out = []
    for le in ("0.5", "1", "2.5", "5", "+Inf"):
        if float(le) >= float(slow_bucket):
            values = f"0+10x{n}"
        else:
            values = f"0+10x{fast_until} {10 * fast_until}x{n - fast_until - 1}"
        out.append(series(E2E, values, le=le))
    return out


def idle_before_evict(short_from: int, after_step_le: str, n: int) -> list[tuple[str, str]]:
    """vLLM's idle-before-evict histogram: 10 sampled evictions a scrape idle over 60 s,
    then from sample `short_from` 12 a scrape in the bucket that ends at `after_step_le`
    (its lower bound the previous one's). Every bucket starts at 10000, so no rate is
    clamped at zero and Prometheus 3's left-open ranges scale all buckets alike."""
    out = []
    for le in ("1", "5", "10", "30", "60", "+Inf"):
        if le == "+Inf":
            values = f"10000+10x{short_from} {10000 + 10 * short_from + 12}+12x{n - short_from - 1}"
        elif float(le) >= float(after_step_le):
            values = f"10000x{short_from} 10012+12x{n - short_from - 1}"
        else:
            values = f"10000x{n}"
        out.append(series(IDLE_BEFORE_EVICT, values, le=le))
    return out


def fast_latency(n: int) -> list[tuple[str, str]]:
    return [series(E2E, f"0+10x{n}", le=le) for le in ("0.5", "1", "2.5", "5", "+Inf")]


def doubling(n: int, steady: int) -> str:
    """A counter whose increments double each scrape for n samples, then grow steadily."""
    values = [2**i - 1 for i in range(n)]
    return " ".join(map(str, values)) + f" {2**n - 1}+{2 ** (n - 1)}x{steady}"


CASES: tuple[Case, ...] = (
    # 0.5 from sample 20 (600 s): true at 600, `for` 5m -> 900.
    Case("VllmKVCacheHitRatioLow", "fire", (series(KV_HIT, "0.95x19 0.5x40"),), 1200, 900),
    # 0.9 is above 0.85, and NaN (no lookups) compares false like in PromQL.
    # (promtool's notation has no `NaNxN`: the NaNs are spelled out.)
    Case("VllmKVCacheHitRatioLow", "quiet", (series(KV_HIT, "0.9x19" + " NaN" * 41),), 1200, None),
    # From sample 121 schedule() takes 100 ms instead of 1 ms and generation stops.
    # Mean-time ratio >= 1.5 at once. The baseline is the hour ending 15m (window
    # + `for`) back, which reaches before the first sample: its rate is
    # extrapolated only half an interval past the data (at 3720 s: 282000 over
    # 2820 s of samples -> 283500 / 3600 = 78.75/s, not 100/s). Throughput over
    # 5m: 18000 / 300 = 60/s at 3720 -> 0.76 <= 0.9 (at 3660: 80 / 77.1 = 1.04).
    # True from 3720 (3690 left-open), `for` 10m -> 4320 (4290).
    Case(
        "VllmKVFragmentationSuspected",
        "fire",
        (
            series(SCHED_COUNT, "0+100x240"),
            series(SCHED_SUM, "0+0.1x120 22+10x119"),
            series(GEN, "0+3000x120 360000x119"),
        ),
        2 * H,
        4320,
        fires_at_left_open=4290,
    ),
    # Same slow-down, throughput steady: not fragmentation.
    Case(
        "VllmKVFragmentationSuspected",
        "quiet",
        (
            series(SCHED_COUNT, "0+100x240"),
            series(SCHED_SUM, "0+0.1x120 22+10x119"),
            series(GEN, "0+3000x240"),
        ),
        2 * H,
        None,
    ),
    # 0.5 from sample 60: the 5m average passes 0.2 at k=2 (1860 s) -> +10m = 2460.
    Case("VllmBlockFragmentationHigh", "fire", (series(FRAG, "0.1x59 0.5x60"),), H, 2460),
    Case("VllmBlockFragmentationHigh", "quiet", (series(FRAG, "0.1x59 0.19x60"),), H, None),
    # KV usage 0.96 and the first preemption at sample 20 (600 s) -> +30s = 630.
    Case(
        "VllmOOMPressure",
        "fire",
        (
            series(KV_USAGE, "0.5x19 0.96x20"),
            series(PREEMPT, "0x19 1+1x20"),
        ),
        1200,
        630,
    ),
    # No preemption at 0.96 usage, then preemptions at 0.8 usage; GPU memory at 0.9.
    Case(
        "VllmOOMPressure",
        "quiet",
        (
            series(KV_USAGE, "0.96x19 0.8x20"),
            series(PREEMPT, "0x24 1+1x15"),
            series(GPU_USED, "72x39", gpu="0"),
            series(GPU_TOTAL, "80x39", gpu="0"),
        ),
        1200,
        None,
    ),
    # GPU 0 at 79/80 from sample 10 (300 s) -> 330; GPU 1 stays low.
    Case(
        "VllmOOMPressure",
        "fire-gpu",
        (
            series(GPU_USED, "50x9 79x30", gpu="0"),
            series(GPU_TOTAL, "80x39", gpu="0"),
            series(GPU_USED, "10x39", gpu="1"),
            series(GPU_TOTAL, "80x39", gpu="1"),
        ),
        1200,
        330,
    ),
    # 5 preemptions per 100 finished requests from sample 40 (1200 s) -> +5m = 1500.
    Case(
        "VllmOOMRateHigh",
        "fire",
        (
            series(FINISHED, "0+100x80", finished_reason="stop"),
            series(PREEMPT, "0x39 5+5x40"),
        ),
        2400,
        1500,
    ),
    # 0.05 per 100: 0.0005 < 0.001.
    Case(
        "VllmOOMRateHigh",
        "quiet",
        (
            series(FINISHED, "0+100x80", finished_reason="stop"),
            series(PREEMPT, "0+0.05x80"),
        ),
        2400,
        None,
    ),
    # GPU 0 grows 0.5 a scrape from sample 80 under flat load (late enough that the
    # window 30m earlier holds no time before the first sample); the 10m average of
    # the sum reaches 1.05x its value 30m earlier at sample 97 (2910 s) -> +15m = 3810.
    Case(
        "VllmGPUMemoryLeak",
        "fire",
        (
            series(GPU_USED, "40x79 40.5+0.5x100", gpu="0"),
            series(GPU_USED, "40x179", gpu="1"),
            series(SCHEDULED, "0+1000x179"),
        ),
        5400,
        3810,
    ),
    # The same growth while the load doubles: memory follows load, no leak (the
    # doubled load reaches the earlier window only at 4770 s, too late to fire).
    Case(
        "VllmGPUMemoryLeak",
        "quiet",
        (
            series(GPU_USED, "40x79 40.5+0.5x100", gpu="0"),
            series(GPU_USED, "40x179", gpu="1"),
            series(SCHEDULED, "0+1000x79 81000+2000x100"),
        ),
        5400,
        None,
    ),
    # GPU 1 drops to 40 of GPU 0's 60 at sample 30 (900 s): spread 1/3 -> +10m = 1500.
    Case(
        "VllmGPUMemoryImbalance",
        "fire",
        (
            series(GPU_USED, "60x89", gpu="0"),
            series(GPU_USED, "60x29 40x60", gpu="1"),
        ),
        2700,
        1500,
    ),
    Case(
        "VllmGPUMemoryImbalance",
        "quiet",
        (
            series(GPU_USED, "60x89", gpu="0"),
            series(GPU_USED, "60x29 55x60", gpu="1"),
        ),
        2700,
        None,
    ),
    # Requests take ~2 s from sample 121 (P99 2.35 s > 1 s SLA) and the queue
    # grows from then: true at 3630 s -> +2m = 3750.
    Case(
        "VllmLatencySpike",
        "fire",
        (
            *latency(120, 240),
            series(WAITING, "0x120 1+1x119"),
        ),
        2 * H,
        3750,
    ),
    # Same slow requests, queue flat: no spike alert (the queue must be growing).
    Case("VllmLatencySpike", "quiet", (*latency(120, 240), series(WAITING, "3x240")), 2 * H, None),
    # The field report's case: requests take ~2 s from sample 81 (P99 2.36 s at
    # 2430 s, x4.8 its 0.495 s 30m earlier) while 10 requests finish a scrape
    # throughout and the queue stays at 3: true from 2430 -> +2m = 2550.
    Case(
        "VllmLatencyRiseFlatLoad",
        "fire",
        (
            *latency(80, 120),
            series(FINISHED, "0+10x120", finished_reason="stop"),
            series(WAITING, "3x120"),
        ),
        H,
        2550,
    ),
    # The same rise with the queue growing from sample 81: VllmLatencySpike's finding.
    Case(
        "VllmLatencyRiseFlatLoad",
        "quiet-queue-grows",
        (
            *latency(80, 120),
            series(FINISHED, "0+10x120", finished_reason="stop"),
            series(WAITING, "0x80 1+1x39"),
        ),
        H,
        None,
    ),
    # The same rise while twice the requests finish: the load rose.
    Case(
        "VllmLatencyRiseFlatLoad",
        "quiet-load-doubles",
        (
            *latency(80, 120),
            series(FINISHED, "0+10x80 820+20x39", finished_reason="stop"),
            series(WAITING, "3x120"),
        ),
        H,
        None,
    ),
    # At flat load, a rise into the 1 s bucket (P99 0.495 s -> 0.99 s, x2.0) is short
    # of the x3 (a rise of 2.0) the rule needs.
    Case(
        "VllmLatencyRiseFlatLoad",
        "quiet-rise-below",
        (
            *latency(80, 120, slow_bucket="1"),
            series(FINISHED, "0+10x120", finished_reason="stop"),
            series(WAITING, "3x120"),
        ),
        H,
        None,
    ),
    # 60 hot requests wait from sample 20 (600 s): `for` 1m -> 660.
    Case(
        "VllmHotPathBacklog",
        "fire",
        (
            series(TIER_WAITING, "10x19 60x20", tier="hot"),
            series(TIER_WAITING, "5x40", tier="cold"),
        ),
        1200,
        660,
    ),
    # 500 requests wait, but only 50 of them are hot: the hot path is not backed up.
    Case(
        "VllmHotPathBacklog",
        "quiet",
        (
            series(WAITING, "500x40"),
            series(TIER_WAITING, "50x40", tier="hot"),
            series(TIER_WAITING, "200x40", tier="warm"),
            series(TIER_WAITING, "250x40", tier="cold"),
        ),
        1200,
        None,
    ),
    # A cold request waits from sample 20: 30 s more each scrape, 150 s > 120 s at
    # sample 25 (750 s), `for` 30s -> 780. The hot tier is served within seconds.
    Case(
        "VllmRequestStarvation",
        "fire",
        (
            series(TIER_OLDEST, "2x40", tier="hot"),
            series(TIER_OLDEST, "0x19 0+30x20", tier="cold"),
        ),
        1200,
        780,
    ),
    # Waits up to 110 s in every tier, each served before the threshold.
    Case(
        "VllmRequestStarvation",
        "quiet",
        (
            series(TIER_OLDEST, "2x40", tier="hot"),
            series(TIER_OLDEST, "0 30 60 90 110 " * 8, tier="warm"),
            series(TIER_OLDEST, "110x40", tier="cold"),
        ),
        1200,
        None,
    ),
    # Nothing is scheduled from sample 19 (570 s) while 5 requests wait. Closed
    # ranges: the 1m window at 600 s still holds the rise from 540 s, so the rate
    # is 0 from 630 s, `for` 30s -> 660; left-open ranges: from 600 s -> 630.
    Case(
        "VllmEngineStalled",
        "fire",
        (series(SCHEDULED, "0+500x19 9500x20"), series(WAITING, "5x40")),
        1200,
        660,
        fires_at_left_open=630,
    ),
    # The engine goes idle: nothing scheduled, nothing waiting (the queue empties
    # at sample 20, when the last tokens are scheduled).
    Case(
        "VllmEngineStalled",
        "quiet",
        (series(SCHEDULED, "0+500x19 9500x20"), series(WAITING, "5x19 0x20")),
        1200,
        None,
    ),
    # Busy and progressing, with requests waiting all along.
    Case(
        "VllmEngineStalled",
        "quiet-progressing",
        (series(SCHEDULED, "0+500x40"), series(WAITING, "5x40")),
        1200,
        None,
    ),
    # The collector says stalled from sample 20 (600 s): pending at 600, `for` 15s
    # -> firing at the next evaluation, 630.
    Case(
        "VllmEngineStuck",
        "fire-heartbeat",
        (
            series(STALLED, "0x19 1x20"),
            series(GEN, "0+100x40"),
            series(PROMPT, "0+50x40"),
            series(RUNNING, "3x40"),
        ),
        1200,
        630,
    ),
    # One scrape stalled (600 s), progressing again at 630: shorter than `for`.
    Case(
        "VllmEngineStuck",
        "quiet-blip",
        (
            series(STALLED, "0x19 1 0x20"),
            series(GEN, "0+100x40"),
            series(PROMPT, "0+50x40"),
            series(RUNNING, "3x40"),
        ),
        1200,
        None,
    ),
    # No heartbeat series (a stock engine's shape): vLLM's counters stop at sample 19
    # (570 s) while 3 requests stay running. Closed ranges: the 1m window at 600 s
    # still holds the rise from 540 s, so both rates are 0 from 630 s, `for` 15s ->
    # 660; left-open ranges: from 600 s -> 630.
    Case(
        "VllmEngineStuck",
        "fire-counters",
        (
            series(GEN, "0+100x19 1900x20"),
            series(PROMPT, "0+50x19 950x20"),
            series(RUNNING, "3x40"),
            series(WAITING, "0x40"),
        ),
        1200,
        660,
        fires_at_left_open=630,
    ),
    # Only waiting requests (running 0), counters flat from 570 s: the same timing.
    Case(
        "VllmEngineStuck",
        "fire-counters-waiting",
        (
            series(GEN, "0+100x19 1900x20"),
            series(PROMPT, "0+50x19 950x20"),
            series(RUNNING, "0x40"),
            series(WAITING, "4x40"),
        ),
        1200,
        660,
        fires_at_left_open=630,
    ),
    # The engine went idle at 570 s: counters flat, nothing running or waiting.
    Case(
        "VllmEngineStuck",
        "quiet-idle",
        (
            series(STALLED, "0x40"),
            series(GEN, "0+100x19 1900x20"),
            series(PROMPT, "0+50x19 950x20"),
            series(RUNNING, "3x19 0x20"),
            series(WAITING, "0x40"),
        ),
        1200,
        None,
    ),
    # Decode only (no new prompt) with requests running: generation keeps moving.
    # No heartbeat series: the case also runs on vLLM's series alone.
    Case(
        "VllmEngineStuck",
        "quiet-decoding",
        (
            series(GEN, "0+100x40"),
            series(PROMPT, "500x40"),
            series(RUNNING, "3x40"),
        ),
        1200,
        None,
    ),
    # 5 errors per 100 stops from sample 40 (1200 s) -> +5m = 1500.
    Case(
        "VllmErrorRateHigh",
        "fire",
        (
            series(FINISHED, "0+100x80", finished_reason="stop"),
            series(FINISHED, "0x39 10+10x40", finished_reason="error"),
        ),
        2400,
        1500,
    ),
    Case(
        "VllmErrorRateHigh",
        "quiet",
        (
            series(FINISHED, "0+100x80", finished_reason="stop"),
            series(FINISHED, "0+0.2x80", finished_reason="error"),
        ),
        2400,
        None,
    ),
    # From sample 121 the hit ratio drops 0.9 -> 0.3 (5m/1h <= 0.9 from sample 122)
    # (k=2 under both range semantics) and requests take ~2 s (P99 vs 30m earlier
    # >= 1.5 at once): 3660 -> +5m = 3960.
    Case(
        "VllmBatchTooLarge",
        "fire",
        (
            series(M.PREFIX_CACHE_QUERIES.series_name, "0+1000x240"),
            series(M.PREFIX_CACHE_HITS.series_name, "0+900x120 108300+300x119"),
            *latency(120, 240),
        ),
        2 * H,
        3960,
    ),
    # Hit ratio drops but latency stays: the batch is not the problem.
    Case(
        "VllmBatchTooLarge",
        "quiet",
        (
            series(M.PREFIX_CACHE_QUERIES.series_name, "0+1000x240"),
            series(M.PREFIX_CACHE_HITS.series_name, "0+900x120 108300+300x119"),
            *fast_latency(240),
        ),
        2 * H,
        None,
    ),
    # Throughput halves from sample 121. Baseline: the hour ending 10m (window +
    # `for`) back, extrapolated past the first sample as above: at 3750 s,
    # 315000 over 3150 s -> 316500 / 3600 = 87.9/s; over 5m 22500 / 300 = 75/s
    # -> 0.853 <= 0.9 (at 3720: 80 / 87.1 = 0.919). True from 3750 (3720
    # left-open) -> 4050 (4020).
    Case(
        "VllmThroughputDrop",
        "fire",
        (
            series(GEN, "0+3000x120 361500+1500x119"),
            series(WAITING, "2x240"),
        ),
        2 * H,
        4050,
        fires_at_left_open=4020,
    ),
    # Same drop with an empty queue: demand fell, not the engine.
    Case(
        "VllmThroughputDrop",
        "quiet",
        (
            series(GEN, "0+3000x120 361500+1500x119"),
            series(WAITING, "0x240"),
        ),
        2 * H,
        None,
    ),
    # Half the budget used; requests wait from sample 20 (600 s), all of the last
    # 5m from 900 s (870 s left-open) -> +5m = 1200 (1170).
    Case(
        "VllmBatchUtilizationLow",
        "fire",
        (
            series(SCHEDULED, "0+500x80"),
            series(BUDGET, "0+1000x80"),
            series(WAITING, "0x19 3x60"),
        ),
        2400,
        1200,
        fires_at_left_open=1170,
    ),
    Case(
        "VllmBatchUtilizationLow",
        "quiet",
        (
            series(SCHEDULED, "0+900x80"),
            series(BUDGET, "0+1000x80"),
            series(WAITING, "3x80"),
        ),
        2400,
        None,
    ),
    # Length padding 0.5 from sample 20: the 5m average passes 0.25 at k=4 (720 s;
    # k=3, 690 s left-open) -> +5m = 1020 (990).
    Case(
        "VllmPaddingHigh",
        "fire",
        (series(LENGTH_PADDING, "0.1x19 0.5x40"),),
        1200,
        1020,
        severity="warning",
        fires_at_left_open=990,
    ),
    Case(
        "VllmPaddingHigh",
        "quiet",
        (series(LENGTH_PADDING, "0.2x40"),),
        1200,
        None,
        severity="warning",
    ),
    # CUDA graph padding at 0.5 is not the reports' quantity: the length padding
    # of the same batches is 0.1.
    Case(
        "VllmPaddingHigh",
        "quiet-cudagraph-padding",
        (series(PADDING, "0.5x40"), series(LENGTH_PADDING, "0.1x40")),
        1200,
        None,
        severity="warning",
    ),
    # Length padding 0.5 from sample 80 (2400 s): the 5m average passes 0.30 at k=5
    # (2550 s) under both semantics (closed: 0.4k+1.5 > 3.3, left-open: 0.4k+1.4 > 3).
    # Requests take ~2 s from sample 81: P99 over 5m is 2.36 s at 2430 s, x4.8 its
    # value 30m earlier (0.495 s; a rise of 0.5 is needed). Both from 2550 -> +5m = 2850.
    Case(
        "VllmPaddingHigh",
        "fire",
        (series(LENGTH_PADDING, "0.1x79 0.5x40"), *latency(80, 120)),
        H,
        2850,
        severity="critical",
    ),
    # The same padding, latency flat: a warning, not critical.
    Case(
        "VllmPaddingHigh",
        "quiet",
        (series(LENGTH_PADDING, "0.1x79 0.5x40"), *fast_latency(120)),
        H,
        None,
        severity="critical",
    ),
    # Latency rising with the length padding at 0.25: below the critical 0.30.
    Case(
        "VllmPaddingHigh",
        "quiet-padding-below",
        (series(LENGTH_PADDING, "0.1x79 0.25x40"), *latency(80, 120)),
        H,
        None,
        severity="critical",
    ),
    # CUDA graph padding 0.5 from sample 20: as VllmPaddingHigh's warning above,
    # 720 s (690 s) -> +5m = 1020 (990).
    Case(
        "VllmCudagraphPaddingHigh",
        "fire",
        (series(PADDING, "0.1x19 0.5x40"),),
        1200,
        1020,
        fires_at_left_open=990,
    ),
    # Length padding is not graph padding: 0 on a CPU or eager engine.
    Case(
        "VllmCudagraphPaddingHigh",
        "quiet",
        (series(PADDING, "0x40"), series(LENGTH_PADDING, "0.5x40")),
        1200,
        None,
    ),
    # A young engine not warmed up at start (warmup_done 0) serving 100 tokens a
    # scrape with nobody waiting: every part true from 30 s (the first rate of two
    # samples), `for` 1m -> 90.
    Case(
        "VllmInsufficientWarmup",
        "fire",
        (
            series(START, "0x40"),
            series(WARMUP_DONE, "0x40"),
            series(WAITING, "0x40"),
            series(GEN, "0+100x40"),
        ),
        1200,
        90,
    ),
    # The same engine warmed up at start: nothing to do.
    Case(
        "VllmInsufficientWarmup",
        "quiet",
        (
            series(START, "0x40"),
            series(WARMUP_DONE, "1x40"),
            series(WAITING, "0x40"),
            series(GEN, "0+100x40"),
        ),
        1200,
        None,
    ),
    # Cold but saturated (requests waiting throughout): warm-up requests would
    # only add load.
    Case(
        "VllmInsufficientWarmup",
        "saturated",
        (
            series(START, "0x40"),
            series(WARMUP_DONE, "0x40"),
            series(WAITING, "5x40"),
            series(GEN, doubling(16, 24)),
        ),
        1200,
        None,
    ),
    # Cold, with room, but started an hour ago: past the warm-up period.
    Case(
        "VllmInsufficientWarmup",
        "old",
        (
            series(START, "-3600x40"),
            series(WARMUP_DONE, "0x40"),
            series(WAITING, "0x40"),
            series(GEN, "0+100x40"),
        ),
        1200,
        None,
    ),
    # GPU 0 at 100%, GPU 1 at 20% from sample 20: both 5m averages past their
    # thresholds at k=9 (870 s; k=8, 840 s left-open) -> +5m = 1170 (1140).
    Case(
        "VllmGPUComputeSkew",
        "fire",
        (
            series(GPU_UTIL, "0.6x19 1x40", gpu="0"),
            series(GPU_UTIL, "0.6x19 0.2x40", gpu="1"),
        ),
        1800,
        1170,
        fires_at_left_open=1140,
    ),
    Case(
        "VllmGPUComputeSkew",
        "quiet",
        (
            series(GPU_UTIL, "0.6x19 1x40", gpu="0"),
            series(GPU_UTIL, "0.6x19 0.5x40", gpu="1"),
        ),
        1800,
        None,
    ),
    # Evicted blocks idle over 60 s, then from sample 40 (1200 s) 12 a scrape idle 5-10 s,
    # with blocks reused all along. k intervals after the step: the median is in the
    # 5-10 s bucket once 12k >= half of 10 (10 - k) + 12k (closed ranges; 9 intervals
    # left-open): k = 5 under both, 1350 s -> `for` 10m = 1950.
    Case(
        "VllmKVCacheRetentionShort",
        "fire",
        (*idle_before_evict(40, "10", 80), series(REUSE_GAP_COUNT, "0+5x80")),
        2400,
        1950,
    ),
    # The same evictions with no block ever reused: nothing was lost by evicting them.
    Case(
        "VllmKVCacheRetentionShort",
        "quiet-no-reuse",
        (*idle_before_evict(40, "10", 80), series(REUSE_GAP_COUNT, "0x80")),
        2400,
        None,
    ),
    # Reused blocks, evicted 30-60 s after their last use: the median stays above 30 s.
    Case(
        "VllmKVCacheRetentionShort",
        "quiet",
        (*idle_before_evict(40, "60", 80), series(REUSE_GAP_COUNT, "0+5x80")),
        2400,
        None,
    ),
    # 95 % of the draft tokens accepted, 79 % from sample 40 (1200 s): the 5m ratio is
    # below 0.92 two intervals later under both range semantics (closed: 0.918; left-open
    # 0.914; one interval: 0.934, 0.932): 1260 -> `for` 10m = 1860.
    Case(
        "VllmSpecDecodeAcceptanceLow",
        "fire",
        (series(DRAFT, "0+1000x90"), series(ACCEPTED, "0+950x40 38790+790x49")),
        2700,
        1860,
        severity="info",
    ),
    Case(
        "VllmSpecDecodeAcceptanceLow",
        "quiet",
        (series(DRAFT, "0+1000x90"), series(ACCEPTED, "0+950x90")),
        2700,
        None,
        severity="info",
    ),
    # 40 % accepted from sample 40: below 0.7 after five intervals under both (closed
    # 0.675, left-open 0.644; four: 0.73, 0.706): 1350 -> 1950.
    Case(
        "VllmSpecDecodeAcceptanceLow",
        "fire",
        (series(DRAFT, "0+1000x90"), series(ACCEPTED, "0+950x40 38400+400x49")),
        2700,
        1950,
        severity="warning",
    ),
    # 79 % accepted: below the reports' 92 %, above the validator's 0.7.
    Case(
        "VllmSpecDecodeAcceptanceLow",
        "quiet",
        (series(DRAFT, "0+1000x90"), series(ACCEPTED, "0+950x40 38790+790x49")),
        2700,
        None,
        severity="warning",
    ),
    # -- baselines end before the comparison window and the `for` period --
    # Each rule that compares with a trailing baseline gets a sustained step at
    # 1.1x its threshold, held for twice its `for` after 90 min of steady history
    # (the step is between samples 180 and 181, 5400 s), and the same step at
    # 0.9x, which must not fire. A 5m window holds 10 intervals; the ratio
    # passes 1.1x a threshold only once all 10 are after the step (9 of 10 give
    # e.g. 0.9 * 2670 + 0.1 * 3000 = 2703 of 3000 = 0.901 > 0.9): true from
    # 5700 s. The baseline (the hour that ends `window + for` before now) holds
    # none of the step until 5400 + 5m + `for`, after the rule has fired.
    # Schedule time x1.55 (threshold x1.5), throughput x0.89 (threshold 0.9):
    # true from 5700, `for` 10m -> 6300.
    Case(
        "VllmKVFragmentationSuspected",
        "fire-1.1x-threshold",
        (
            series(SCHED_COUNT, "0+100x220"),
            series(SCHED_SUM, "0+0.1x180 18.155+0.155x40"),
            series(GEN, "0+3000x180 542670+2670x40"),
        ),
        5400 + 2 * 600 + 60,
        6300,
        fires_at_left_open=6270,
    ),
    # The case: +70 % schedule time, -25 % throughput, sustained for an
    # hour; with the baseline absorbing the rise this never fired. 8 of 10
    # intervals after the step pass both (1.56, 0.8): true from 5640, -> 6240.
    Case(
        "VllmKVFragmentationSuspected",
        "fire-sustained-70pct",
        (
            series(SCHED_COUNT, "0+100x300"),
            series(SCHED_SUM, "0+0.1x180 18.17+0.17x120"),
            series(GEN, "0+3000x180 542250+2250x120"),
        ),
        5400 + 3600,
        6240,
        fires_at_left_open=6210,
    ),
    # x1.45 and x0.91: below both thresholds.
    Case(
        "VllmKVFragmentationSuspected",
        "quiet-0.9x-threshold",
        (
            series(SCHED_COUNT, "0+100x220"),
            series(SCHED_SUM, "0+0.1x180 18.145+0.145x40"),
            series(GEN, "0+3000x180 542730+2730x40"),
        ),
        5400 + 2 * 600 + 60,
        None,
    ),
    # Throughput x0.89 (drop 0.1), requests waiting: true from 5700, `for` 5m -> 6000.
    Case(
        "VllmThroughputDrop",
        "fire-1.1x-threshold",
        (
            series(GEN, "0+3000x180 542670+2670x21"),
            series(WAITING, "2x201"),
        ),
        5400 + 2 * 300 + 60,
        6000,
        fires_at_left_open=5970,
    ),
    Case(
        "VllmThroughputDrop",
        "quiet-0.9x-threshold",
        (
            series(GEN, "0+3000x180 542730+2730x21"),
            series(WAITING, "2x201"),
        ),
        5400 + 2 * 300 + 60,
        None,
    ),
    # Hit ratio 0.9 -> 0.801 (x0.89, hit_fall 0.1) while P99 latency moves from the
    # 0.5 s bucket to the 2.5 s one (far above x1.5 of 30m earlier): true from 5700,
    # `for` 5m -> 6000.
    Case(
        "VllmBatchTooLarge",
        "fire-1.1x-threshold",
        (
            series(M.PREFIX_CACHE_QUERIES.series_name, "0+1000x201"),
            series(M.PREFIX_CACHE_HITS.series_name, "0+900x180 162801+801x21"),
            *latency(181, 202),
        ),
        5400 + 2 * 300 + 60,
        6000,
        fires_at_left_open=5970,
    ),
    Case(
        "VllmBatchTooLarge",
        "quiet-0.9x-threshold",
        (
            series(M.PREFIX_CACHE_QUERIES.series_name, "0+1000x201"),
            series(M.PREFIX_CACHE_HITS.series_name, "0+900x180 162819+819x21"),
            *latency(181, 202),
        ),
        5400 + 2 * 300 + 60,
        None,
    ),
)


def alerts_covered(cases: Iterable[Case]) -> set[tuple[str, bool]]:
    return {(c.alert, c.fires_at is not None) for c in cases}
