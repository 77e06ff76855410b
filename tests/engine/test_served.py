"""A real OpenAI server (EngineCore in its own process) with and without the plugin."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.runbooks.engine.sources import API, NO_API_URL, SOURCES, api_signals

from tests.engines import ServedEngine, http_get, runbook_cli

pytestmark = [pytest.mark.engine, pytest.mark.served]


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def _expected_names() -> list[str]:
    return [
        spec.name + "_count" if spec.type == "histogram" else spec.series_name
        for spec in M.ALL_METRICS
        if not spec.gpu_only and not spec.advisory_only
    ]


def _rejected(served: ServedEngine, prompt_tokens: int) -> int:
    """POST a completion the API server rejects itself; its HTTP status."""
    import urllib.error
    import urllib.request

    from vllm_runbook.collector.tiny_model import prompt_token_ids

    body = json.dumps(
        {"model": served.model_id(), "prompt": prompt_token_ids(prompt_tokens), "max_tokens": 4}
    ).encode()
    req = urllib.request.Request(
        served.api_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _http_error_rate_is_read_from_the_api_server(served: ServedEngine, tmp_path: Path) -> None:
    """vLLM 0.32's API server /metrics: its request series and the HTTP
    statuses only it knows (a rejected request never reaches the engine)."""
    assert _rejected(served, 2000) == 400  # longer than max_model_len 1024
    status, text = http_get(served.api_url + "/metrics")
    assert status == 200
    theirs = _samples(text)
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_success_total",
        "http_requests_total",
    ):
        assert name in theirs, name
    success = {labels["finished_reason"]: v for labels, v in theirs["vllm:request_success_total"]}
    assert success["length"] == 2
    posts = {
        labels["status"]: v
        for labels, v in theirs["http_requests_total"]
        if labels["method"] == "POST" and labels["handler"] == "/v1/completions"
    }
    assert posts == {"2xx": 2, "4xx": 1}
    assert api_signals(text) == ({"http_error_rate": 0.0}, {})

    # runbook show --engine --vllm: the API server's signal with its source.
    args = ("show", "error-rate-high", "--engine", served.agent_url, "--json")
    shown = runbook_cli(*args, "--vllm", served.api_url)
    assert shown.returncode == 0, shown.stderr
    rows = {r["name"]: r for r in json.loads(shown.stdout)["live"]["readings"]}
    assert rows["http_error_rate"]["value"] == 0.0
    assert rows["http_error_rate"]["source"] == SOURCES["http_error_rate"].source
    assert rows["http_error_rate"]["source"].startswith(API)
    assert rows["finish_reasons"]["value"]["length"] == 2  # the collector's, in the window
    # Without the API server's URL: unavailable, and why.
    shown = runbook_cli(*args)
    rows = {r["name"]: r for r in json.loads(shown.stdout)["live"]["readings"]}
    assert rows["http_error_rate"]["value"] is None
    assert rows["http_error_rate"]["unavailable"] == NO_API_URL

    # runbook exec --vllm: the check reads it into the journal.
    db = f"sqlite:///{tmp_path / 'api.db'}"
    ran = runbook_cli(
        "exec", "error-rate-high", "--engine", served.agent_url, "--vllm", served.api_url,
        "--json", "--db", db,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    checks = json.loads(ran.stdout)["execution"]["checks"]
    assert checks["http_error_rate"]["value"] == 0.0
    assert checks["error_rate"]["value"] == 0.0


def _name_filters_and_the_rules_scrape(served: ServedEngine) -> None:
    """`/metrics?name[]=...` (what the rules' scraper asks): the agent answers those
    samples only; vLLM's own /metrics ignores the filter (its instrumentator's
    /metrics route answers before prometheus_client's app, which would honour it)
    and sends its whole page, which the scraper reads as it is, and sees as whole (a
    family no wanted name belongs to): that target is read whole from then on, with
    no second request; the agent's filtered page loses nothing."""
    from vllm_runbook.rules.evaluator import store_for_rules
    from vllm_runbook.rules.model import load_catalog
    from vllm_runbook.rules.scrape import Scraper, Target

    up = M.COLLECTOR_UP.name
    status, text = http_get(f"{served.agent_url}/metrics?name[]={up}&name[]=nothing")
    assert status == 200
    assert list(_samples(text)) == [up]
    status, text = http_get(served.api_url + "/metrics?name[]=vllm%3Anum_requests_running")
    theirs = _samples(text)
    assert status == 200
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= set(theirs)
    targets = [Target(f"{url}/metrics", "served") for url in (served.agent_url, served.api_url)]
    with Scraper(store_for_rules(load_catalog().bind()), targets) as scraper:
        results = scraper.scrape_once(time.time())
    assert [(r.ok, r.samples > 0) for r in results] == [(True, True), (True, True)]
    assert scraper.unfiltered == {targets[1].url}


def test_served_engine_exports_every_metric_on_both_endpoints(
    tiny_model: Path, tmp_path: Path
) -> None:
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    with ServedEngine.run(tiny_model, tmp_path / "serve.log", env=env) as served:
        for _ in range(2):  # the same prompt twice: one prefix-cache hit
            out = served.complete(100, max_tokens=4, offset=11)
            assert out["usage"]["completion_tokens"] == 4

        status, text = http_get(served.agent_url + "/metrics")
        assert status == 200
        ours = _samples(text)
        for name in _expected_names():
            assert name in ours, name
        labels, _ = ours[M.COLLECTOR_UP.name][0]
        assert labels == {"model_name": served.model_id(), "engine": "0"}
        assert ours[M.PREFIX_CACHE_HITS.series_name][0][1] == 96

        # PROMETHEUS_MULTIPROC_DIR: the same series on vLLM's own /metrics,
        # mirrored once a second.
        deadline = time.monotonic() + 5
        while True:
            status, text = http_get(served.api_url + "/metrics")
            theirs = _samples(text)
            queries = theirs.get(M.PREFIX_CACHE_QUERIES.series_name, [({}, 0.0)])[0][1]
            if queries == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "vllm:num_requests_running" in theirs  # vLLM's own series
        for name in _expected_names():
            assert name in theirs, name
        assert theirs[M.PREFIX_CACHE_QUERIES.series_name][0][1] == 200
        _http_error_rate_is_read_from_the_api_server(served, tmp_path)
        _name_filters_and_the_rules_scrape(served)

        # Control of an EngineCore in its own process, token found locally.
        cli = runbook_cli(
            "set",
            "--engine",
            served.agent_url,
            "max_num_batched_tokens=x0.5",
            "max_num_seqs=16",
            "policy=priority",
        )
        assert cli.returncode == 0, cli.stderr
        assert "max_num_batched_tokens 512 → 256" in cli.stdout
        assert served.complete(300, max_tokens=2)["usage"]["prompt_tokens"] == 300
        ours = _samples(http_get(served.agent_url + "/metrics")[1])
        assert ours[M.MAX_NUM_BATCHED_TOKENS.name][0][1] == 256
        assert ours[M.MAX_NUM_SEQS.name][0][1] == 16
        status = runbook_cli("status", "--engine", served.agent_url, "--json")
        assert json.loads(status.stdout)[0]["knobs"]["policy"] == "priority"
        cli = runbook_cli("restore", "--engine", served.agent_url)
        assert cli.returncode == 0, cli.stderr
        assert "max_num_batched_tokens 256 → 512" in cli.stdout

        # A fresh machine: no journal, no `runbook db upgrade`, no --db. The
        # on-call's first command creates the default journal and runs.
        fresh = {"XDG_DATA_HOME": str(tmp_path / "fresh"), "RUNBOOK_DB_URL": ""}
        first = runbook_cli(
            "exec",
            "oom-pressure",
            "--engine",
            served.agent_url,
            "--yes",
            "--json",
            "--condition-seconds",
            "0",
            "--verify-seconds",
            "1",
            env=fresh,
        )
        execution = json.loads(first.stdout)["execution"]
        # Idle engine: nothing runs (longest sequence 0), nothing is preempted:
        # nothing to improve, refused before any change, and no failure.
        assert execution["checks"]["max_sequence_tokens"]["value"] == 0
        assert (execution["display_status"], execution["steps"]) == ("nothing to improve", [])
        assert first.returncode == 0 and "db upgrade" not in first.stderr, first.stderr
        assert (tmp_path / "fresh" / "vllm-runbook" / "runbook.db").exists()
        status = runbook_cli("status", "--engine", served.agent_url, "--json")
        assert json.loads(status.stdout)[0]["knobs"]["max_num_batched_tokens"] == 512


def test_empty_plugin_allow_list_serves_without_the_collector(
    tiny_model: Path, tmp_path: Path
) -> None:
    with ServedEngine.run(tiny_model, tmp_path / "serve.log", env={"VLLM_PLUGINS": ""}) as served:
        assert served.complete(20, max_tokens=3)["usage"]["completion_tokens"] == 3
        with pytest.raises(OSError):
            http_get(served.agent_url + "/metrics", timeout=2)
        assert "vllm_runbook_" not in http_get(served.api_url + "/metrics")[1]


def test_explicit_scheduler_cls_without_the_plugin(tiny_model: Path, tmp_path: Path) -> None:
    with ServedEngine.run(
        tiny_model,
        tmp_path / "serve.log",
        env={"VLLM_PLUGINS": ""},
        extra_args=["--scheduler-cls", "vllm_runbook.collector.scheduler.RunbookAutoScheduler"],
    ) as served:
        assert served.complete(40, max_tokens=3)["usage"]["completion_tokens"] == 3
        # The CPU backend schedules synchronously: the class built is the sync one.
        state = json.loads(http_get(served.agent_url + "/v1/state", timeout=30)[1])
        assert state["engine"]["scheduler_class"] == "RunbookScheduler"
        status, text = http_get(served.agent_url + "/metrics")
        assert status == 200
        ours = _samples(text)
        assert ours[M.COLLECTOR_UP.name][0][1] == 1
        assert ours[M.SCHEDULED_TOKENS.series_name][0][1] == 40 + 2  # prefill + 2 decodes


def test_data_parallel_engines_get_one_port_each(tiny_model: Path, tmp_path: Path) -> None:
    with ServedEngine.run(
        tiny_model, tmp_path / "serve.log", extra_args=["--data-parallel-size", "2"]
    ) as served:
        for i in range(6):
            served.complete(16, max_tokens=2, offset=9 * i)
        base = int(served.agent_url.rsplit(":", 1)[1])
        steps = {}
        for rank in (0, 1):
            status, text = http_get(f"http://127.0.0.1:{base + rank}/metrics")
            assert status == 200
            [(labels, value)] = _samples(text)[M.STEPS.series_name]
            assert labels["engine"] == str(rank)
            steps[rank] = value
        assert steps[0] > 0 and steps[1] > 0  # vLLM spread the requests over both
        # Each rank is controlled on its own port.
        cli = runbook_cli("set", "--engine", f"http://127.0.0.1:{base + 1}", "max_num_seqs=4")
        assert cli.returncode == 0, cli.stderr
        states = [
            json.loads(
                runbook_cli("status", "--engine", f"http://127.0.0.1:{base + r}", "--json").stdout
            )[0]
            for r in (0, 1)
        ]
        assert [s["knobs"]["max_num_seqs"] for s in states] == [32, 4]
