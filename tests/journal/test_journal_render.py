"""Reports and notifications: exact text, and the sandbox holding against untrusted input."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError
from vllm_runbook.runbooks.run.render import (
    format_table,
    render_notification,
    render_report,
    render_string,
)
from vllm_runbook.runbooks.store import Journal


@pytest.fixture
def finished(sqlite_url: str):  # type: ignore[no-untyped-def]
    store = Journal(sqlite_url)
    record, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="alice")
    store.transition(record.id, "running")
    store.record_checks(
        record.id,
        {
            "kv_usage": {"value": 0.97, "signal": "kv_cache_usage", "description": "KV"},
            "kv_capacity": {"value": 12, "signal": "kv_capacity_seqs", "description": "seqs"},
        },
    )
    step = store.add_step(
        record.id,
        "scale_max_num_batched_tokens",
        {"factor": 0.5},
        before={"max_num_batched_tokens": 512},
    )
    store.finish_step(step.id, "applied", after={"max_num_batched_tokens": 256})
    store.transition(record.id, "verifying")
    store.record_verification(
        record.id,
        {
            "signal": "preemptions_per_minute",
            "direction": "decrease",
            "deadline_seconds": 120,
            "before": 37.0,
            "after": 0.0,
            "outcome": "passed",
        },
    )
    result = store.transition(record.id, "succeeded")
    store.close()
    return result


def test_report_shows_checks_before_after_and_verification(finished) -> None:  # type: ignore[no-untyped-def]
    lines = render_report(finished).splitlines()
    assert lines[0] == "Execution #1: oom-pressure on llama-0: succeeded"
    assert lines[1] == "Triggered by cli (alice)"
    assert lines[lines.index("Checks") + 1 :][:3] == [
        "  check        value  signal            description",
        "  kv_usage     0.97   kv_cache_usage    KV",
        "  kv_capacity  12     kv_capacity_seqs  seqs",
    ]
    assert lines[lines.index("Steps") + 1 :][:2] == [
        "  #  action                        status   before → after                     error",
        "  1  scale_max_num_batched_tokens  applied  max_num_batched_tokens: 512 → 256  -",
    ]
    assert lines[lines.index("Verification") + 1] == (
        "  preemptions_per_minute: 37 → 0 (expected decrease within 120 s): passed"
    )
    assert not any("autopilot" in line for line in lines)


def test_report_says_where_the_autopilot_had_it(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    record, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="alice")
    store.transition(record.id, "running")
    step = store.add_step(
        record.id, "set_autopilot", {"enabled": True}, before={"autopilot": False}
    )
    store.finish_step(step.id, "applied", after={"autopilot": True})
    store.transition(record.id, "verifying")
    verification = {
        "signal": "preemptions_per_minute",
        "before": 37.0,
        "after": 0.0,
        "outcome": "improved",
        "autopilot": {"max_num_seqs": 10, "target": 0.9, "changes": {"up": 2, "down": 3}},
    }
    store.record_verification(record.id, verification)
    done = store.transition(record.id, "succeeded")
    store.close()
    lines = render_report(done).splitlines()
    assert (
        "  handed over to the autopilot: max_num_seqs 10 when judged (target peak KV usage 0.9)"
        in lines
    )
    assert lines[lines.index("Steps") + 2] == (
        "  1  set_autopilot  applied  autopilot: no → yes  -"
    )


def test_notification_keeps_untrusted_labels_literal(finished) -> None:  # type: ignore[no-untyped-def]
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    text = render_notification(
        finished,
        alert_name="VllmOOMPressure",
        labels={"instance": hostile, "job": "{% raw %}x{% endraw %}"},
        annotations={"summary": "{{ 7*7 }} blocks"},
    )
    assert text.splitlines() == [
        "[SUCCEEDED] oom-pressure on llama-0 (execution #1)",
        "Alert: VllmOOMPressure: {{ 7*7 }} blocks",
        "- scale_max_num_batched_tokens applied: max_num_batched_tokens: 512 → 256",
        f"Labels: instance={hostile}, job={{% raw %}}x{{% endraw %}}",
    ]


def test_sandbox_refuses_private_attributes() -> None:
    with pytest.raises(SecurityError):
        render_string("{{ ''.__class__.__mro__ }}")
    with pytest.raises(SecurityError):
        render_string("{{ labels.__class__ }}", labels={"a": "b"})
    with pytest.raises(SecurityError):
        render_string("{{ obj._secret }}", obj=type("O", (), {"_secret": "s"})())
    # Plain data renders.
    assert render_string("{{ labels.a }}", labels={"a": "b"}) == "b"


def test_format_table_aligns_columns() -> None:
    assert format_table([(1, None, 0.123456)], ["id", "x", "ratio"]) == (
        "id  x  ratio\n1   -  0.1235"
    )


def test_report_shows_unavailable_checks_guards_and_the_post_change_measurement(
    sqlite_url: str,
) -> None:
    store = Journal(sqlite_url)
    record, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="bob")
    store.transition(record.id, "running")
    store.record_checks(
        record.id,
        {
            "gpu": {
                "value": None,
                "signal": "gpu_memory_used_max",
                "description": "GPU memory",
                "unavailable": "no NVIDIA GPU on this engine (NVML not available)",
            }
        },
    )
    store.transition(record.id, "verifying")
    store.record_verification(
        record.id,
        {
            "signal": "preemptions_per_minute",
            "direction": "decrease",
            "needed": "preemptions_per_minute ≤ 20% of before",
            "deadline_seconds": 120,
            "from_step": 40,
            "measured_seconds": 60.0,
            "measurement": {"effective_step": 52},
            "trailing_window_after": 60.0,
            "before": 7.0,
            "after": 0.0,
            "outcome": "improved",
            "guards": {
                "oom_rate": {"before": 0.5, "after": 0.0, "outcome": "ok", "required": False},
                "error_rate": {
                    "before": None,
                    "after": None,
                    "outcome": "unavailable: before: no request finished in the last 60 s",
                    "required": False,
                },
            },
        },
    )
    shown = store.transition(record.id, "succeeded")
    store.close()
    lines = render_report(shown).splitlines()
    assert lines[lines.index("Checks") + 2] == (
        "  gpu    unavailable: no NVIDIA GPU on this engine (NVML not available)  "
        "gpu_memory_used_max  GPU memory"
    )
    at = lines.index("Verification")
    assert lines[at + 1 : at + 3] == [
        "  preemptions_per_minute: 7 → 0 (needed preemptions_per_minute ≤ 20% of before "
        "within 120 s): improved",
        "  measured from step 40 (in effect from step 52) over 60 s; a trailing window at the "
        "end read 60 (not used)",
    ]
    guards = lines[lines.index("Guards") + 1 :]
    assert guards[:3] == [
        "  guard       before  after  outcome",
        "  oom_rate    0.5     0      ok",
        "  error_rate  -       -      unavailable: before: no request finished in the last 60 s",
    ]
