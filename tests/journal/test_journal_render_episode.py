"""A check's value now beside the episode's peak and mean, as the report, a
notification and the on-call page show them (exact text)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_runbook.runbooks.engine.sources import NO_EPISODE
from vllm_runbook.runbooks.run.render import render_notification, render_report
from vllm_runbook.runbooks.service import page
from vllm_runbook.runbooks.store import ExecutionRecord, Journal

SPAN = {"seconds": 420.0, "samples": 95}
# oom-pressure's checks read in the gap between two waves of a burst.
GAP_CHECKS: dict[str, Any] = {
    "max_sequence_tokens": {
        "signal": "max_sequence_tokens",
        "description": "Longest context in the running batch",
        "value": 0,
        "episode": {"peak": 812.0, "mean": 430.5, **SPAN},
    },
    "kv_usage": {
        "signal": "kv_cache_usage",
        "description": "KV cache usage",
        "value": 0.0,
        "episode": {"peak": 0.97, "mean": 0.61, **SPAN},
    },
    "preemption_rate": {
        "signal": "preemptions_per_minute",
        "description": "Preemptions per minute",
        "value": 12.0,
    },
    "kv_capacity": {
        "signal": "kv_capacity_seqs",
        "description": "Sequences the KV cache holds",
        "value": None,
        "unavailable": "no request running: no KV footprint to scale",
        "episode": {"peak": 24.0, "mean": 19.5, **SPAN},
    },
}


def recorded(store: Journal, checks: dict[str, Any]) -> ExecutionRecord:
    record, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="alice")
    store.record_checks(record.id, checks)
    return store.transition(record.id, "refused", reason="nothing to improve")


@pytest.fixture
def gap(sqlite_url: str) -> Any:
    store = Journal(sqlite_url)
    yield store, recorded(store, GAP_CHECKS)
    store.close()


def test_the_report_shows_now_peak_and_mean(gap: Any) -> None:
    _, record = gap
    lines = render_report(record).splitlines()
    at = lines.index("Checks")
    pad = " " * 56  # the now column is as wide as kv_capacity's reason
    assert lines[at + 1 : at + 7] == [
        f"  check                now{pad}peak  mean   signal                  description",
        f"  max_sequence_tokens  0  {pad}812   430.5  max_sequence_tokens     "
        "Longest context in the running batch",
        f"  kv_usage             0  {pad}0.97  0.61   kv_cache_usage          KV cache usage",
        f"  preemption_rate      12 {pad}-     -      preemptions_per_minute  "
        "Preemptions per minute",
        "  kv_capacity          unavailable: no request running: no KV footprint to scale  "
        "24    19.5   kv_capacity_seqs        Sequences the KV cache holds",
        "  peak and mean over 420 s of the finding's episode "
        "(one-second samples while the engine steps)",
    ]


def test_the_notification_lists_each_check_with_its_episode(gap: Any) -> None:
    _, record = gap
    lines = render_notification(record, alert_name="VllmOOMPressure").splitlines()
    at = lines.index("Checks:")
    assert lines[at + 1 : at + 5] == [
        "  max_sequence_tokens: 0 now; peak 812, mean 430.5 over 420 s",
        "  kv_usage: 0 now; peak 0.97, mean 0.61 over 420 s",
        "  preemption_rate: 12",
        "  kv_capacity: unavailable now: no request running: no KV footprint to scale; "
        "peak 24, mean 19.5 over 420 s",
    ]


def test_an_older_agent_is_said_not_hidden(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    checks = {
        "kv_usage": {"signal": "kv_cache_usage", "value": 0.0, "episode_unavailable": NO_EPISODE},
        "running": {
            "signal": "requests_running",
            "value": 0,
            "episode_unavailable": NO_EPISODE,
        },
    }
    record = recorded(store, checks)
    store.close()
    lines = render_report(record).splitlines()
    assert f"  peak/mean unavailable for kv_usage, running: {NO_EPISODE}" in lines
    text = render_notification(record)
    assert f"  running: 0 now; peak/mean unavailable: {NO_EPISODE}" in text.splitlines()


def test_a_journal_from_before_the_episode_keeps_its_plain_table(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    record = recorded(store, {"kv_usage": {"signal": "kv_cache_usage", "value": 0.97}})
    store.close()
    lines = render_report(record).splitlines()
    assert lines[lines.index("Checks") + 1].split() == ["check", "value", "signal", "description"]
    assert "Checks:" not in render_notification(record).splitlines()


def test_the_page_shows_now_peak_and_mean(gap: Any) -> None:
    store, _ = gap
    html = (
        page._environment()
        .get_template(page.PAGE_TEMPLATE)
        .render(message=None, token="t", answer_as=None, **page._view(store, 60.0))
    )
    assert "<th>now</th><th>peak</th><th>mean</th>" in html
    assert (
        "<tr><td>max_sequence_tokens</td><td>max_sequence_tokens</td><td>0</td>"
        "<td>812</td><td>430.5</td></tr>"
    ) in html
    assert (
        "<tr><td>kv_capacity</td><td>kv_capacity_seqs</td>"
        "<td>unavailable: no request running: no KV footprint to scale</td>"
        "<td>24</td><td>19.5</td></tr>"
    ) in html
    assert "peak and mean over 420 s of the finding's episode" in html
