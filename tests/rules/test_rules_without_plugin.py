"""Rules on engines without the plugin: what each rule needs, the without-plugin
variants through both backends on vLLM's own series, and `rules export --without-plugin`.

The backend cases are those of rule_cases.py with every collector series
renamed to its stand-in among vLLM's series (a case with a series that has no
stand-in is left out), plus cases for the stand-ins that are not a rename:
the same exact oracles must hold, since the variant reads vLLM's series
where the collector's are absent.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from pathlib import Path

import pytest
import yaml
from rule_cases import CASES, KV_USAGE, PREEMPT
from rule_harness import (
    EVAL,
    Case,
    parse_selector,
    promtool_required,
    promtool_version,
    run_evaluator,
    run_promtool,
    series,
)
from rule_harness import select_rule as select
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.needs import WITHOUT_PLUGIN_GROUP, needs, without_plugin
from vllm_runbook.rules.promql import export
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.runbooks.operate.cli import main

RULES = load_catalog().bind()
VARIANTS = without_plugin(RULES)
PROMTOOL = promtool_version()

# collector series -> vLLM's series for the same quantity (histograms: per part)
STAND_INS: dict[str, str] = {}
for _s in SIGNALS.values():
    if _s.metric is not None and _s.vllm is not None:
        STAND_INS[_s.metric] = _s.vllm
        if _s.type == "histogram":
            STAND_INS[_s.metric + "_bucket"] = _s.vllm + "_bucket"

QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


def test_every_rule_is_marked_by_what_it_needs() -> None:
    assert {(r.alert, r.severity): needs(r).text for r in RULES} == {
        ("VllmKVCacheHitRatioLow", "warning"): "vLLM only",
        ("VllmKVFragmentationSuspected", "warning"): "the plugin",
        ("VllmBlockFragmentationHigh", "warning"): "the plugin",
        ("VllmLatencySpike", "critical"): "vLLM only",
        ("VllmLatencyRiseFlatLoad", "critical"): "vLLM only",
        ("VllmHotPathBacklog", "warning"): "the plugin",
        ("VllmRequestStarvation", "warning"): "the plugin",
        ("VllmEngineStalled", "critical"): "the plugin",
        ("VllmEngineStuck", "critical"): "vLLM only (partly; all of it: the plugin)",
        ("VllmErrorRateHigh", "warning"): "vLLM only",
        ("VllmBatchTooLarge", "warning"): "vLLM only",
        ("VllmOOMPressure", "critical"): "vLLM only (partly; all of it: the plugin + NVML)",
        ("VllmOOMRateHigh", "warning"): "vLLM only",
        ("VllmGPUMemoryLeak", "warning"): "the plugin + NVML",
        ("VllmGPUMemoryImbalance", "warning"): "the plugin + NVML",
        ("VllmThroughputDrop", "warning"): "vLLM only",
        ("VllmBatchUtilizationLow", "info"): "the plugin",
        ("VllmPaddingHigh", "warning"): "the plugin",
        ("VllmPaddingHigh", "critical"): "the plugin",
        ("VllmCudagraphPaddingHigh", "warning"): "the plugin",
        ("VllmInsufficientWarmup", "warning"): "the plugin",
        ("VllmGPUComputeSkew", "warning"): "the plugin + NVML",
        ("VllmKVCacheRetentionShort", "info"): "vLLM only",
        ("VllmSpecDecodeAcceptanceLow", "info"): "vLLM only",
        ("VllmSpecDecodeAcceptanceLow", "warning"): "vLLM only",
    }
    # What the whole rule reads with the plugin: the most any leaf needs.
    assert {r.alert: needs(r).full for r in RULES if needs(r).full == "vllm"} == {
        "VllmErrorRateHigh": "vllm",
        # vLLM's own residency histograms and spec-decode counters: nothing to stand in for
        "VllmKVCacheRetentionShort": "vllm",
        "VllmSpecDecodeAcceptanceLow": "vllm",
    }


def _rule(tmp_path: Path, condition: dict[str, object]) -> list[object]:
    doc = {
        "rules": [
            {
                "alert": "Probe",
                "severity": "warning",
                "summary": "s",
                "description": "d",
                "runbook": None,
                "for": "1m",
                "condition": condition,
            }
        ]
    }
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return load_catalog(tmp_path / "probe.yaml").bind()  # type: ignore[return-value]


def test_needs_follow_the_expression_not_the_alert(tmp_path: Path) -> None:
    # The ratio gauge's stand-in (a ratio of vLLM's counters' rates) serves it read as is...
    [now] = _rule(tmp_path, {"expr": "kv_hit_ratio", "below": 0.5})
    assert needs(now).text == "vLLM only"  # type: ignore[arg-type]
    # ...but not its average over time: that needs the collector's gauge.
    [avg] = _rule(
        tmp_path, {"expr": {"avg_over_time": "kv_hit_ratio", "window": "5m"}, "below": 0.5}
    )
    assert needs(avg).text == "the plugin"  # type: ignore[arg-type]
    # `all` needs every term; `any` keeps the terms that work without the plugin.
    both = [{"expr": "requests_waiting", "above": 1}, {"expr": "oldest_waiting", "above": 1}]
    [all_] = _rule(tmp_path, {"all": both})
    [any_] = _rule(tmp_path, {"any": both})
    assert needs(all_).without_plugin is None  # type: ignore[arg-type]
    kept = needs(any_)  # type: ignore[arg-type]
    assert kept.text == "vLLM only (partly; all of it: the plugin)"
    assert isinstance(kept.without_plugin, C.Compare)
    assert isinstance(kept.without_plugin.expr, C.Fallback)
    assert kept.without_plugin.expr.second.sel.metric == "vllm:num_requests_waiting"  # type: ignore[union-attr]
    # `unless` keeps its exclusion or has no variant: without it the rule would fire
    # where the full rule does not.
    waiting = {"expr": "requests_waiting", "above": 1}
    [readable] = _rule(tmp_path, {**waiting, "unless": {"expr": "requests_running", "above": 8}})
    variant = needs(readable).without_plugin  # type: ignore[arg-type]
    assert isinstance(variant, C.Unless) and needs(readable).text == "vLLM only"  # type: ignore[arg-type]
    [plugin_only] = _rule(tmp_path, {**waiting, "unless": {"expr": "oldest_waiting", "above": 1}})
    assert needs(plugin_only).without_plugin is None  # type: ignore[arg-type]
    [narrowed] = _rule(tmp_path, {**waiting, "unless": {"any": both}})
    assert needs(narrowed).without_plugin is None  # type: ignore[arg-type]


def _on_vllm_series(case: Case) -> Case | None:
    """The case with each collector series renamed to its stand-in (None: one has none)."""
    out = []
    for selector, values in case.series:
        name, labels = parse_selector(selector)
        if not name.startswith("vllm:"):
            if name not in STAND_INS:
                return None
            name = STAND_INS[name]
        out.append(
            series(
                name,
                values,
                **{
                    k: v for k, v in labels.items() if k not in ("instance", "model_name", "engine")
                },
            )
        )
    return dataclasses.replace(case, series=tuple(out))


WITHOUT_PLUGIN_CASES: tuple[Case, ...] = (
    *(
        c
        for c in map(_on_vllm_series, CASES)
        if c is not None and any(c.alert == r.alert for r in VARIANTS)
    ),
    # The hit ratio from vLLM's counters over the collector's 1m window: 0.95,
    # then 0.5 from sample 20 (600 s). Both backends divide the two rates, whose
    # extrapolation is the same (same sample times): the ratio of the increases.
    # At 600: 1450 / 2000 = 0.725 (closed range, samples 18-20), 500 / 1000
    # (left-open): true from 600 either way, `for` 5m -> 900.
    Case(
        "VllmKVCacheHitRatioLow",
        "fire-vllm-counters",
        (series(QUERIES, "0+1000x59"), series(HITS, "0+950x19 18550+500x39")),
        1200,
        900,
    ),
    # 0.9, then no lookups at all (0 / 0 = NaN compares false).
    Case(
        "VllmKVCacheHitRatioLow",
        "quiet-vllm-counters",
        (series(QUERIES, "0+1000x19 19000x40"), series(HITS, "0+900x19 17100x40")),
        1200,
        None,
    ),
    # vLLM's KV usage at 0.96 without preemptions, then preemptions at 0.8.
    Case(
        "VllmOOMPressure",
        "quiet-vllm",
        (series(STAND_INS[KV_USAGE], "0.96x19 0.8x20"), series(STAND_INS[PREEMPT], "0x24 1+1x15")),
        1200,
        None,
    ),
)


def test_every_variant_has_a_firing_and_a_quiet_case_on_vllm_series() -> None:
    assert [r.alert for r in VARIANTS] == [
        "VllmKVCacheHitRatioLow",
        "VllmKVCacheRetentionShort",
        "VllmLatencySpike",
        "VllmLatencyRiseFlatLoad",
        "VllmEngineStuck",
        "VllmErrorRateHigh",
        "VllmBatchTooLarge",
        "VllmOOMPressure",
        "VllmOOMRateHigh",
        "VllmSpecDecodeAcceptanceLow",
        "VllmSpecDecodeAcceptanceLow",
        "VllmThroughputDrop",
    ]
    for rule in VARIANTS:
        mine = [c for c in WITHOUT_PLUGIN_CASES if c.alert == rule.alert]
        assert any(c.fires_at is not None for c in mine), rule.key
        assert any(c.fires_at is None for c in mine), rule.key
        for c in mine:  # vLLM's series only
            assert all(parse_selector(s)[0].startswith("vllm:") for s, _ in c.series), c.id


@pytest.mark.parametrize("case", WITHOUT_PLUGIN_CASES, ids=lambda c: c.id)
def test_evaluator_matches_oracle_without_the_plugin(case: Case) -> None:
    # The variant, and the full rule (the evaluator sees no plugin series and
    # evaluates the variant in its place): the same exact oracle.
    for rule in (select(VARIANTS, case), select(RULES, case)):
        assert run_evaluator(rule, case, left_open=False) == case.oracle(False)
        assert run_evaluator(rule, case, left_open=True) == case.oracle(True)


@pytest.mark.parametrize("case", WITHOUT_PLUGIN_CASES, ids=lambda c: c.id)
def test_prometheus_agrees_without_the_plugin(case: Case, tmp_path: Path) -> None:
    if PROMTOOL is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        pytest.skip("promtool not installed (apt-get install prometheus); CI fails instead")
    rule = select(VARIANTS, case)
    fired = run_evaluator(rule, case, left_open=PROMTOOL >= 3)
    assert fired == case.oracle(PROMTOOL >= 3)
    result = run_promtool(rule, case, fired, tmp_path)
    assert result.returncode == 0, (
        f"Prometheus disagrees with the evaluator (fired at {fired}, tolerance {EVAL}s):\n"
        f"{result.stdout}\n{result.stderr}"
    )


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if any(c.alert == r.alert and c.severity in (None, r.severity) for r in VARIANTS)
        and _on_vllm_series(c) is not None
    ],
    ids=lambda c: c.id,
)
def test_variant_reads_the_collector_where_the_engine_has_it(case: Case) -> None:
    # The original cases (collector series): the variant fires exactly as the rule.
    rule = select(VARIANTS, case)
    assert run_evaluator(rule, case, left_open=False) == case.oracle(False)


def test_export_without_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "without-plugin.rules.yml"
    assert main(["rules", "export", "--without-plugin", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text(encoding="utf-8"))
    [group] = doc["groups"]
    assert group["name"] == f"vllm-runbook-{WITHOUT_PLUGIN_GROUP}"
    assert [r["alert"] for r in group["rules"]] == [r.alert for r in VARIANTS]
    assert out.read_text(encoding="utf-8") == export(VARIANTS)
    oom = next(r for r in group["rules"] if r["alert"] == "VllmOOMPressure")
    assert "gpu" not in oom["expr"]
    assert (
        "(sum by (instance, model_name, engine) (rate(vllm_runbook_preemptions_total[1m])) or "
        "sum by (instance, model_name, engine) (rate(vllm:num_preemptions_total[1m])))"
    ) in oom["expr"]
    if PROMTOOL is None:
        if promtool_required():
            pytest.fail("promtool is missing (install Debian's `prometheus` package)")
        return
    result = subprocess.run(
        ["promtool", "check", "rules", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(VARIANTS)} rules found" in result.stdout


def test_service_evaluates_an_engine_without_the_plugin_from_its_vllm_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`runbook serve`'s rules service, an inventory engine whose agent is not there
    (no plugin) and whose vLLM API server serves only vLLM's series: VllmOOMPressure
    fires from vLLM's KV usage and preemptions, as it does from the collector's."""
    from rule_server import serve as serve_routes
    from vllm_runbook.runbooks.model.config import load_config
    from vllm_runbook.runbooks.service.rules_service import RulesService

    from tests.engines import free_port

    state = {"usage": 0.97, "preemptions": 0.0}
    labels = 'engine="0",model_name="tiny"'

    def exposition() -> str:
        return (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {state['usage']}\n"
            "# TYPE vllm:num_preemptions counter\n"
            f"vllm:num_preemptions_total{{{labels}}} {state['preemptions']}\n"
        )

    with serve_routes() as routes:
        routes.text("/metrics", exposition)
        path = tmp_path / "runbook.yaml"
        doc = {
            "engines": [
                {"name": "cpu-0", "agent": f"http://127.0.0.1:{free_port()}", "vllm": routes.url}
            ],
            "rules": {"overrides": {"VllmOOMPressure": {"for": "2s", "window": "10s"}}},
        }
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        service = RulesService.from_config(load_config(path))
        try:
            t0 = 1_700_000_000.0
            with caplog.at_level(logging.WARNING, logger="vllm_runbook.rules.evaluator"):
                assert service.run_cycle(t0) == []
            state.update(preemptions=2.0, usage=0.5)  # max_over_time keeps 0.97
            assert [(e.alert, e.state) for e in service.run_cycle(t0 + 1)] == [
                ("VllmOOMPressure", "pending")
            ]
            assert service.run_cycle(t0 + 2) == []
            [firing] = service.run_cycle(t0 + 3)
            assert (firing.alert, firing.state, firing.value) == ("VllmOOMPressure", "firing", 0.97)
            assert service.evaluator.without_plugin == {("cpu-0", "tiny", "0")}
            [said] = [m for m in caplog.messages if "has no vllm-runbook plugin" in m]
            assert said.startswith(
                "engine cpu-0 (model tiny, engine 0) has no vllm-runbook plugin: "
                f"{len(VARIANTS)} of {len(RULES)} rules"
            )
            # One a cycle, and the whole page once at the first answer (the
            # check that the `name[]` filter lost nothing, rules/scrape.py).
            assert routes.hits["/metrics"] == 5
        finally:
            service.close()


def test_evaluator_tells_engines_with_and_without_the_plugin_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm_runbook.collector import metrics as M
    from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
    from vllm_runbook.rules.incidents import MemoryIncidentSink

    store = store_for_rules(RULES)
    evaluator = Evaluator(RULES, store, MemoryIncidentSink())
    for instance in ("stock-0", "stock-1"):
        store.add(instance, "vllm:num_requests_waiting", {"model_name": "m", "engine": "0"}, 0, 1)
    store.add("ours-0", M.COLLECTOR_UP.name, {"model_name": "m", "engine": "0"}, 0, 1)
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.rules.evaluator"):
        evaluator.evaluate(10.0)
        evaluator.evaluate(20.0)  # said once per engine
    assert evaluator.without_plugin == {("stock-0", "m", "0"), ("stock-1", "m", "0")}
    assert evaluator.skipped(("ours-0", "m", "0")) == []
    assert len(evaluator.skipped(("stock-1", "m", "0"))) == len(RULES) - len(VARIANTS)
    first, second = [m for m in caplog.messages if "has no vllm-runbook plugin" in m]
    assert first.startswith("engine stock-0 (model m, engine 0) has no vllm-runbook plugin")
    assert first.endswith("VllmGPUComputeSkew (warning: needs the plugin + NVML)")
    assert second == (
        f"engine stock-1 (model m, engine 0) has no vllm-runbook plugin: {len(VARIANTS)} of "
        f"{len(RULES)} rules evaluated on vLLM's own series; not evaluated: as listed for the "
        "first such engine"
    )
    # The collector's series stop (the engine restarted without the plugin) while
    # vLLM's go on: past the 5 min look-back it is an engine without the plugin.
    for t in (30.0, 330.0):
        store.add("ours-0", "vllm:num_requests_waiting", {"model_name": "m", "engine": "0"}, t, 1)
    evaluator.evaluate(290.0)
    assert ("ours-0", "m", "0") not in evaluator.without_plugin
    evaluator.evaluate(330.0)
    assert ("ours-0", "m", "0") in evaluator.without_plugin
