"""Discovery's Prometheus source against a real Prometheus (no engine): its active
targets of a job, selected by job and labels, through the scraper's HTTP client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from vllm_runbook.runbooks.model.config import PrometheusDiscovery
from vllm_runbook.runbooks.service.discovery import DiscoveryError, PrometheusSD

from tests.engines import PrometheusServer, free_port, require_tool

pytestmark = [pytest.mark.service]


def test_prometheus_source_reads_active_targets(tmp_path: Path) -> None:
    require_tool("prometheus")
    sd = tmp_path / "agents.json"
    a, b, c = (f"127.0.0.1:{free_port()}" for _ in range(3))
    sd.write_text(
        json.dumps(
            [
                {"targets": [a, b], "labels": {"namespace": "llm", "pod": "p"}},
                {"targets": [c], "labels": {"namespace": "other"}},
            ]
        )
    )
    doc = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "agents",
                "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}],
            },
            {"job_name": "other", "static_configs": [{"targets": [f"127.0.0.1:{free_port()}"]}]},
        ],
    }
    with PrometheusServer.run(yaml.safe_dump(doc), tmp_path / "prometheus") as prom:
        config = PrometheusDiscovery.model_validate(
            {"url": prom.url, "jobs": ["agents"], "match": {"namespace": "llm"}}
        )
        source = PrometheusSD(config, vllm_port=8000)
        end = time.monotonic() + 60
        found = source.read()
        while len(found) < 2 and time.monotonic() < end:
            time.sleep(0.5)
            found = source.read()
        assert sorted((e.name, e.agent, e.vllm) for e in found) == sorted(
            (t, f"http://{t}", "http://127.0.0.1:8000") for t in (a, b)
        )
        assert {e.labels["job"] for e in found} == {"agents"}
    with pytest.raises(DiscoveryError, match=r"^prometheus http://127\.0\.0\.1:\d+: "):
        source.read()  # Prometheus is gone
