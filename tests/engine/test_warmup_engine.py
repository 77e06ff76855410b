"""The warm-up at engine start on a real CPU engine (VLLM_RUNBOOK_WARMUP=on).

The oracle: 8 requests of 64 prompt + 4 output tokens under a 512-token budget
are one prefill step of 8 x 64 = 512 tokens, three decode steps of 8, and one
step that reports them finished (vLLM's busy loop takes it too), so the
warm-up runs exactly 5 steps and schedules 536 tokens, all before `LLM()`
returns (the engine is not ready before). The frontend never hears of the
warm-up requests: the traffic after it is served and is all it sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.warmup import REQUEST_ID_PREFIX, Outcome, warmup_prompt

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

WARMUP_ENV = {
    "VLLM_RUNBOOK_WARMUP": "on",
    "VLLM_RUNBOOK_WARMUP_REQUESTS": "8",
    "VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS": "64",
    "VLLM_RUNBOOK_WARMUP_OUTPUT_TOKENS": "4",
}


@pytest.fixture(scope="module")
def warmed_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in WARMUP_ENV.items():
            mp.setenv(key, value)
        eng = InProcessEngine.start(tiny_model, max_num_seqs=8)
    yield eng
    eng.close()


def test_warmed_up_before_the_engine_is_ready_with_exact_progress(
    warmed_engine: InProcessEngine,
) -> None:
    eng = warmed_engine
    progress = eng.collector.warmup
    assert progress.outcome == Outcome.DONE, progress.why
    values = {
        spec.name: eng.value(spec.name)
        for spec in (
            M.WARMUP_REQUESTS_PLANNED,
            M.WARMUP_REQUESTS_DONE,
            M.WARMUP_STEPS,
            M.WARMUP_TOKENS,
            M.WARMUP_DONE,
        )
    }
    assert values == {
        M.WARMUP_REQUESTS_PLANNED.name: 8.0,
        M.WARMUP_REQUESTS_DONE.name: 8.0,
        M.WARMUP_STEPS.name: 5.0,
        M.WARMUP_TOKENS.name: 8 * 64 + 3 * 8,
        M.WARMUP_DONE.name: 1.0,
    }
    seconds = eng.value(M.WARMUP_SECONDS.name)
    assert seconds is not None and 0 < seconds < 60
    # The warm-up is all the engine did so far, in the collector's own counters.
    assert eng.value(M.STEPS.series_name) == 5.0
    assert eng.value(M.SCHEDULED_TOKENS.series_name) == 536.0
    assert eng.value(M.REQUESTS_FINISHED.series_name, reason="length") == 8.0
    assert not eng.scheduler.has_requests()  # no request left behind


def test_traffic_after_the_warm_up_is_served_and_all_the_frontend_sees(
    warmed_engine: InProcessEngine,
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = warmed_engine
    for i in range(4):
        eng.add(f"t{i}", num_prompt_tokens=40, max_tokens=5, offset=i * 50)
    # The first warm-up prompt again: its two full blocks were cached during the
    # warm-up, and the cache was emptied after it, so nothing is found.
    hits = eng.value(M.PREFIX_CACHE_HITS.series_name)
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    eng.engine.add_request("t4", TokensPrompt(prompt_token_ids=warmup_prompt(0, 64)), params)
    finished = eng.run_until_done()
    assert sorted(finished) == ["t0", "t1", "t2", "t3", "t4"]
    assert all(len(out.outputs[0].token_ids) == 5 for out in finished.values())
    assert eng.value(M.PREFIX_CACHE_HITS.series_name) == hits
    assert not any(rid.startswith(REQUEST_ID_PREFIX) for rid in eng.finished)
    assert eng.value(M.REQUESTS_FINISHED.series_name, reason="length") == 13.0
    # The progress stays as the warm-up left it.
    assert eng.value(M.WARMUP_STEPS.name) == 5.0 and eng.value(M.WARMUP_DONE.name) == 1.0
