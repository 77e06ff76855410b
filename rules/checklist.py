"""The seeds' production checklist, measured on scrapes of one engine (`runbook check`
samples them: vllm_runbook.runbooks.operate.cli.check).

    GPU utilisation 70-90%        collector, NVML gauges (per GPU, mean over the scrapes)
    block fragmentation < 20%     collector gauge, mean over the scrapes that had requests running
    P99 latency < SLA             vLLM's e2e latency histogram (--vllm), over the sampled interval
    throughput variation < 10%    collector's scheduled tokens: (max - min) / mean of the
                                  per-interval rates (the seeds mean over 1 h: use
                                  --interval 300 --scrapes 13 for that)
    OOM rate < 0.1%               preemptions (collector) per finished request (vLLM, --vllm)
    error rate < 0.5%             finished_reason="error" share of finished requests (vLLM)
    GPU memory difference < 15%   (max - min) / max of memory used across the engine's GPUs
    KV block retention >= 30 s    vLLM's residency histograms (--vllm, vLLM started with
                                  --kv-cache-metrics): the median idle time of the sampled
                                  blocks evicted over the interval; a warning (never a
                                  failure) when shorter while blocks were reused, the
                                  threshold of VllmKVCacheRetentionShort

A check whose signal does not exist says n/a and why (no GPU, idle engine,
no --vllm); n/a never fails. Rates come from several scrapes `--interval`
seconds apart. When no request finished inside that interval, the request
ratios fall back to the totals since the engine started, and say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.promfuncs import bucket_quantile
from vllm_runbook.rules.signals import SIGNALS

Status = Literal["pass", "warn", "fail", "n/a"]

E2E_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_SUCCESS = "vllm:request_success_total"
# vLLM's KV block residency histograms (--kv-cache-metrics), named by the signal registry.
KV_IDLE_BEFORE_EVICT = str(SIGNALS["kv_block_idle_before_evict"].metric)
KV_BLOCK_LIFETIME = str(SIGNALS["kv_block_lifetime"].metric)
KV_REUSE_GAP = str(SIGNALS["kv_block_reuse_gap"].metric)
# VllmKVCacheRetentionShort's default idle_seconds (a test keeps the two equal).
KV_RETENTION_SECONDS = 30.0

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)

# Every sample name a check reads (a long soak keeps only these of each scrape).
READS: frozenset[str] = frozenset(
    {
        M.NVML_UP.name,
        M.GPU_UTILIZATION.name,
        M.GPU_MEMORY_USED.name,
        M.REQUESTS_RUNNING.name,
        M.BLOCK_FRAGMENTATION.name,
        M.SCHEDULED_TOKENS.series_name,
        M.PREEMPTIONS.series_name,
        E2E_LATENCY + "_bucket",
        REQUEST_SUCCESS,
        KV_IDLE_BEFORE_EVICT + "_bucket",
        KV_BLOCK_LIFETIME + "_bucket",
        KV_REUSE_GAP + "_bucket",
    }
)


@dataclass(frozen=True)
class Scrape:
    at: float
    agent: Samples
    vllm: Samples | None  # None without --vllm


@dataclass(frozen=True)
class CheckResult:
    name: str
    limit: str
    status: Status
    value: float | None  # the measured value (ratios as fractions), None when n/a
    shown: str  # the value as printed
    note: str = ""  # why n/a, or how it was measured when not the usual way


# -- measurements ----------------------------------------------------------------


def _values(samples: Samples | None, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    if samples is None:
        return []
    return [
        (labels, v)
        for labels, v in samples.get(name, [])
        if all(labels.get(k) == want for k, want in match.items())
    ]


def _one(samples: Samples | None, name: str, **match: str) -> float | None:
    found = _values(samples, name, **match)
    return sum(v for _, v in found) if found else None


def _per_gpu(samples: Samples, name: str) -> dict[str, float]:
    return {labels.get("gpu", "?"): v for labels, v in _values(samples, name)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else str(x)


def _na(name: str, limit: str, why: str) -> CheckResult:
    return CheckResult(name, limit, "n/a", None, "n/a", why)


def _judge(
    name: str, limit: str, value: float, ok: bool, shown: str, note: str = ""
) -> CheckResult:
    finite = value if math.isfinite(value) else None  # JSON has no NaN or Inf
    return CheckResult(name, limit, "pass" if ok else "fail", finite, shown, note)


def _no_gpu(scrapes: Sequence[Scrape]) -> str | None:
    last = scrapes[-1].agent
    if _one(last, M.NVML_UP.name) != 1:
        return "no NVIDIA GPU on the engine's machine (nvml_up 0): NVML exports no GPU series"
    if not _per_gpu(last, M.GPU_UTILIZATION.name):
        return "NVML is up but reports no GPU"
    return None


def check_gpu_utilization(scrapes: Sequence[Scrape]) -> CheckResult:
    name, limit = "GPU utilisation", "70-90%"
    why = _no_gpu(scrapes)
    if why:
        return _na(name, limit, why)
    per: dict[str, list[float]] = {}
    for s in scrapes:
        for gpu, v in _per_gpu(s.agent, M.GPU_UTILIZATION.name).items():
            per.setdefault(gpu, []).append(v)
    means = {gpu: sum(v) / len(v) for gpu, v in sorted(per.items())}
    ok = all(0.70 <= m <= 0.90 for m in means.values())
    worst = max(means.values(), key=lambda m: max(0.70 - m, m - 0.90))
    shown = ", ".join(f"gpu{g} {_pct(m)}" for g, m in means.items())
    return _judge(name, limit, worst, ok, shown)


def check_gpu_memory_difference(scrapes: Sequence[Scrape]) -> CheckResult:
    name, limit = "GPU memory difference", "< 15%"
    why = _no_gpu(scrapes)
    if why:
        return _na(name, limit, why)
    used = _per_gpu(scrapes[-1].agent, M.GPU_MEMORY_USED.name)
    if len(used) < 2:
        return _na(name, limit, f"{len(used)} GPU: nothing to compare")
    top = max(used.values())
    diff = (top - min(used.values())) / top if top > 0 else 0.0
    return _judge(name, limit, diff, diff < 0.15, _pct(diff))


def check_fragmentation(scrapes: Sequence[Scrape]) -> CheckResult:
    name, limit = "block fragmentation", "< 20%"
    busy = [
        frag
        for s in scrapes
        if (_one(s.agent, M.REQUESTS_RUNNING.name) or 0) > 0
        and (frag := _one(s.agent, M.BLOCK_FRAGMENTATION.name)) is not None
    ]
    if not busy:
        return _na(name, limit, "no request was running at any scrape (defined under load only)")
    mean = sum(busy) / len(busy)
    return _judge(name, limit, mean, mean < 0.20, _pct(mean))


def check_throughput_variation(scrapes: Sequence[Scrape]) -> CheckResult:
    name, limit = "throughput variation", "< 10%"
    if len(scrapes) < 3:
        return _na(name, limit, "needs two intervals: --scrapes 3 or more")
    totals = [_one(s.agent, M.SCHEDULED_TOKENS.series_name) for s in scrapes]
    if any(t is None for t in totals):
        return _na(name, limit, "the collector exports no scheduled-token counter")
    rates = [
        (b - a) / (s1.at - s0.at)  # type: ignore[operator]
        for a, b, s0, s1 in zip(totals, totals[1:], scrapes, scrapes[1:], strict=False)
    ]
    mean = sum(rates) / len(rates)
    if mean <= 0:
        return _na(name, limit, "engine idle: no token scheduled while sampling")
    variation = (max(rates) - min(rates)) / mean
    span = scrapes[-1].at - scrapes[0].at
    note = f"{len(rates)} rates over {span:.0f} s, mean {mean:.0f} tokens/s; the seeds mean 1 h"
    return _judge(name, limit, variation, variation < 0.10, _pct(variation), note)


def check_p99(scrapes: Sequence[Scrape], model: str, engine: str, sla: float) -> CheckResult:
    name, limit = "P99 latency", f"< {sla:g} s"
    first, last = scrapes[0].vllm, scrapes[-1].vllm
    if last is None or first is None:
        return _na(name, limit, "give --vllm URL: latency comes from vLLM's /metrics")
    match = {"model_name": model, "engine": engine}
    end, start = _buckets(last, E2E_LATENCY, match), _buckets(first, E2E_LATENCY, match)
    if not end:
        return _na(name, limit, f"vLLM exports no {E2E_LATENCY} for this engine")
    delta = {b: end[b] - start.get(b, 0.0) for b in end}
    note = ""
    if delta.get(math.inf, 0.0) <= 0:
        if end.get(math.inf, 0.0) <= 0:
            return _na(name, limit, "no request has finished yet")
        delta, note = end, "no request finished while sampling: since the engine started"
    p99 = bucket_quantile(0.99, sorted(delta.items()))
    return _judge(name, limit, p99, p99 < sla, f"{p99:.3g} s", note)


def _buckets(samples: Samples, histogram: str, match: Mapping[str, str]) -> dict[float, float]:
    """One engine's cumulative bucket counts of a histogram, by upper bound."""
    out: dict[float, float] = {}
    for labels, v in _values(samples, histogram + "_bucket", **match):
        bound = float(labels["le"])
        out[bound] = out.get(bound, 0.0) + v
    return out


def check_kv_block_retention(scrapes: Sequence[Scrape], model: str, engine: str) -> CheckResult:
    """The field reports' block reuse needs a block to still be cached when its prefix
    comes back: how long vLLM keeps an unused block before evicting it (the median of
    its sampled blocks), over the sampled interval."""
    name, limit = "KV block retention", f">= {KV_RETENTION_SECONDS:g} s"
    first, last = scrapes[0].vllm, scrapes[-1].vllm
    if last is None or first is None:
        return _na(name, limit, "give --vllm URL: block residency comes from vLLM's /metrics")
    match = {"model_name": model, "engine": engine}
    end = {h: _buckets(last, h, match) for h in (KV_IDLE_BEFORE_EVICT, KV_BLOCK_LIFETIME)}
    if not end[KV_IDLE_BEFORE_EVICT]:
        return _na(
            name, limit, "vLLM exports no KV block residency: start it with --kv-cache-metrics"
        )
    start = {h: _buckets(first, h, match) for h in end}
    delta = {h: {b: end[h][b] - start[h].get(b, 0.0) for b in end[h]} for h in end}
    reused = _reuse_gaps(last, match) - _reuse_gaps(first, match)
    note = ""
    if delta[KV_IDLE_BEFORE_EVICT].get(math.inf, 0.0) <= 0:
        if end[KV_IDLE_BEFORE_EVICT].get(math.inf, 0.0) <= 0:
            return _na(name, limit, "no sampled KV block has been evicted yet")
        delta, reused = end, _reuse_gaps(last, match)
        note = "no sampled block evicted while sampling: since the engine started; "
    idle = bucket_quantile(0.5, sorted(delta[KV_IDLE_BEFORE_EVICT].items()))
    lifetime = bucket_quantile(0.5, sorted(delta[KV_BLOCK_LIFETIME].items()))
    evicted = delta[KV_IDLE_BEFORE_EVICT][math.inf]
    note += (
        f"{evicted:.0f} sampled blocks evicted, lifetime P50 {lifetime:.3g} s, "
        f"{reused:.0f} reuse gaps"
    )
    shown = f"{idle:.3g} s idle (P50)"
    finite = idle if math.isfinite(idle) else None
    if reused <= 0:
        return CheckResult(
            name, limit, "pass", finite, shown, note + "; no block was reused: none lost"
        )
    if idle < KV_RETENTION_SECONDS:
        return CheckResult(
            name, limit, "warn", finite, shown,
            note + "; a prefix back later than that is recomputed: more KV cache or a "
            "lower max_num_seqs keeps blocks longer",
        )  # fmt: skip
    return CheckResult(name, limit, "pass", finite, shown, note)


def _reuse_gaps(samples: Samples, match: Mapping[str, str]) -> float:
    """Reuse gaps observed: the +Inf bucket of vLLM's reuse-gap histogram."""
    return _buckets(samples, KV_REUSE_GAP, match).get(math.inf, 0.0)


def _finished(samples: Samples | None, model: str, engine: str, reason: str | None) -> float:
    match = {"model_name": model, "engine": engine}
    if reason is not None:
        match["finished_reason"] = reason
    return sum(v for _, v in _values(samples, REQUEST_SUCCESS, **match))


def _request_ratio(
    name: str,
    limit: str,
    threshold: float,
    scrapes: Sequence[Scrape],
    model: str,
    engine: str,
    numerator: Callable[[Scrape], float | None],
) -> CheckResult:
    first, last = scrapes[0], scrapes[-1]
    if last.vllm is None:
        return _na(name, limit, "give --vllm URL: finished requests come from vLLM's /metrics")
    num_end, num_start = numerator(last), numerator(first)
    if num_end is None or num_start is None:
        return _na(name, limit, "the engine exports no such counter")
    fin_end = _finished(last.vllm, model, engine, None)
    fin_delta = fin_end - _finished(first.vllm, model, engine, None)
    note = ""
    if fin_delta > 0:
        num, fin = num_end - num_start, fin_delta
    elif fin_end > 0:
        num, fin = num_end, fin_end
        note = "no request finished while sampling: since the engine started"
    else:
        return _na(name, limit, "no request has finished yet")
    ratio = num / fin
    return _judge(name, limit, ratio, ratio < threshold, f"{100 * ratio:.3g}%", note)


def check_oom_rate(scrapes: Sequence[Scrape], model: str, engine: str) -> CheckResult:
    # vLLM V1 answers KV exhaustion by preempting: preemptions per finished
    # request is the engine's OOM rate (a CUDA OOM stops the engine instead).
    return _request_ratio(
        "OOM (preemption) rate",
        "< 0.1%",
        0.001,
        scrapes,
        model,
        engine,
        lambda s: _one(s.agent, M.PREEMPTIONS.series_name),
    )


def check_error_rate(scrapes: Sequence[Scrape], model: str, engine: str) -> CheckResult:
    return _request_ratio(
        "error rate",
        "< 0.5%",
        0.005,
        scrapes,
        model,
        engine,
        lambda s: _finished(s.vllm, model, engine, "error") if s.vllm is not None else None,
    )


def run_checklist(
    scrapes: Sequence[Scrape], model: str, engine: str, sla_seconds: float
) -> list[CheckResult]:
    """Every line of the checklist, in the order of issue 5's list."""
    return [
        check_gpu_utilization(scrapes),
        check_fragmentation(scrapes),
        check_p99(scrapes, model, engine, sla_seconds),
        check_throughput_variation(scrapes),
        check_oom_rate(scrapes, model, engine),
        check_error_rate(scrapes, model, engine),
        check_gpu_memory_difference(scrapes),
        check_kv_block_retention(scrapes, model, engine),
    ]


# -- sampling ------------------------------------------------------------------------


def parse_exposition(text: str, **match: str) -> Samples:
    """Samples by name, keeping those whose labels include `match` (one engine's)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if all(s.labels.get(k) == v for k, v in match.items()):
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


# -- reporting ------------------------------------------------------------------------


def with_note(r: CheckResult, note: str) -> CheckResult:
    return CheckResult(
        r.name, r.limit, r.status, r.value, r.shown, "; ".join(filter(None, [r.note, note]))
    )


def as_json(
    agent: str,
    vllm: str | None,
    model: str,
    engine: str,
    scrapes: Sequence[Scrape],
    results: Sequence[CheckResult],
) -> dict[str, Any]:
    counts: Mapping[str, int] = {
        s: sum(r.status == s for r in results) for s in ("pass", "fail", "n/a")
    }
    warned = sum(r.status == "warn" for r in results)
    if warned:
        counts = {**counts, "warn": warned}
    return {
        "engine": agent,
        "vllm": vllm,
        "model_name": model,
        "dp_rank": engine,
        "scrapes": len(scrapes),
        "sampled_seconds": round(scrapes[-1].at - scrapes[0].at, 3),
        "checks": [asdict(r) for r in results],
        "summary": dict(counts),
        "ok": counts["fail"] == 0,
    }


def format_results(
    agent: str, model: str, engine: str, scrapes: Sequence[Scrape], results: Sequence[CheckResult]
) -> str:
    span = scrapes[-1].at - scrapes[0].at
    lines = [
        f"engine {agent}  model {model}  dp rank {engine}  "
        f"({len(scrapes)} scrapes over {span:.1f} s)",
        f"  {'result':<6} {'check':<22} {'limit':<9} {'measured':<20} note",
    ]
    for r in results:
        lines.append(
            f"  {r.status.upper():<6} {r.name:<22} {r.limit:<9} {r.shown:<20} {r.note}".rstrip()
        )
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "warn", "fail", "n/a")}
    warned = f", {counts['warn']} warned" if counts["warn"] else ""
    lines.append(f"{counts['fail']} failed, {counts['pass']} passed{warned}, {counts['n/a']} n/a")
    return "\n".join(lines)
