"""`runbook check`'s configuration checks against real CPU engines started with good
and with bad settings, after a workload whose lengths are known.

Good: block size 32 (the smallest vLLM takes on the CPU), budget 2048 (the
reports' safe threshold), chunked prefill on, fcfs for a chat mix of
100-300-token prompts (P90/P10 under 4:1), and still fcfs once prompts of 40
and 400 tokens spread it 10:1 with never more than 11 requests at once (the
reports' hybrid gain shows above 20). Bad: block size 128 for the same short
prompts, a budget of 16,384 (vLLM requires one at least max_model_len without
chunked prefill), chunked prefill off while a 9,000-token prompt arrives, fcfs
for prompts of 40 and 400 tokens (10:1) with all 21 requests in the engine at
once. On the CPU the memory headroom, the SM count and the hardware are n/a, and say
why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engines import InProcessEngine, runbook_cli

pytestmark = pytest.mark.engine

CHAT = [100 + 10 * i for i in range(21)]  # 100 ... 300 tokens


def check(engine: InProcessEngine) -> tuple[int, dict[str, dict[str, Any]], str]:
    url = str(engine.collector.server.url)
    done = runbook_cli("check", "--engine", url, "--interval", "0.2", "--json", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    return done.returncode, {c["name"]: c for c in report["checks"]}, done.stdout


def serve(engine: InProcessEngine, prompts: list[int], at_once: int | None = None) -> None:
    """Each prompt for 8 tokens, `at_once` requests in the engine at a time (all: None)."""
    batch = at_once or len(prompts)
    for start in range(0, len(prompts), batch):
        for i, n in enumerate(prompts[start : start + batch], start):
            engine.add(f"p{engine.collector.stats.steps}-{i}", n, max_tokens=8, offset=41 * i)
        engine.run_until_done()


def statuses(checks: dict[str, dict[str, Any]]) -> dict[str, str]:
    names = (
        "token budget",
        "block size",
        "chunked prefill",
        "memory headroom",
        "max_num_seqs",
        "scheduling policy",
        "hardware",
    )
    return {n: checks[n]["status"] for n in names}


def test_an_engine_started_with_the_reports_settings_passes_them(tiny_model: Path) -> None:
    engine = InProcessEngine.start(
        tiny_model, block_size=32, max_num_batched_tokens=2048, enable_chunked_prefill=True
    )
    try:
        serve(engine, CHAT, at_once=11)
        code, checks, out = check(engine)
        # Then prompts of 40 and 400 tokens (10:1 with the chat's), never more than 11
        # requests at once: under the reports' 20, tiering is not advised.
        serve(engine, [40, 400] * 5, at_once=10)
        _, spread, spread_out = check(engine)
    finally:
        engine.close()
    policy = spread["scheduling policy"]
    assert (policy["status"], policy["shown"]) == ("pass", "fcfs (10.0:1)"), spread_out
    assert policy["note"].startswith(
        "lengths spread 4:1 or more, but at most 11 requests in the engine at once"
    )
    assert statuses(checks) == {
        "token budget": "pass",
        "block size": "pass",
        "chunked prefill": "pass",
        "memory headroom": "n/a",
        "max_num_seqs": "n/a",
        "scheduling policy": "pass",
        "hardware": "n/a",
    }, out
    assert checks["token budget"]["value"] == 2048
    assert checks["block size"]["value"] == 32
    assert "this mix (P50 prompt" in checks["block size"]["note"]
    assert "on CPU vLLM takes multiples of 32 only" in checks["block size"]["note"]
    assert checks["memory headroom"]["note"].startswith("CPU engine:")
    assert checks["hardware"]["note"] == (
        "CPU engine: no GPU, no compute capability or PCIe link to judge"
    )
    assert checks["scheduling policy"]["shown"].startswith("fcfs (")
    assert checks["scheduling policy"]["value"] < 4
    assert code == 0, out


def test_an_engine_started_against_the_reports_warns_and_fails(tiny_model: Path) -> None:
    engine = InProcessEngine.start(
        tiny_model,
        block_size=128,
        max_model_len=16_384,
        max_num_batched_tokens=16_384,
        enable_chunked_prefill=False,
        num_gpu_blocks_override=160,  # 20,480 tokens: one max_model_len request fits
        hf_overrides={"max_position_embeddings": 16_384},
    )
    try:
        serve(engine, [40] * 10 + [400] * 10 + [9_000])
        code, checks, out = check(engine)
    finally:
        engine.close()
    assert statuses(checks) == {
        "token budget": "warn",
        "block size": "warn",
        "chunked prefill": "fail",
        "memory headroom": "n/a",
        "max_num_seqs": "n/a",
        "scheduling policy": "warn",
        "hardware": "n/a",
    }, out
    assert checks["token budget"]["value"] == 16_384
    assert "safe threshold 2048" in checks["token budget"]["note"]
    assert checks["block size"]["value"] == 128
    assert "restart to change" in checks["block size"]["note"]
    assert checks["chunked prefill"]["note"].startswith("4.8% of prompts are above 8192 tokens")
    assert checks["scheduling policy"]["shown"] == "fcfs (10.0:1)"
    # All 21 requests in the engine at once: above the reports' 20, tiered is advised.
    assert "at most 21 requests in the engine at once" in checks["scheduling policy"]["note"]
    assert code == 1, out  # a fail fails `runbook check`
