"""batch-too-large and kv-hit-low when the fix cannot work, on a real CPU engine.

Both runbooks cap max_num_seqs at half of what the KV cache holds at the
running requests' footprint. The traffic here is something the cap cannot
change: no prompt shares a block with another. A closed loop of 32 clients
(a finished request is replaced at once; 208-token prompts, 128 out) on an
engine with 256 KV blocks of 32 is a preemption storm, whose only prefix-cache
hits are preempted requests finding their own blocks again. Half the
sequences serve the same closed loop at about half the rate: its latency
gets worse, and the cap is rolled back.

The fix working is not among these tests: on vLLM V1 neither cap was
measured to raise the hit ratio or lower the P99 (docs/runbooks.md, "What
each rule is tested with").

The collector's clock advances STEP_S per engine step, so latencies are in
engine steps (a function of the workload, not of this machine's load); the
window is WINDOW_S of that clock. The executor runs in a thread of this
process with the shipped catalog while the test steps the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from matrix_bench import STARTUP, Bench, start_engine
from vllm_runbook.collector.tiny_model import VOCAB_SIZE, prompt_token_ids
from vllm_runbook.runbooks.run.render import format_signal
from vllm_runbook.runbooks.run.verification import WORSE

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

WINDOW_S = 10
STEP_S = 0.1  # collector seconds per engine step: the window is 100 steps
CLIENTS = 32
PROMPT, OUTPUT = 208, 128


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = start_engine(tiny_model, WINDOW_S)
    collector = eng.collector
    start, first = collector.wall_clock(), collector.stats.steps
    collector.wall_clock = lambda: start + (collector.stats.steps - first) * STEP_S
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _finished() -> Iterator[None]:
    """A test that failed mid-scenario leaves nothing in the engine for the next one."""
    yield
    Bench.finish_unfinished()


class Loop:
    """CLIENTS requests in the engine at every step, no two sharing a KV block."""

    def __init__(self, bench: Bench) -> None:
        self.b = bench

    def prompt(self) -> list[int]:
        # The first two tokens spell the request's number in base 509 (the
        # ordinary tokens): every prompt differs from every other in its first block.
        n, span = self.b.sent, VOCAB_SIZE - 3
        head = [3 + n % span, 3 + (n // span) % span]
        return head + prompt_token_ids(PROMPT - 2, offset=7 * n)

    def add(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, temperature=0.0)
        rid = f"{self.b.tag}-{self.b.sent}"
        self.b.engine.engine.add_request(rid, TokensPrompt(prompt_token_ids=self.prompt()), params)
        self.b.sent += 1

    def __call__(self) -> None:
        while len(self.b.engine.scheduler.requests) < CLIENTS:
            self.add()
        self.b.engine.step()

    def window(self) -> None:
        """Two whole windows of this traffic: the checks read only it."""
        steps = self.b.engine.collector.stats.steps
        while self.b.engine.collector.stats.steps < steps + 2 * WINDOW_S / STEP_S:
            self()


def capped(bench: Bench, result: Any) -> tuple[Any, int]:
    """The one step (set_max_num_seqs at half the KV capacity), and the cap."""
    (step,) = result.record.steps
    assert step.action == "set_max_num_seqs" and step.before == {"max_num_seqs": 32}
    assert step.after is not None
    cap = step.after["max_num_seqs"]
    capacity = step.params["kv_capacity_seqs"]
    assert cap == capacity // 2 < 32
    return step, cap


# --- kv-hit-low -------------------------------------------------------------------------


def test_kv_hit_low_cannot_work_when_no_prompt_shares_a_prefix(
    engine: InProcessEngine, db_url: str
) -> None:
    """No prompt shares a block with another: the only hits are requests the storm
    preempted finding their own blocks again when readmitted. The cap ends the storm
    and with it those hits: the hit ratio falls to about 0, judged worse, rolled back."""
    b = Bench(engine, db_url, "kvh-unique")
    loop = Loop(b)
    preempted = engine.collector.stats.preemptions
    loop.window()
    assert engine.collector.stats.preemptions > preempted  # the storm is on at the checks
    result = b.execute("kv-hit-low", loop)
    record = result.record
    assert (result.exit_code, record.status) == (1, "rolled_back"), record.error
    step, _ = capped(b, result)
    assert step.status == "reverted"
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"]) == ("kv_hit_ratio", WORSE)
    # Near 0, not always exactly: a request the storm preempted before the cap took
    # effect may be readmitted inside the after-window and hit its own blocks (0.0012
    # and 0.0015 seen, in 2 of 9 runs; where the executor thread lands is timing).
    assert 0 < v["before"] < 0.85 and v["after"] <= 0.01 < v["before"]
    # Half the sequences also serve the closed loop at about half the rate: the
    # latency guard trips as well, and the journal's error names it.
    guard = v["guards"]["engine_e2e_latency_p99"]
    assert guard["outcome"] == WORSE and guard["after"] > 1.1 * guard["before"]
    assert record.error == (
        "circuit breaker: guard engine_e2e_latency_p99 got worse ("
        f"{format_signal('engine_e2e_latency_p99', guard['before'])} → "
        f"{format_signal('engine_e2e_latency_p99', guard['after'])}) after the change; "
        "rolled back"
    )
    assert b.knobs() == STARTUP  # rolled back on the engine
    b.finish()


# --- batch-too-large ----------------------------------------------------------------------


def test_batch_too_large_cannot_work_when_no_prompt_shares_a_prefix(
    engine: InProcessEngine, db_url: str
) -> None:
    """Half the sequences serve the closed loop at half the rate: its P99 gets worse,
    and the verification rolls the cap back."""
    b = Bench(engine, db_url, "btl-unique")
    loop = Loop(b)
    loop.window()
    result = b.execute("batch-too-large", loop)
    record = result.record
    assert (result.exit_code, record.status) == (1, "rolled_back"), record.error
    step, _ = capped(b, result)
    assert step.status == "reverted"
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"]) == ("engine_e2e_latency_p99", WORSE)
    assert v["after"] > 1.1 * v["before"]
    assert record.error == (
        "circuit breaker: engine_e2e_latency_p99 got worse ("
        f"{format_signal('engine_e2e_latency_p99', v['before'])} → "
        f"{format_signal('engine_e2e_latency_p99', v['after'])}) after the change; rolled back"
    )
    assert b.knobs() == STARTUP
    b.finish()
