"""The agent's wire format (collector/agent_api.py): one set of models for both
sides, and the JSON Schema in docs/ that describes exactly what they send."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError
from vllm_runbook.collector import agent_api as api
from vllm_runbook.collector.state import STAT_KEYS

from tests.fake_agent import FakeAgent, agent_state

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "docs" / "agent-api.schema.json").read_text()
)


def schema_of(model: str) -> dict[str, Any]:
    return {"$ref": f"#/$defs/{model}", "$defs": SCHEMA["$defs"]}


def test_stats_declare_every_collector_series_and_the_windowed_outcomes() -> None:
    # Each unlabelled gauge and counter of the collector is a stat, under its series name.
    windowed = {
        "preemptions_per_minute",
        "admitted_before_time",
        "starving_waiting",
        "admitted_per_second",
        "stall_reason",  # engine_stall_reason's label: not an unlabelled series
        "window_seconds",
        "requests_finished",
        "finished_by_reason",
        "error_rate",
        "engine_e2e_latency_p99",
        "engine_queue_time_p99",
        "requests_finished_by_reason_total",
        "block_fragmentation_at_block_size",
    }
    assert set(STAT_KEYS.values()) | windowed == set(api.Stats.model_fields)
    assert not set(STAT_KEYS.values()) & windowed


def test_what_the_models_send_fits_the_published_schema() -> None:
    agent = FakeAgent()
    state = agent.state(since_step=101).model_dump(mode="json")
    jsonschema.validate(state, schema_of("AgentState"))
    change = agent.set_knobs(dry_run=True, max_num_seqs=8).model_dump(mode="json")
    jsonschema.validate(change, schema_of("ChangeResult"))
    command = api.KnobsCommand(max_num_seqs=8, policy="fcfs").model_dump(mode="json")
    jsonschema.validate(command, schema_of("KnobsCommand"))
    refusal = api.ErrorAnswer(error="x", knob="max_num_seqs", value=64, bound=32)
    jsonschema.validate(
        refusal.model_dump(mode="json", exclude_none=True), schema_of("ErrorAnswer")
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"policy": "lifo"}, schema_of("KnobsCommand"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"dry_run": False, "max_num_seqs": 2}, schema_of("RestoreCommand"))


def test_answers_ignore_unknown_fields_commands_refuse_them() -> None:
    state = agent_state().model_dump(mode="json")
    newer = {**state, "from_a_newer_agent": 1, "knobs": {**state["knobs"], "new_knob": 2}}
    assert api.AgentState.model_validate(newer) == api.AgentState.model_validate(state)
    with pytest.raises(ValidationError) as refused:
        api.KnobsCommand.model_validate({"max_num_seqs": 2, "max_num_sequences": 3})
    assert api.command_error(refused.value) == "unknown field(s): max_num_sequences"


def test_a_command_keeps_only_the_knobs_asked_for() -> None:
    command = api.KnobsCommand.model_validate(
        {"autopilot": "off", "autopilot_target": 1, "max_num_seqs": None, "dry_run": True}
    )
    assert command.values() == {"autopilot": False, "autopilot_target": 1.0}
    assert (command.clamp, command.dry_run) == (False, True)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_num_seqs": 2.0}, "max_num_seqs must be an integer, got 2.0"),
        ({"max_num_seqs": 2, "dry_run": "yes"}, "dry_run must be true or false"),
        ({"scale_max_num_batched_tokens": True}, "scale_max_num_batched_tokens must be a number"),
        ({"autopilot_target": float("nan")}, r"autopilot_target must be in (0, 1], got nan"),
        ("max_num_seqs=2", "request body must be a JSON object"),
    ],
)
def test_each_refusal_is_one_line(body: Any, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        api.KnobsCommand.model_validate(body)
    text = api.command_error(refused.value)
    assert text.startswith(message) and "\n" not in text


def test_the_first_departure_of_an_answer_is_named() -> None:
    state = agent_state().model_dump(mode="json")
    del state["stats"]["kv_blocks_free"]
    with pytest.raises(ValidationError) as wrong:
        api.AgentState.model_validate(state)
    assert api.answer_error(wrong.value) == "stats.kv_blocks_free: Field required"
