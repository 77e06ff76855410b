"""The demo's engine, rules and runbook settings, and the files it writes from them.

Seconds where the shipped files say minutes: the story fits in a few minutes.
Everything comes from the installed package (the shipped runbook catalog, the
service's configuration format), nothing from a source checkout.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml
from vllm_runbook.runbooks.demo.servers import api_server_command

ENGINE_NAME = "cpu-0"
HIGH, LOW = 0, 10  # vLLM's priority: the lower value is served first

# The engine: 256 KV blocks of 32 tokens (8192 tokens) for 16 sequences.
BLOCK_SIZE, KV_BLOCKS, MAX_NUM_SEQS, BUDGET, MAX_MODEL_LEN = 32, 256, 16, 512, 1024
# The collector's sliding windows (hit ratio, preemption rate): short for a short story.
COLLECTOR_WINDOW_S = 15

# Rules: the seed thresholds, windows and `for` durations in seconds.
EVALUATION_INTERVAL = "2s"
# The starved requests wait minutes unless fixed; in the long burst (with the
# autopilot holding max_num_seqs down) a queued request waited up to ~30 s on a
# loaded machine: the threshold stays above that.
STARVATION_THRESHOLD_S = 45
RULE_OVERRIDES: dict[str, dict[str, object]] = {
    # A window long enough that the finding resolves after the burst, not
    # between the fix and the end of the burst (the revert would bring it back).
    "VllmOOMPressure": {"for": "5s", "window": "45s"},
    "VllmRequestStarvation": {"threshold_seconds": STARVATION_THRESHOLD_S, "for": "2s"},
}
# Runbooks: the shipped ones with waits and periods shortened to fit the story.
RUNBOOK_TIMINGS: dict[str, dict[str, Any]] = {
    "oom-pressure": {
        "when_after_seconds": 10,  # shipped: 30
        "verification.deadline_seconds": 40,  # shipped: 120
        "revert.healthy_period_seconds": 8,  # shipped: 600
        "revert.hold_seconds": 4,  # shipped: 120
    },
    # latency-spike's verification as shipped: its deadline follows the
    # engine's drain rate (what the judgement needs), and it ends once the
    # starved requests got in. Its hold as shipped but shorter: the switch
    # stays while anything waits over 2 s, then 6 s more.
    "latency-spike": {"revert.hold_seconds": 6},  # shipped: 120
}

# Phase lengths (seconds): each phase runs until its event happened (and a
# little after); these are the bounds past which the story fails and says
# what the phase measured. On a 2-core machine the story takes 4-6 min.
STEADY_S = 20
BURST_AFTER_FIX_S, BURST_MAX_S = 8, 150
# After the burst, steady traffic until oom-pressure's changes are restored
# (its finding resolves, the service reverts stepwise). The next phase's load
# must not meet a revert half-way: its circuit breaker would halt it, rightly.
SETTLE_MAX_S = 90
# The starvation phase: the threshold, `for` and one evaluation after the low
# ones arrive, the switch, the low ones served, then a few seconds of FCFS.
STARVATION_AFTER_FIX_S, STARVATION_MAX_S = 10, 240
# Then the high-priority stream goes on: the finding resolves (the switch
# works) while its cause lasts, and the switch must hold. The stream ends once
# the execution was seen holding this long (or after the bound, said so). The
# bound: under FCFS the finding resolves once the queue ahead of its oldest
# request drains below the threshold; a CI run switched with 536 queued and
# half the rate after it (9.4 -> 4.6 req/s), and 90 s were too few.
STREAM_HOLDING_S, STREAM_MAX_S = 10, 150
RECOVERY_MIN_S, RECOVERY_MAX_S = 12, 90
STORY_DEADLINE_S = 720  # from the start, including engine start-up


def engine_command(model: Path, port: int) -> list[str]:
    return api_server_command(
        model,
        port,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        num_gpu_blocks_override=KV_BLOCKS,
        scheduling_policy="priority",
        enable_prefix_caching=True,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
    )


def write_runbooks(directory: Path) -> Path:
    """The shipped runbook catalog with the demo's timings (RUNBOOK_TIMINGS)."""
    from vllm_runbook.runbooks.model.spec import CATALOG_DIR

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for source in sorted(CATALOG_DIR.glob("*.yaml")):
        doc = yaml.safe_load(source.read_text(encoding="utf-8"))
        for key, value in RUNBOOK_TIMINGS.get(doc["name"], {}).items():
            if key == "when_after_seconds":
                for step in doc["steps"]:
                    if "when" in step:
                        step["when"]["after_seconds"] = value
            else:
                section, _, name = key.partition(".")
                doc[section][name] = value
        (directory / source.name).write_text(
            f"# {source.name} with the demo's timings (`runbook demo`)\n"
            + yaml.safe_dump(doc, sort_keys=False),
            encoding="utf-8",
        )
    return directory


def write_config(path: Path, db_url: str, agent: str, api: str) -> Path:
    config = {
        "database": db_url,
        "engines": [{"name": ENGINE_NAME, "agent": agent, "vllm": api}],
        "rules": {"evaluation_interval": EVALUATION_INTERVAL, "overrides": RULE_OVERRIDES},
        "automation": {"oom-pressure": "auto", "latency-spike": "auto", "default": "notify"},
    }
    path.write_text(
        "# runbook serve's configuration for the demo (`runbook demo`)\n"
        + yaml.safe_dump(config, sort_keys=False),
        encoding="utf-8",
    )
    return path
