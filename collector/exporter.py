"""Turns an engine's step statistics into Prometheus samples at scrape time.

The scheduler hook only updates plain numbers (see `vllm_runbook.collector.hook`); the
cost of building metric families is paid by the scraping thread, not by the
engine's step. `StatsExporter` is a prometheus_client custom collector for
our own endpoint; `MultiprocessMirror` copies the same samples into real
metric objects once a second when vLLM runs with PROMETHEUS_MULTIPROC_DIR,
so they also appear on vLLM's own /metrics.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from vllm_runbook.collector import metrics as M

logger = logging.getLogger("vllm_runbook.collector")


@dataclass
class Sample:
    spec: M.MetricSpec
    value: float
    extra_labels: tuple[str, ...] = ()
    # Histograms: cumulative bucket counts aligned with spec.buckets (+Inf last).
    buckets: tuple[float, ...] = ()


SampleSource = Callable[[], list[Sample]]


class StatsExporter(Collector):
    """Custom collector: calls `source()` at each scrape."""

    def __init__(self, source: SampleSource, labels: tuple[str, ...]) -> None:
        self.source = source
        self.labels = labels

    def describe(self) -> list[Metric]:
        return []  # no pre-registration checks: names come from one catalog

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for s in self.source():
            spec = s.spec
            family = families.get(spec.name)
            labelnames = [*M.BASE_LABELS, *spec.extra_labels]
            if family is None:
                if spec.type == "counter":
                    family = CounterMetricFamily(spec.name, spec.help, labels=labelnames)
                elif spec.type == "histogram":
                    family = HistogramMetricFamily(spec.name, spec.help, labels=labelnames)
                else:
                    family = GaugeMetricFamily(spec.name, spec.help, labels=labelnames)
                families[spec.name] = family
            labelvalues = [*self.labels, *s.extra_labels]
            if spec.type == "histogram":
                bounds = [*(str(float(b)) for b in spec.buckets), "+Inf"]
                family.add_metric(  # type: ignore[attr-defined]
                    labelvalues, list(zip(bounds, s.buckets, strict=True)), s.value
                )
            else:
                family.add_metric(labelvalues, s.value)  # type: ignore[attr-defined]
        yield from families.values()


class OnlySamples:
    """`registry` restricted to the samples named in `names` (`/metrics?name[]=...`).

    prometheus_client's own `restricted_registry` finds collectors by the names
    they describe: a custom collector that describes none (StatsExporter) would
    be left out, so this filters what every collector yields instead."""

    def __init__(self, registry: CollectorRegistry, names: Iterable[str]) -> None:
        self.registry = registry
        self.names = frozenset(names)

    def collect(self) -> Iterator[Metric]:
        names = self.names
        for metric in self.registry.collect():
            samples = [s for s in metric.samples if s.name in names]
            if samples:
                kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                kept.samples = samples
                yield kept


class MultiprocessMirror:
    """Copies samples into mmap-backed metrics for PROMETHEUS_MULTIPROC_DIR."""

    def __init__(self, source: SampleSource, labels: tuple[str, ...], interval: float = 1.0):
        self.source = source
        self.labels = labels
        self.interval = interval
        # A private registry: in multiprocess mode the values live in the
        # mmap files whatever registry holds them.
        registry = CollectorRegistry()
        self.metrics: dict[str, Counter | Gauge | Histogram] = {
            spec.name: M.build(spec, registry)
            for spec in M.ALL_METRICS
            if spec not in M.NVML_METRICS
        }
        self._last: dict[tuple[str, tuple[str, ...]], tuple[float, ...]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vllm-runbook-multiproc", daemon=True
        )

    def start(self) -> MultiprocessMirror:
        self.sync()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception:
                if not failed:
                    logger.exception("vllm-runbook: PROMETHEUS_MULTIPROC_DIR mirror failed")
                    failed = True

    def sync(self) -> None:
        for s in self.source():
            metric = self.metrics.get(s.spec.name)
            if metric is None:
                continue
            child = metric.labels(*self.labels, *s.extra_labels)
            key = (s.spec.name, s.extra_labels)
            if s.spec.type == "gauge":
                child.set(s.value)  # type: ignore[union-attr]
            elif s.spec.type == "counter":
                last = self._last.get(key, (0.0,))[0]
                if s.value > last:
                    child.inc(s.value - last)  # type: ignore[union-attr]
                self._last[key] = (s.value,)
            else:
                self._mirror_histogram(child, key, s)

    def _mirror_histogram(self, child: object, key: tuple[str, tuple[str, ...]], s: Sample) -> None:
        # prometheus_client has no public API to add pre-bucketed counts;
        # its per-bucket values (non-cumulative) and sum are incremented here.
        last = self._last.get(key) or (0.0,) * (len(s.buckets) + 1)
        cumulative_prev = 0.0
        cumulative_last_prev = 0.0
        for i, cumulative in enumerate(s.buckets):
            delta = (cumulative - cumulative_prev) - (last[i] - cumulative_last_prev)
            cumulative_prev, cumulative_last_prev = cumulative, last[i]
            if delta > 0:
                child._buckets[i].inc(delta)  # type: ignore[attr-defined]
        if s.value > last[-1]:
            child._sum.inc(s.value - last[-1])  # type: ignore[attr-defined]
        self._last[key] = (*s.buckets, s.value)


def close_quietly(*things: object) -> None:
    for thing in things:
        with contextlib.suppress(Exception):
            thing.stop()  # type: ignore[attr-defined]
