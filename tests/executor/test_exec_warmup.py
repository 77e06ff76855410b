"""`runbook exec warmup` against a served CPU engine: real completions through
vLLM's API server, counted by vLLM's own metrics.

The oracle is vLLM's counters: the shipped runbook sends 32 requests of 256
prompt tokens and 16 output tokens, so `vllm:prompt_tokens_total` must grow by
exactly 8192, `vllm:generation_tokens_total` by 512 and the finished requests
by 32; the prompts differ from their first token, so the agent counts no
prefix-cache hit. A dry run, a missing or dead API URL send nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M
from vllm_runbook.runbooks.engine.warmup import warmup_prompt
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import STEP_FAILED, ExecutionStatus

from tests.catalogs import catalog_with
from tests.engines import ServedEngine, free_port, http_get, runbook_cli

pytestmark = [pytest.mark.engine, pytest.mark.served]

CATALOG_DIR = Path(__file__).resolve().parents[2] / "runbooks" / "catalog"


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEngine]:
    tmp = tmp_path_factory.mktemp("warmup-engine")
    with ServedEngine.run(tiny_model, tmp / "serve.log") as engine:
        yield engine


def counters(served: ServedEngine) -> dict[str, float]:
    """vLLM's request and token counters, and the agent's prefix-cache hits."""
    wanted = {
        "vllm:prompt_tokens_total": "prompt",
        "vllm:generation_tokens_total": "generation",
        "vllm:request_success_total": "finished",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(http_get(served.api_url + "/metrics")[1]):
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
    for family in text_string_to_metric_families(http_get(served.agent_url + "/metrics")[1]):
        for s in family.samples:
            if s.name == M.PREFIX_CACHE_HITS.series_name:
                out["prefix_hits"] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def exec_warmup(db_url: str, served: ServedEngine, *extra: str) -> Any:
    return runbook_cli(
        "exec", "warmup", "--engine", served.agent_url, "--verify-seconds", "0",
        "--poll-seconds", "0.1", "--db", db_url, *extra, timeout=300,
    )  # fmt: skip


def warmup_step(db_url: str) -> Any:
    store = Journal(db_url)
    try:
        [execution] = store.list_executions(runbook="warmup")
        [step] = execution.steps
        return execution, step
    finally:
        store.close()


def test_warmup_sends_exactly_the_requests_the_runbook_names(
    served: ServedEngine, db_url: str
) -> None:
    before = counters(served)
    cli = exec_warmup(db_url, served, "--vllm", served.api_url)
    # Read-only: no knob changed, so there is nothing to verify or revert.
    assert cli.returncode == 0, cli.stderr
    assert f"sent 32 requests of 256+16 tokens to {served.api_url}: 32 ok, 0 failed" in cli.stdout
    assert delta(before, counters(served)) == {
        "prompt": 32 * 256,
        "generation": 32 * 16,
        "finished": 32,
        "prefix_hits": 0,
    }
    execution, step = warmup_step(db_url)
    assert step.action == "send_warmup_requests" and step.status == "applied", step.error
    summary = step.after["warmup"]
    assert (summary["sent"], summary["succeeded"], summary["failed"]) == (32, 32, 0)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (256, 16)
    assert summary["model"] == served.model_id()
    assert execution.status == ExecutionStatus.SUCCEEDED, execution.reason


def test_warmup_prompt_that_does_not_fit_is_shortened(
    served: ServedEngine, db_url: str, tmp_path: Path
) -> None:
    # A copy of the shipped runbook asking for 2,000-token prompts; the engine's
    # max_model_len is 1024, so each prompt is 1024 - 16 tokens.
    doc = yaml.safe_load((CATALOG_DIR / "warmup.yaml").read_text())
    doc["steps"][0]["params"] = {"count": 3, "prompt_tokens": 2000, "concurrency": 2}
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "warmup.yaml").write_text(yaml.safe_dump(doc))
    before = counters(served)
    cli = exec_warmup(db_url, served, "--vllm", served.api_url, "--catalog", str(catalog))
    assert cli.returncode == 0, cli.stderr
    assert delta(before, counters(served)) == {
        "prompt": 3 * 1008,
        "generation": 3 * 16,
        "finished": 3,
        "prefix_hits": 0,
    }
    _, step = warmup_step(db_url)
    summary = step.after["warmup"]
    assert (summary["prompt_tokens"], summary["prompt_tokens_requested"]) == (1008, 2000)


def test_dry_run_sends_nothing(served: ServedEngine, db_url: str) -> None:
    before = counters(served)
    cli = exec_warmup(db_url, served, "--vllm", served.api_url, "--dry-run", "--json")
    assert cli.returncode == 0, cli.stderr
    assert delta(before, counters(served)) == dict.fromkeys(before, 0.0)
    report = json.loads(cli.stdout)["execution"]
    assert report["dry_run"] is True and report["status"] == "succeeded"
    _, step = warmup_step(db_url)
    assert step.status == "planned"
    plan = step.after["warmup"]
    assert (plan["requests"], plan["prompt_tokens"], plan["sent"]) == (32, 256, 0)


@pytest.mark.parametrize("api", [None, "dead"])
def test_without_a_reachable_api_server_it_fails_in_one_line(
    served: ServedEngine, db_url: str, api: str | None
) -> None:
    before = counters(served)
    extra = [] if api is None else ["--vllm", f"http://127.0.0.1:{free_port()}"]
    cli = exec_warmup(db_url, served, *extra)
    assert cli.returncode != 0
    assert "Traceback" not in cli.stderr
    [line] = cli.stderr.strip().splitlines()
    expected = "vLLM API server URL" if api is None else "unreachable"
    assert expected in line, line
    assert delta(before, counters(served)) == dict.fromkeys(before, 0.0)
    execution, step = warmup_step(db_url)
    assert (execution.status, step.status) == (ExecutionStatus.FAILED, STEP_FAILED)


def test_nothing_to_warm_up_on_an_engine_past_its_warm_up_period(
    served: ServedEngine, db_url: str, tmp_path: Path
) -> None:
    """The shipped runbook acts only in an engine's first 600 s; this engine is not
    that old, so the period is shortened to 1 s in a copy of the catalog (the
    refusal reads the engine's real uptime). Nothing is sent, nothing fails."""
    catalog = catalog_with(
        tmp_path, "warmup", acts_only_if=[{"signal": "engine_uptime", "below": 1}]
    )
    before = counters(served)
    cli = exec_warmup(db_url, served, "--vllm", served.api_url, "--catalog", str(catalog), "--json")
    assert cli.returncode == 0, cli.stderr
    assert delta(before, counters(served)) == dict.fromkeys(before, 0.0)
    report = json.loads(cli.stdout)["execution"]
    assert (report["status"], report["display_status"]) == ("refused", "nothing to improve")
    uptime = report["checks"]["uptime"]["value"]
    assert uptime >= 1
    assert report["reason"].startswith("nothing to improve: engine_uptime = ")
    assert report["reason"].endswith(", the runbook acts only if engine_uptime < 1")
    assert report["steps"] == [] and report["error"] is None
    store = Journal(db_url)
    try:
        [execution] = store.list_executions(runbook="warmup")
        events = [e.event for e in store.events_of_execution(execution.id)]
    finally:
        store.close()
    assert events == ["nothing to improve"]


def test_prompts_are_exact_lengths_of_valid_ids_and_differ_from_the_first_token() -> None:
    prompts = [warmup_prompt(i, 64) for i in range(10_000)]
    assert all(len(p) == 64 for p in prompts)
    assert all(3 <= t < 503 for p in prompts for t in p)
    assert len({tuple(p[:2]) for p in prompts}) == 10_000
    assert warmup_prompt(7, 1) == [10]
