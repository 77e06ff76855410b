"""The inventory and its sources without a network: file_sd files, resolution, failures."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.runbooks.model.config import DiscoveryConfig, PrometheusDiscovery
from vllm_runbook.runbooks.service.discovery import (
    FILE_SD,
    ApiUrls,
    Discovery,
    FileSD,
    Inventory,
    targets_to_engines,
)
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics


def write_sd(path: Path, groups: list[dict[str, object]]) -> None:
    path.write_text(json.dumps(groups))


def group(*targets: str, **labels: str) -> dict[str, object]:
    return {"targets": list(targets), "labels": labels}


def test_file_sd_engines_names_urls_and_labels(tmp_path: Path) -> None:
    sd = tmp_path / "engines.json"
    write_sd(sd, [group("10.0.0.1:9360", "10.0.0.2:9360", namespace="llm", pod="p")])
    engines = FileSD([tmp_path / "*.json"], vllm_port=8000).read()
    assert [(e.name, e.agent, e.vllm, e.labels) for e in engines] == [
        (
            "10.0.0.1:9360",
            "http://10.0.0.1:9360",
            "http://10.0.0.1:8000",
            {"namespace": "llm", "pod": "p", "instance": "10.0.0.1:9360"},
        ),
        (
            "10.0.0.2:9360",
            "http://10.0.0.2:9360",
            "http://10.0.0.2:8000",
            {"namespace": "llm", "pod": "p", "instance": "10.0.0.2:9360"},
        ),
    ]


def test_file_sd_yaml_and_broken_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("- targets: ['h:1']\n  labels: {instance: pod-a}\n")
    [engine] = FileSD([tmp_path / "a.yaml"]).read()
    assert (engine.name, engine.agent, engine.vllm) == ("pod-a", "http://h:1", None)
    (tmp_path / "a.yaml").write_text("- targets: ['h:1'\n")
    with pytest.raises(Exception, match=r"a.yaml:2: not valid YAML"):
        FileSD([tmp_path / "a.yaml"]).read()
    (tmp_path / "b.json").write_text('{"targets": []}')
    with pytest.raises(Exception, match="expected a list of target groups"):
        FileSD([tmp_path / "b.json"]).read()


def test_inventory_add_remove_departed_and_static_first() -> None:
    static = EngineConfig(name="llama-0", agent="http://s:1", labels={"pod": "static"})
    inv = Inventory([static])
    seen: list[tuple[list[str], list[str]]] = []
    inv.on_change(
        lambda a, r: seen.append(([e.engine.name for e in a], [e.engine.name for e in r]))
    )
    one = EngineConfig(name="a", agent="http://a:1", vllm="http://a:8000", labels={"pod": "a"})
    two = EngineConfig(name="b", agent="http://b:1", labels={"pod": "b"})
    dup = EngineConfig(name="llama-0", agent="http://s:1")  # the static engine, discovered too
    inv.update(FILE_SD, [one, two, dup])
    assert [e.engine.name for e in inv.entries()] == ["llama-0", "a", "b"]
    assert inv.counts() == {"static": 1, "prometheus": 0, "file_sd": 2}
    assert ApiUrls(inv).get("http://a:1/") == "http://a:8000" and "http://b:1" not in ApiUrls(inv)
    inv.update(FILE_SD, [one])
    assert seen == [(["a", "b"], []), ([], ["b"])]
    assert inv.gone_reason("http://b:1") is not None
    assert inv.gone_reason("http://b:1").startswith("engine gone: b left the inventory (file_sd)")  # type: ignore[union-attr]
    assert inv.gone_reason("http://a:1") is None and inv.gone_reason("http://s:1") is None
    inv.update(FILE_SD, [one, two])  # back: no longer gone
    assert inv.gone_reason("http://b:1") is None


def test_resolve_exactly_one_engine() -> None:
    inv = Inventory([EngineConfig(name="llama-0", agent="http://s:1", labels={"pod": "static"})])
    inv.update(
        FILE_SD,
        [
            EngineConfig(
                name="10.0.0.1:9360",
                agent="http://10.0.0.1:9360",
                vllm="http://10.0.0.1:8000",
                labels={"namespace": "llm", "pod": "p1", "instance": "10.0.0.1:9360"},
            ),
            EngineConfig(
                name="10.0.0.1:9361",
                agent="http://10.0.0.1:9361",
                vllm="http://10.0.0.1:8000",
                labels={"namespace": "llm", "pod": "p1", "instance": "10.0.0.1:9361"},
            ),
        ],
    )
    assert inv.resolve({"pod": "static"}).engine.name == "llama-0"  # type: ignore[union-attr]
    assert inv.resolve({"instance": "10.0.0.1:9361"}).engine.name == "10.0.0.1:9361"  # type: ignore[union-attr]
    both = inv.resolve({"namespace": "llm", "pod": "p1"})
    assert both.engine is None
    assert both.reason == (
        "2 engines match the alert's labels (10.0.0.1:9360, 10.0.0.1:9361): ambiguous, nothing runs"
    )
    # vLLM's address is shared by the two ranks: ambiguous too.
    assert inv.resolve({"instance": "10.0.0.1:8000"}).engine is None
    none = inv.resolve({"namespace": "llm", "pod": "p2"})
    assert none.engine is None
    assert none.reason == (
        "no engine in the inventory matches the alert's labels (namespace=llm, pod=p2)"
    )
    assert inv.resolve({"alertname": "X"}).reason == (
        "no engine in the inventory matches the alert's labels "
        "(it carries none of instance, pod, namespace)"
    )


class Failing:
    name = FILE_SD

    def __init__(self) -> None:
        self.fail = False
        self.engines = [EngineConfig(name="a", agent="http://a:1")]

    def read(self) -> list[EngineConfig]:
        if self.fail:
            from vllm_runbook.runbooks.service.discovery import DiscoveryError

            raise DiscoveryError("file_sd: gone")
        return self.engines


def test_a_failing_source_keeps_its_engines_counts_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = ServiceMetrics()
    inv = Inventory()
    source = Failing()
    discovery = Discovery(inv, [source], observer=metrics)
    discovery.refresh()
    sample = metrics.registry.get_sample_value
    assert sample("vllm_runbook_service_engines", {"source": "file_sd"}) == 1
    source.fail = True
    with caplog.at_level(logging.WARNING, "vllm_runbook.service"):
        discovery.refresh()
        discovery.refresh()
    assert [e.engine.name for e in inv.entries()] == ["a"]
    assert (
        sample("vllm_runbook_service_discovery_refresh_failures_total", {"source": "file_sd"}) == 2
    )
    assert sample("vllm_runbook_service_engines", {"source": "file_sd"}) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "discovery source file_sd failed: file_sd: gone; keeping its last 1 engine(s)"
    ]
    source.fail = False
    source.engines = []
    with caplog.at_level(logging.WARNING, "vllm_runbook.service"):
        discovery.refresh()
    assert caplog.records[-1].getMessage() == "discovery source file_sd works again"
    assert inv.entries() == ()


def test_prometheus_targets_selected_by_job_and_labels() -> None:
    config = PrometheusDiscovery.model_validate(
        {"url": "http://prom:9090", "jobs": ["agents"], "match": {"namespace": "llm-.*"}}
    )
    targets = [
        {
            "scrapeUrl": "http://10.0.0.1:9360/metrics",
            "labels": {
                "job": "agents",
                "namespace": "llm-a",
                "instance": "10.0.0.1:9360",
                "pod": "p",
            },
        },
        {
            "scrapeUrl": "http://10.0.0.2:9360/metrics",
            "labels": {"job": "agents", "namespace": "other"},
        },
        {"scrapeUrl": "https://10.0.0.3:9360/x", "labels": {"job": "vllm", "namespace": "llm-a"}},
    ]
    [engine] = targets_to_engines(targets, config, 8000)
    assert (engine.name, engine.agent, engine.vllm) == (
        "10.0.0.1:9360",
        "http://10.0.0.1:9360",
        "http://10.0.0.1:8000",
    )
    with pytest.raises(ValueError, match="jobs"):
        PrometheusDiscovery.model_validate({"url": "http://prom:9090"})


def test_agent_tokens_by_label_then_fleet(tmp_path: Path) -> None:
    (tmp_path / "fleet").write_text("fleet-token\n")
    (tmp_path / "team-a").write_text("a-token\n")
    config = DiscoveryConfig.model_validate(
        {
            "file_sd": [str(tmp_path / "x.json")],
            "agent_tokens": {
                "file": str(tmp_path / "fleet"),
                "by_label": [{"match": {"namespace": "team-a"}, "file": str(tmp_path / "team-a")}],
            },
        }
    )
    inv = Inventory(discovery=config)
    inv.update(
        FILE_SD,
        [
            EngineConfig(name="a", agent="http://a:1", labels={"namespace": "team-a"}),
            EngineConfig(name="b", agent="http://b:1", labels={"namespace": "team-b"}),
        ],
    )
    assert (inv.token("http://a:1"), inv.token("http://b:1")) == ("a-token", "fleet-token")


def test_dp_ranks_of_one_pod_told_apart_by_the_alerts_engine_label(tmp_path: Path) -> None:
    sd = tmp_path / "pods.json"
    rank = {"namespace": "llm", "instance": "llama-7d9f"}
    write_sd(
        sd,
        [group("10.1.0.5:9360", **rank, dp_rank="0"), group("10.1.0.5:9361", **rank, dp_rank="1")],
    )
    inv = Inventory()
    inv.update(FILE_SD, FileSD([sd], vllm_port=8000).read())
    assert [e.engine.name for e in inv.entries()] == ["llama-7d9f-dp0", "llama-7d9f-dp1"]
    one = inv.resolve({"namespace": "llm", "instance": "llama-7d9f", "engine": "1"}).engine
    assert one is not None and one.agent == "http://10.1.0.5:9361"
    assert inv.resolve({"instance": "llama-7d9f"}).reason.startswith("2 engines match")  # type: ignore[union-attr]


def test_discovery_section_of_the_configuration_file(tmp_path: Path) -> None:
    from vllm_runbook.rules.errors import CatalogError
    from vllm_runbook.runbooks.model.config import load_config

    path = tmp_path / "runbook.yaml"
    path.write_text(
        "discovery:\n"
        "  refresh_interval: 10s\n"
        "  prometheus:\n"
        "    url: http://prom:9090\n"
        "    jobs: [agents]\n"
        "    bearer_token_file: secrets/prom\n"
        "  file_sd: [engines/*.json]\n"
        "  vllm_port: 8000\n"
    )
    d = load_config(path).discovery
    assert (d.refresh_interval_seconds, d.vllm_port, d.enabled) == (10.0, 8000, True)
    assert d.file_sd == (tmp_path / "engines/*.json",)
    assert d.prometheus is not None and d.prometheus.bearer_token_file == tmp_path / "secrets/prom"
    assert load_config(None).discovery.enabled is False
    path.write_text("discovery:\n  prometheus:\n    url: http://prom:9090\n    match: {pod: '('}\n")
    with pytest.raises(CatalogError, match=r"runbook.yaml:\d+: .*bad regular expression '\('"):
        load_config(path)
