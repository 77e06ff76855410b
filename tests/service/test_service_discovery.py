"""A fleet that changes, all real processes on loopback: engines discovered, not listed.

Debian's Prometheus scrapes the collector agents from a file_sd file the test
edits (what Kubernetes' pod discovery would do); two `runbook serve`s follow
the fleet, one asking that Prometheus (`discovery.prometheus`), one reading
the same file itself (`discovery.file_sd`); real Alertmanager sends every
alert to both. One CPU vLLM engine with the plugin, started once, mid-test:

1. nothing listed: both inventories are empty;
2. the engine starts and its agent enters the file (with a second address of
   the same pod, `localhost`, so that the pod's labels name two engines, and a
   dead agent that stays): both services discover it and scrape it;
3. alerts through Alertmanager: one naming the engine's instance runs
   oom-pressure on it in both services (the budget halves, then the runbook
   waits for its condition); one naming only the pod is ambiguous, one naming
   an unknown pod matches nothing: refused, the journal says why. The engine
   is idle, so the services deploy the shipped catalog with oom-pressure's
   `acts_only_if` taken out (shipped, it refuses an engine without
   preemptions: "nothing to improve", tests/executor/test_exec_matrix.py);
   what is tested here is which engine an alert reaches, not the verdict;
4. the engine leaves the file and stops while both executions wait: each ends
   "engine gone", nothing reverted, no retry; the engine leaves the inventories;
5. Prometheus stops: the Prometheus-fed service keeps its last inventory (the
   dead agent) and counts the failed refreshes.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.catalogs import acting_catalog
from tests.engines import (
    PrometheusServer,
    ServedEngine,
    free_port,
    http_get,
    require_tool,
    runbook_cli,
)
from tests.service.processes import AlertmanagerServer, RunbookServe, alertmanager_config

pytestmark = [pytest.mark.engine, pytest.mark.served, pytest.mark.service]

TOKEN = "discovery-webhook-token"
JOB = "vllm-runbook-agents"
NAMESPACE = "fleet"


def wait_until(what: str, probe: Callable[[], Any], limit: float) -> Any:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        found = probe()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {limit:g} s")


def write_targets(path: Path, groups: list[dict[str, Any]]) -> None:
    """Atomically, as a file_sd writer must (Prometheus may read a half-written file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


def service_config(tmp: Path, name: str, discovery: dict[str, Any]) -> Path:
    doc = {
        "database": f"sqlite:///{tmp / f'{name}.db'}",
        "discovery": {"refresh_interval": "1s", **discovery},
        "automation": {"oom-pressure": "auto"},
        "webhook": {"token_file": str(tmp / "webhook.token")},
        "rules": {"evaluation_interval": "1s"},
        # The runbook's second step waits this long for its condition: the
        # engine leaves meanwhile.
        "executor": {"condition_seconds": "600s", "verify_seconds": "600s"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def samples(svc: RunbookServe) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(svc.metrics()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(svc: RunbookServe, name: str, **labels: str) -> float | None:
    return samples(svc).get((name, tuple(sorted(labels.items()))))


def post_alert(am: AlertmanagerServer, **labels: str) -> None:
    body = json.dumps([{"labels": {"alertname": "VllmOOMPressure", **labels}}]).encode()
    import urllib.request

    req = urllib.request.Request(
        am.url + "/api/v2/alerts", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_fleet_followed_through_prometheus_and_file_sd(tiny_model: Path, tmp_path: Path) -> None:
    require_tool("prometheus")
    require_tool("prometheus-alertmanager")
    (tmp_path / "webhook.token").write_text(TOKEN + "\n")
    sd = tmp_path / "agents.json"
    write_targets(sd, [])
    dead = f"127.0.0.1:{free_port()}"  # an agent that never answers: stays listed
    prom_doc = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": JOB,
                "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}],
            }
        ],
    }
    prom_stack = contextlib.ExitStack()  # closed by hand at step 5
    prom = prom_stack.enter_context(
        PrometheusServer.run(yaml.safe_dump(prom_doc), tmp_path / "prometheus")
    )
    with prom_stack, contextlib.ExitStack() as stack:
        via_prom = service_config(
            tmp_path, "via-prometheus", {"prometheus": {"url": prom.url, "jobs": [JOB]}}
        )
        via_file = service_config(tmp_path, "via-file", {"file_sd": [str(sd)]})
        catalog = ("--catalog", str(acting_catalog(tmp_path)))
        a = stack.enter_context(RunbookServe.run(via_prom, tmp_path / "serve-prom.log", *catalog))
        b = stack.enter_context(RunbookServe.run(via_file, tmp_path / "serve-file.log", *catalog))
        am_doc = yaml.safe_load(
            alertmanager_config(a.url + "/webhooks/alertmanager", tmp_path / "webhook.token")
        )
        [receiver] = am_doc["receivers"]
        hook = receiver["webhook_configs"][0]
        receiver["webhook_configs"].append({**hook, "url": b.url + "/webhooks/alertmanager"})
        am = stack.enter_context(
            AlertmanagerServer.run(yaml.safe_dump(am_doc), tmp_path / "alertmanager")
        )
        services = {"prometheus": a, "file_sd": b}

        # 1. Nothing listed, nothing found yet.
        for source, svc in services.items():
            assert svc.get("/api/engines") == []
            assert metric(svc, "vllm_runbook_service_engines", source=source) == 0

        # 2. The engine starts mid-test; its agent enters the file.
        engine_stack = contextlib.ExitStack()
        served = engine_stack.enter_context(ServedEngine.run(tiny_model, tmp_path / "engine.log"))
        agent = served.agent_url.removeprefix("http://")
        port = agent.rsplit(":", 1)[1]
        pod = {"namespace": NAMESPACE, "pod": "cpu-0"}
        fleet = [
            {"targets": [agent, f"localhost:{port}"], "labels": pod},
            {"targets": [dead], "labels": {"namespace": NAMESPACE, "pod": "idle-0"}},
        ]
        write_targets(sd, fleet)
        expected = {agent, f"localhost:{port}", dead}
        for source, svc in services.items():

            def found(svc: RunbookServe = svc) -> list[dict[str, Any]] | None:
                rows = svc.get("/api/engines")
                return rows if {r["name"] for r in rows} == expected else None

            rows = wait_until(f"{source}: the engine discovered", found, 90)
            mine = next(r for r in rows if r["name"] == agent)
            assert mine["agent"] == served.agent_url and mine["source"] == source
            assert {k: mine["labels"][k] for k in ("namespace", "pod", "instance")} == {
                **pod,
                "instance": agent,
            }
            if source == "prometheus":
                assert mine["labels"]["job"] == JOB
            # The embedded evaluator scrapes it.
            wait_until(
                f"{source}: the engine scraped",
                lambda svc=svc: (
                    metric(  # type: ignore[misc]
                        svc,
                        "vllm_runbook_service_scrape_duration_seconds",
                        target=served.agent_url + "/metrics",
                    )
                    is not None
                ),
                30,
            )
            # ... and its expositions parse (no failed attempt on it).
            errors = [
                v
                for (name, labels), v in samples(svc).items()
                if name == "vllm_runbook_service_scrape_errors_total"
                and dict(labels)["target"] == served.agent_url + "/metrics"
            ]
            assert sum(errors) == 0, errors
            assert metric(svc, "vllm_runbook_service_engines", source=source) == 3
        listed = runbook_cli("engines", "--service", a.url, "--json")
        assert listed.returncode == 0, listed.stderr
        assert {r["name"] for r in json.loads(listed.stdout)} == expected

        # 3. Alerts through Alertmanager: one engine, two engines, none.
        post_alert(am, instance=agent, severity="critical")
        post_alert(am, namespace=NAMESPACE, pod="cpu-0", severity="critical")
        post_alert(am, namespace=NAMESPACE, pod="nope", severity="critical")
        running: dict[str, dict[str, Any]] = {}
        for source, svc in services.items():

            def acting(svc: RunbookServe = svc) -> dict[str, Any] | None:
                rows = svc.get("/api/executions")
                mine = [r for r in rows if r["engine"] == served.agent_url]
                steps = mine[0]["steps"] if mine else []
                return mine[0] if steps and steps[0]["status"] == "applied" else None

            running[source] = wait_until(f"{source}: oom-pressure acting", acting, 60)
            assert running[source]["status"] == "running"

            def refusals(svc: RunbookServe = svc) -> list[dict[str, Any]] | None:
                rows = [r for r in svc.get("/api/executions") if r["engine"] == "unresolved"]
                return rows if len(rows) == 2 else None

            reasons = sorted(r["reason"] for r in wait_until("refusals", refusals, 30))
            assert reasons == [
                f"2 engines match the alert's labels ({agent}, localhost:{port}): "
                "ambiguous, nothing runs",
                f"no engine in the inventory matches the alert's labels "
                f"(namespace={NAMESPACE}, pod=nope)",
            ]
        knobs = json.loads(http_get(served.agent_url + "/v1/state")[1])["knobs"]
        assert knobs["max_num_batched_tokens"] == 128  # halved by each service

        # 4. The pod goes away while both executions wait for their condition.
        write_targets(sd, fleet[1:])
        engine_stack.close()
        for source, svc in services.items():
            execution_id = running[source]["id"]

            def ended(svc: RunbookServe = svc, eid: int = execution_id) -> dict[str, Any] | None:
                row = next(r for r in svc.get("/api/executions") if r["id"] == eid)
                return row if row["status"] not in ("running", "verifying") else None

            row = wait_until(f"{source}: execution ended", ended, 60)
            assert row["status"] == "failed", row
            assert row["error"].startswith(f"engine gone: {agent} left the inventory ({source})")
            assert row["error"].endswith("; not reverted (1 step(s) applied on it)")
            assert [s["status"] for s in row["steps"]] == ["applied"]  # not reverted
            rows = svc.get("/api/executions")
            assert not [r for r in rows if r["reverts_id"] == execution_id]  # no revert tried
            assert [r["id"] for r in rows if r["engine"] == served.agent_url] == [execution_id]
            assert {r["name"] for r in svc.get("/api/engines")} == {dead}
            assert metric(svc, "vllm_runbook_service_engines", source=source) == 1

        # 5. Prometheus stops: the last inventory is kept, the failures counted.
        prom_stack.close()
        failures = "vllm_runbook_service_discovery_refresh_failures_total"
        wait_until(
            "refresh failures counted",
            lambda: (metric(a, failures, source="prometheus") or 0) >= 2,
            30,
        )
        assert [r["name"] for r in a.get("/api/engines")] == [dead]
        assert metric(a, "vllm_runbook_service_engines", source="prometheus") == 1
        assert metric(b, failures, source="file_sd") == 0
        log = (tmp_path / "serve-prom.log").read_text()
        assert log.count("discovery source prometheus failed") == 1  # once per change of state
