"""The warm-up at engine start on vLLM's OpenAI server (EngineCore in its own,
spawned process: vLLM on CPU always spawns it, so the plugin loads inside
`EngineCore.__init__` and the hook that runs is the one before READY).

The oracle: 16 requests of 32 prompt + 8 output tokens under a 512-token
budget are one prefill step of 16 x 32 = 512 tokens, seven decode steps of 16
and one step that reports them finished: 9 steps, 624 tokens. All of it is
done when /health first answers, and the API server never saw a warm-up
request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.collector import metrics as M

from tests.engines import ServedEngine, http_get, runbook_cli

pytestmark = [pytest.mark.engine, pytest.mark.served]

WARMUP_ENV = {
    "VLLM_RUNBOOK_WARMUP": "on",
    "VLLM_RUNBOOK_WARMUP_REQUESTS": "16",
    "VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS": "32",
    "VLLM_RUNBOOK_WARMUP_OUTPUT_TOKENS": "8",
}


def values(url: str, *names: str) -> dict[str, float]:
    """Each named series' value summed over its label sets (0 when absent)."""
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(http_get(url + "/metrics")[1]):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def test_warmed_up_before_health_answers_then_serves_traffic(
    tiny_model: Path, tmp_path: Path
) -> None:
    with ServedEngine.run(tiny_model, tmp_path / "serve.log", env=WARMUP_ENV) as served:
        # The first /health 200 is behind us: the warm-up had ended by then.
        warmup = (
            M.WARMUP_REQUESTS_PLANNED,
            M.WARMUP_REQUESTS_DONE,
            M.WARMUP_STEPS,
            M.WARMUP_TOKENS,
            M.WARMUP_DONE,
            M.STEPS,
        )
        ours = values(served.agent_url, *(spec.series_name for spec in warmup))
        assert [ours[spec.series_name] for spec in warmup] == [16, 16, 9, 16 * 32 + 7 * 16, 1, 9]
        seconds = values(served.agent_url, M.WARMUP_SECONDS.name)[M.WARMUP_SECONDS.name]
        assert 0 < seconds < 60

        vllm_counters = ("vllm:prompt_tokens_total", "vllm:request_success_total")
        assert values(served.api_url, *vllm_counters) == dict.fromkeys(vllm_counters, 0.0)
        out = served.complete(100, max_tokens=4)
        assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (100, 4)
        assert values(served.api_url, *vllm_counters) == {
            "vllm:prompt_tokens_total": 100.0,
            "vllm:request_success_total": 1.0,
        }

        status = runbook_cli("status", "--engine", served.agent_url)
        assert status.returncode == 0, status.stderr
        assert "warm-up at start: done: 16/16 requests, 9 steps, 624 tokens in" in status.stdout

        # The runbook has nothing to add on an engine warmed up at start.
        db = f"sqlite:///{tmp_path / 'runbook.db'}"
        ran = runbook_cli(
            "exec", "warmup", "--engine", served.agent_url, "--vllm", served.api_url,
            "--json", "--db", db,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        execution = json.loads(ran.stdout)["execution"]
        assert execution["display_status"] == "nothing to improve"
        assert execution["reason"].endswith(
            "warmup_done = 1, the runbook acts only if warmup_done < 1"
        ), execution["reason"]
        assert values(served.api_url, *vllm_counters)["vllm:request_success_total"] == 1.0
