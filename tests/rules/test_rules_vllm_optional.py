"""vLLM's optional series reach the in-process evaluator as vLLM exposes them: the KV
block residency histograms (`--kv-cache-metrics`) and the speculative-decoding
counters. The rules read them as they are (the project keeps no copy of vLLM's data):
the scraper stores them because a rule names them, and the rules fire on them."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scrape import Scraper, Target
from vllm_runbook.rules.signals import SIGNALS

RULES = load_catalog().bind()
LABELS = {"model_name": "tiny", "engine": "0"}
# vLLM 0.32's kv_cache_residency buckets (vllm/v1/metrics/buckets.py).
RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
    300, 600, 1200, 1800,
)  # fmt: skip


def _name(signal: str) -> str:
    """vLLM's metric name as declared (the exposition adds _total, _bucket, ...)."""
    metric = str(SIGNALS[signal].metric)
    return metric.removesuffix("_total") if SIGNALS[signal].type == "counter" else metric


class VllmExposition:
    """The part of vLLM's /metrics these rules read, built like vLLM builds it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labelnames = list(LABELS)

        def histogram(signal: str) -> Histogram:
            return Histogram(
                _name(signal), "d", labelnames, registry=self.registry, buckets=RESIDENCY_BUCKETS
            )

        def counter(signal: str) -> Counter:
            return Counter(_name(signal), "d", labelnames, registry=self.registry)

        self.lifetime = histogram("kv_block_lifetime").labels(**LABELS)
        self.idle = histogram("kv_block_idle_before_evict").labels(**LABELS)
        self.reuse_gap = histogram("kv_block_reuse_gap").labels(**LABELS)
        self.drafted = counter("spec_decode_draft_tokens").labels(**LABELS)
        self.accepted = counter("spec_decode_accepted_tokens").labels(**LABELS)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _run(step: Callable[[VllmExposition], None], minutes: int) -> MemoryIncidentSink:
    """Scrape every 15 s for `minutes`, `step(exposition)` before each, evaluating
    after each scrape like `runbook serve`."""
    store = store_for_rules(RULES)
    scraper = Scraper(store, [])
    sink = MemoryIncidentSink()
    evaluator = Evaluator(RULES, store, sink)
    exposition = VllmExposition()
    target = Target("http://127.0.0.1:8000/metrics", "cpu-0")
    for i in range(minutes * 4 + 1):
        now = 1_000_000.0 + 15.0 * i
        step(exposition)
        assert scraper.ingest(target, exposition.text(), now, set()) > 0
        evaluator.evaluate(now)
    return sink


def test_the_scraper_keeps_the_series_the_rules_name() -> None:
    store = store_for_rules(RULES)
    assert {
        "vllm:kv_block_idle_before_evict_seconds_bucket",
        "vllm:kv_block_reuse_gap_seconds_count",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    } <= set(store.retention)


def test_blocks_evicted_seconds_after_use_while_reused_fire_the_retention_rule() -> None:
    def churn(e: VllmExposition) -> None:
        for _ in range(20):  # sampled blocks evicted 8 s after their last use
            e.lifetime.observe(25.0)
            e.idle.observe(8.0)
        e.reuse_gap.observe(3.0)

    sink = _run(churn, 16)
    [firing] = sink.of("VllmKVCacheRetentionShort", "firing")
    # The median is interpolated in vLLM's 5-10 s bucket: 5 + 5 x 0.5.
    assert (firing.engine, firing.value) == (("cpu-0", "tiny", "0"), 7.5)


def test_blocks_kept_a_minute_do_not_fire() -> None:
    def kept(e: VllmExposition) -> None:
        for _ in range(20):
            e.lifetime.observe(90.0)
            e.idle.observe(70.0)
        e.reuse_gap.observe(3.0)

    assert _run(kept, 16).of("VllmKVCacheRetentionShort", "firing") == []


def test_a_draft_mostly_rejected_fires_both_severities() -> None:
    def drafts(e: VllmExposition) -> None:
        e.drafted.inc(400)
        e.accepted.inc(200)  # half accepted: below 0.92 and below 0.7

    sink = _run(drafts, 16)
    fired = {(f.severity, f.value) for f in sink.of("VllmSpecDecodeAcceptanceLow", "firing")}
    assert fired == {("info", 0.5), ("warning", 0.5)}
