"""The field reports' two latency incidents, tried as a new user would try them.

The shipped catalog's rule file (every rule, as `runbook rules export` writes
it), two engines scraped every 15 s (one bad, one healthy, the same traffic:
60 requests finish per scrape on each, vLLM's own e2e latency buckets), and
`promtool test rules` against the embedded evaluator on the same series:

- report 002's case 1: P99 from about 200 ms to 1,200 ms while QPS stays flat,
  the batches 47 % padding (its figure), the queue flat. Its own finding
  (VllmLatencyRiseFlatLoad, runbook padding-high) and the padding alerts fire
  on the bad engine; the queue-driven spike does not.
- report 000's scenario 2: a latency spike with the scheduler's queue growing.
  VllmLatencySpike (runbook latency-spike: FCFS) fires on the bad engine; the
  flat-load finding does not.

Nothing fires on the healthy engine. Sample i is at i * 15 s; the incident
starts after sample 160 (40 min of history: the flat-load finding compares
with 30 min earlier).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml
from rule_harness import expand, parse_selector, promtool_required, promtool_version
from vllm_runbook.collector import metrics as M
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.promql import export
from vllm_runbook.rules.slo import VLLM_BUCKETS

RULES = load_catalog().bind()
PROMTOOL = promtool_version()
SCRAPE = EVAL = 15.0
SAMPLES = 240  # one hour
START = 160  # the incident: increments from sample 160 to 161 on
BAD = {"instance": "engine-a:8000", "model_name": "m", "engine": "0"}
HEALTHY = {"instance": "engine-b:8000", "model_name": "m", "engine": "0"}
PER_SCRAPE = 60  # 4 requests/s on each engine, before and after

E2E = "vllm:e2e_request_latency_seconds_bucket"
FINISHED = "vllm:request_success_total"
WAITING = M.REQUESTS_WAITING.series_name
LENGTH_PADDING = M.LENGTH_PADDING_RATIO.series_name
PADDING = M.PADDING_RATIO.series_name


def selector(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def latency(labels: dict[str, str], slow: int, slow_above: float) -> list[tuple[str, str]]:
    """PER_SCRAPE requests a scrape, all within 0.3 s; from START on, `slow` of them
    just above `slow_above` seconds (in the bucket that ends after it)."""
    out = []
    for le in (*VLLM_BUCKETS["e2e_latency"], float("inf")):
        text = "+Inf" if le == float("inf") else f"{le:g}"
        fast_only = le <= slow_above
        if fast_only and slow:
            after = PER_SCRAPE * START + PER_SCRAPE - slow  # sample START + 1
            values = f"0+{PER_SCRAPE}x{START} {after}+{PER_SCRAPE - slow}x{SAMPLES - START - 1}"
        else:
            values = f"0+{PER_SCRAPE}x{SAMPLES}"
        out.append((selector(E2E, {**labels, "le": text}), values))
    return out


def engine(
    labels: dict[str, str], *, slow: int, slow_above: float, padding: str, queue: str
) -> list[tuple[str, str]]:
    """One engine's series as its vLLM server and the plugin export them."""
    return [
        *latency(labels, slow, slow_above),
        (selector(FINISHED, {**labels, "finished_reason": "stop"}), f"0+{PER_SCRAPE}x{SAMPLES}"),
        (selector(LENGTH_PADDING, labels), padding),
        (selector(PADDING, labels), f"0x{SAMPLES}"),  # a CPU engine: no CUDA graphs
        (selector(WAITING, labels), queue),
        (selector("vllm:num_requests_waiting", labels), queue),  # vLLM's own, the same
    ]


HEALTHY_SERIES = engine(
    HEALTHY, slow=0, slow_above=0.3, padding=f"0.1x{SAMPLES}", queue=f"0x{SAMPLES}"
)
# Report 002: from START one request in 60 takes 1-1.5 s (P99 of the 5m window,
# once every scrape in it is after START: 1 + 0.5 * (0.99 * 60 - 59) = 1.2 s; before,
# 0.3 * 0.99 = 0.297 s: vLLM's first bucket ends at 0.3 s, so a P99 of 200 ms reads
# so), and the batches' length padding goes from 0.1 to 0.47.
FLAT_LOAD = engine(
    BAD,
    slow=1,
    slow_above=1.0,
    padding=f"0.1x{START} 0.47x{SAMPLES - START - 1}",
    queue=f"0x{SAMPLES}",
)
# Report 000: from START the queue grows by one request a scrape and 10 requests in
# 60 wait 2-2.5 s in it; the batches are as before.
QUEUE_DRIVEN = engine(
    BAD,
    slow=10,
    slow_above=2.0,
    padding=f"0.1x{SAMPLES}",
    queue=f"0x{START} 1+1x{SAMPLES - START - 1}",
)

Fired = dict[tuple[str, str, str], float]  # (alert, severity, instance) -> first firing


def evaluate(
    series: Iterable[tuple[str, str]], left_open: bool
) -> tuple[Fired, MemoryIncidentSink]:
    """Every rule of the catalog on the series, evaluated every EVAL seconds."""
    store = store_for_rules(RULES, left_open=left_open)
    sink = MemoryIncidentSink()
    evaluator = Evaluator(RULES, store, sink)
    samples = sorted(
        (
            (i * SCRAPE, name, labels, v)
            for sel, values in series
            for name, labels in [parse_selector(sel)]
            for i, v in enumerate(expand(values))
            if v is not None
        ),
        key=lambda sample: sample[0],
    )
    pos, t = 0, 0.0
    while t <= (SAMPLES - 1) * SCRAPE:
        while pos < len(samples) and samples[pos][0] <= t:
            ts, name, labels, v = samples[pos]
            store.add(labels["instance"], name, labels, ts, v)
            pos += 1
        evaluator.evaluate(t)
        t += EVAL
    fired: Fired = {}
    for e in sink.events:
        if e.state == "firing":
            fired.setdefault((e.alert, e.severity, e.engine[0]), e.at)
    return fired, sink


def firing_at(sink: MemoryIncidentSink, t: float) -> set[tuple[str, str, str]]:
    """(alert, severity, instance) firing at evaluation time t."""
    state: dict[tuple[str, str, str], bool] = {}
    for e in sink.events:
        if e.at <= t:
            state[(e.alert, e.severity, e.engine[0])] = e.state == "firing"
    return {k for k, on in state.items() if on}


# The exact oracle (Prometheus 2's closed ranges; Prometheus 3's left-open ones where
# different). A 5m window holds 21 samples, 20 intervals (left-open: 20 and 19).
CASES = {
    # P99 over 5m: above 1 s once the slow requests are more than 1 % of the window's:
    # 13 in 1,200 at sample 173, 2595 s (left-open: 12 in 1,140 at sample 172, 2580 s),
    # x4.8 its 0.297 s 30m earlier; load x1.0; queue 0 / 0 (NaN: not growing)
    # -> +2m = 2715 (2700). Length padding: the 5m average passes 0.25 with 9 samples
    # at 0.47 (sample 169, 2535 s, both semantics: 0.37 k > 3.15, > 3) -> +5m = 2835;
    # 0.30 with 12 of 21 (sample 172; left-open 11 of 20, sample 171), and the P99 rise
    # (x1.5 needed) from 2595 (2580) -> +5m = 2895 (2880).
    "report-002-flat-load": (
        FLAT_LOAD,
        {
            ("VllmLatencyRiseFlatLoad", "critical", BAD["instance"]): (2715.0, 2700.0),
            ("VllmPaddingHigh", "warning", BAD["instance"]): (2835.0, 2835.0),
            ("VllmPaddingHigh", "critical", BAD["instance"]): (2895.0, 2880.0),
        },
    ),
    # P99 over 5m above the 1 s SLA once the slow requests pass 1 % of the window's:
    # 20 in 1,200 at sample 162, 2430 s (10 at 2415 s are 0.8 %; left-open the same);
    # the queue's 5m average, from 0, grows (infinitely, then by more than 10 %) from
    # 2415 -> +2m = 2550.
    "report-000-queue-grows": (
        QUEUE_DRIVEN,
        {("VllmLatencySpike", "critical", BAD["instance"]): (2550.0, 2550.0)},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_report_fires_its_own_finding_on_the_bad_engine_only(name: str) -> None:
    bad, expected = CASES[name]
    for left_open in (False, True):
        fired, _ = evaluate([*bad, *HEALTHY_SERIES], left_open)
        assert fired == {k: v[left_open] for k, v in expected.items()}, left_open


@pytest.mark.parametrize("name", list(CASES))
def test_prometheus_agrees(name: str, tmp_path: Path) -> None:
    if PROMTOOL is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        pytest.skip("promtool not installed (apt-get install prometheus); CI fails instead")
    bad, _ = CASES[name]
    series = [*bad, *HEALTHY_SERIES]
    fired, sink = evaluate(series, left_open=PROMTOOL >= 3)
    # Each first firing one evaluation after (promtool's tolerance, as in the
    # backend tests) and two before; then every 10 minutes: every alert of the
    # catalog, on both engines, as the evaluator has it.
    times = {t + d for t in fired.values() for d in (EVAL, -2 * EVAL)}
    times |= {600.0 * k for k in range(1, int(SAMPLES * SCRAPE // 600))}
    checks = []
    for t in sorted(times):
        for alert in sorted({r.alert for r in RULES}):
            on = {k for k in firing_at(sink, t) if k[0] == alert}
            if on != {k for k in firing_at(sink, t - EVAL) if k[0] == alert}:
                continue  # an edge: promtool may see it one evaluation apart
            checks.append(
                {
                    "eval_time": format_duration(t),
                    "alertname": alert,
                    "exp_alerts": [
                        {"exp_labels": labels(alert, severity, instance)}
                        for (_, severity, instance) in sorted(on)
                    ],
                }
            )
    (tmp_path / "rules.yml").write_text(export(RULES, annotations=False), encoding="utf-8")
    doc = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": format_duration(EVAL),
        "tests": [
            {
                "name": name,
                "interval": format_duration(SCRAPE),
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": checks,
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    result = subprocess.run(
        ["promtool", "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def labels(alert: str, severity: str, instance: str) -> dict[str, str]:
    [rule] = [r for r in RULES if r.alert == alert and r.severity == severity]
    engine_labels = BAD if instance == BAD["instance"] else HEALTHY
    return {**engine_labels, **rule.alert_labels}
