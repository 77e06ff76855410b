"""One vocabulary of signals for both catalogs: every name a rule, a runbook, the
sources table and the circuit breaker use resolves to the one registry, and no
quantity is in it under two names."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import (
    AgentState,
    GpuReading,
    Gpus,
    ScheduleHistogram,
    TierNow,
)
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.model import load_catalog as load_rules
from vllm_runbook.rules.signals import (
    HISTOGRAM_PARTS,
    OVER_LABEL,
    RATES,
    READABLE,
    RENAMED,
    SIGNALS,
)
from vllm_runbook.runbooks.engine import sources
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks
from vllm_runbook.runbooks.run.verification import HIGHER_IS_WORSE

from tests.fake_agent import FakeAgent, agent_state

# One `/v1/state` answer with every part a runbook reads (the agent's wire names).
FULL_STATS: dict[str, Any] = {
    "kv_cache_usage": 0.5,
    "kv_blocks_used": 100,
    "kv_blocks_free": 100,
    "preemptions_per_minute": 6.0,
    "requests_running": 4,
    "requests_waiting": 2,
    "budget_fill": 0.9,
    "block_fragmentation": 0.1,
    "kv_hit_ratio": 0.8,
    "oldest_waiting": 3.0,
    "admitted_before_time": 100.0,
    "max_sequence_tokens": 300,
    "engine_e2e_latency_p99": 2.0,
    "engine_queue_time_p99": 1.0,
    "error_rate": 0.0,
    "length_padding_ratio": 0.2,
    "long_prompt_ratio": 0.0,
    "padding_ratio": 0.0,
    "window_seconds": 60.0,
    "requests_finished": 10,
    "finished_by_reason": {"stop": 10},
}


def full_state() -> AgentState:
    """An agent's answer in which every signal of the agent and NVML has a value."""
    state = agent_state(stats_values=FULL_STATS)
    return state.model_copy(
        update={
            "engine": state.engine.model_copy(
                update={
                    "started_at": 1.0,
                    "parallel": state.engine.parallel.model_copy(
                        update={"tensor_parallel_size": 2}
                    ),
                }
            ),
            "schedule_histogram": ScheduleHistogram(bounds=[0.001, 0.01], cumulative=[5, 10, 10]),
            "tiers": state.tiers.model_copy(
                update={
                    "now": {
                        t: TierNow(waiting=1, running=0, oldest_waiting_seconds=2.0)
                        for t in ("hot", "warm", "cold")
                    }
                }
            ),
            "gpus": Gpus(
                nvml_up=True,
                per_gpu={
                    "0": GpuReading(
                        utilization_ratio=0.9, memory_used_bytes=10, memory_total_bytes=20
                    ),
                    "1": GpuReading(
                        utilization_ratio=0.5, memory_used_bytes=8, memory_total_bytes=20
                    ),
                },
            ),
        }
    )


def rule_signals() -> Counter[str]:
    """Every signal the shipped rule catalog's conditions name."""
    found: Counter[str] = Counter()

    def walk(node: Any) -> None:
        if isinstance(node, C.Selector):
            found[node.signal.name] += 1
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, tuple | list):
            for item in node:
                walk(item)

    for rule in load_rules().bind():
        walk(rule.condition)
    return found


def runbook_signals() -> Counter[str]:
    """Every signal the shipped runbook catalog's checks, conditions, verifications
    and guards name."""
    found: Counter[str] = Counter()
    for runbook in load_runbooks().values():
        found.update(c.signal for c in runbook.checks)
        found.update(s.when.signal for s in runbook.steps if s.when is not None)
        v = runbook.verification
        if v is not None:
            found.update([v.signal, *v.rollback_if_worse, *v.required_guards])
    return found


def test_every_name_the_catalogs_use_is_in_the_registry() -> None:
    rules, runbooks = rule_signals(), runbook_signals()
    assert len(rules) >= 20 and len(runbooks) >= 25  # the walk finds what the catalogs name
    assert set(rules) <= set(SIGNALS) and set(runbooks) <= set(SIGNALS)
    assert all(SIGNALS[n].metric for n in rules)  # rules query series
    assert all(SIGNALS[n].reading for n in runbooks)  # runbooks read the engine
    # The same quantity, named by both catalogs, is one name (it was five pairs).
    assert {"kv_cache_usage", "requests_waiting", "block_fragmentation", "kv_hit_ratio"} <= (
        set(rules) | set(runbooks)
    )
    assert not (set(rules) | set(runbooks)) & set(RENAMED)


def test_the_runbook_side_reads_exactly_the_registry() -> None:
    assert list(sources.SOURCES) == list(READABLE)
    assert {n: s.reading for n, s in SIGNALS.items() if s.reading} == dict(sources.SOURCES)
    # What the reader returns for an agent's answer: every readable signal, no other name,
    # and from a full answer each has a value but a rate between two reads and the API
    # server's (the SLO burn rate among them: read by an SLO alert's execution only).
    bare = agent_state()  # no GPU, no per-tier queues, nothing finished
    assert set(sources.signals_from_state(bare)) == set(READABLE)
    read = sources.signals_from_state(full_state())
    assert set(read) == set(READABLE)
    assert [n for n, v in read.items() if v is None] == [
        "scheduled_tokens_per_second",
        "http_error_rate",
        "slo_burn_rate",
    ]
    since = sources.since_signals(FakeAgent().state(since_step=5).since)  # type: ignore[arg-type]
    # Windowed signals, and the change's starving requests still waiting.
    assert set(since) <= sources.WINDOWED | {"starving_waiting"}
    assert {"http_error_rate", "slo_burn_rate"} == sources.API_SIGNALS
    assert set(READABLE) >= HIGHER_IS_WORSE
    assert set(sources.unavailable(bare, dict.fromkeys(READABLE))) == set(READABLE)


def test_no_quantity_is_in_the_registry_under_two_names() -> None:
    series = Counter(s.metric for s in SIGNALS.values() if s.metric is not None)
    assert [m for m, n in series.items() if n > 1] == []
    derived = Counter((s.of, s.how) for s in SIGNALS.values() if s.of is not None)
    assert [d for d, n in derived.items() if n > 1] == []
    # A series' name without prefix and unit is not a second name of its quantity.
    spelled = {
        (s.metric.removeprefix(M.PREFIX).removesuffix("_total")): s.name
        for s in SIGNALS.values()
        if s.metric is not None and s.metric.startswith(M.PREFIX)
    }
    others = {spelled[n] for n in SIGNALS if n in spelled and spelled[n] != n}
    assert others == set(), f"a registry name spells another entry's series: {others}"


def test_derived_signals_are_named_by_the_one_rule() -> None:
    for s in SIGNALS.values():
        if s.of is None:
            continue
        base = SIGNALS[s.of]
        assert s.name == f"{s.of}_{s.how}"
        if s.how in RATES:
            assert base.type == "counter", s.name
        elif s.how in HISTOGRAM_PARTS:
            assert base.type == "histogram", s.name
        else:
            assert base.per is not None, s.name  # over the base's label, or one value of it
            assert s.how in OVER_LABEL or s.how in ("hot", "warm", "cold", "0"), s.name


def test_renames_point_to_registry_names() -> None:
    assert set(RENAMED).isdisjoint(SIGNALS)
    assert set(RENAMED.values()) <= set(SIGNALS)


# --- what a catalog that names the wrong signal is told ----------------------------------

RULE = """\
rules:
  - alert: VllmFoo
    severity: warning
    runbook: null
    summary: s
    description: d
    for: 1m
    condition:
      expr: {EXPR}
      above: 0
"""

RUNBOOK = """\
name: foo
description: d
checks:
  - name: c
    description: d
    signal: {SIGNAL}
steps:
  - action: advise
    params: {{text: t}}
"""


def rule_problem(tmp_path: Path, expr: str) -> str:
    (tmp_path / "x.yaml").write_text(RULE.replace("{EXPR}", expr), encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_rules(tmp_path, display_root=tmp_path)
    [problem] = info.value.problems
    return str(problem)


def runbook_problem(tmp_path: Path, signal: str) -> str:
    (tmp_path / "foo.yaml").write_text(RUNBOOK.format(SIGNAL=signal), encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_runbooks([tmp_path])
    [problem] = info.value.problems
    return str(problem)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (
            "{rate: schedule_seconds_sum, window: 5m}",
            "signal 'schedule_seconds_sum' was renamed 'schedule_time_sum'",
        ),
        (
            "preemptions_per_minute",
            "signal 'preemptions_per_minute' is read by runbooks from the engine, not a "
            "Prometheus series; it is derived from 'preemptions'",
        ),
        ("kv_cache_usage_ratio", "signal 'kv_cache_usage_ratio' was renamed 'kv_cache_usage'"),
    ],
)
def test_a_rule_is_told_the_name_to_use(tmp_path: Path, expr: str, message: str) -> None:
    assert rule_problem(tmp_path, expr) == f"x.yaml:9: rule VllmFoo: {message}"


@pytest.mark.parametrize(
    ("signal", "message"),
    [
        ("kv_cache_usage_ratio", "signal 'kv_cache_usage_ratio' was renamed 'kv_cache_usage'"),
        ("num_requests_waiting", "signal 'num_requests_waiting' was renamed 'requests_waiting'"),
        (
            "p99_latency_seconds",
            "signal 'p99_latency_seconds' was renamed 'engine_e2e_latency_p99'",
        ),
        (
            "gpu_utilization",
            "signal 'gpu_utilization' is a Prometheus series for rules; a runbook cannot read "
            "it (runbooks read gpu_utilization_max, gpu_utilization_spread)",
        ),
        (
            "e2e_latency",
            "signal 'e2e_latency' is a Prometheus series for rules; a runbook cannot read it",
        ),
    ],
)
def test_a_runbook_is_told_the_name_to_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)  # the loader shows paths relative to the working directory
    assert runbook_problem(tmp_path, signal) == (
        f"foo.yaml:6: runbook foo: checks[0].signal: Value error, {message}"
    )


def test_one_name_per_quantity_from_series_to_wire_to_yaml() -> None:
    """The agent's wire names a quantity as the rules and runbooks do: a `stats`
    field read from a series a signal declares has that signal's name, no wire
    field keeps a name the signals renamed, and every signal a runbook reads
    from `stats` is read under its own name (no translation table)."""
    from vllm_runbook.collector import agent_api as api
    from vllm_runbook.collector.state import STAT_KEYS
    from vllm_runbook.rules.signals import RENAMED

    by_series = {s.metric: name for name, s in SIGNALS.items() if s.metric}
    for series, field in STAT_KEYS.items():
        if series in by_series and not field.endswith("_total"):
            assert field == by_series[series], (series, field)
    for model in (api.Stats, api.SettledSince, api.DrainingSince, api.Before):
        assert not set(model.model_fields) & set(RENAMED), model.__name__
    assert not hasattr(sources, "_FROM_STATS")
    state = FakeAgent([FULL_STATS]).state()
    read = sources.signals_from_state(state)
    for name in sources._IN_STATS:
        assert name in api.Stats.model_fields
        if name not in ("max_num_batched_tokens", "max_num_seqs"):  # the knobs' values
            assert read[name] == getattr(state.stats, name), name


def test_an_agent_of_an_earlier_version_is_read_under_its_old_names() -> None:
    from vllm_runbook.collector import agent_api as api

    old = {
        k: v
        for k, v in agent_state(FakeAgent([{}]).knobs, FULL_STATS, None, 1)
        .stats.model_dump()
        .items()
    }
    renamed_back = {
        "kv_cache_usage": "kv_cache_usage_ratio",
        "requests_running": "num_requests_running",
        "requests_waiting": "num_requests_waiting",
        "oldest_waiting": "oldest_waiting_seconds",
        "engine_e2e_latency_p99": "p99_latency_seconds",
        "engine_queue_time_p99": "waiting_seconds_p99",
    }
    for new, was in renamed_back.items():
        old[was] = old.pop(new)
    stats = api.Stats.model_validate(old)
    assert (stats.kv_cache_usage, stats.requests_running, stats.engine_e2e_latency_p99) == (
        0.5,
        4,
        2.0,
    )
    assert "kv_cache_usage" in stats.model_dump() and "kv_cache_usage_ratio" not in (
        stats.model_dump()
    )
