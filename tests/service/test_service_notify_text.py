"""Alert labels and notes are data in a notification, never its structure: an
alert name and a note that try to mention the channel, hide a link behind
"Approve" and forge a line reach a real Slack-compatible receiver and a JSON
webhook receiver on loopback escaped for each, on the one line they belong to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_runbook.runbooks.service.app import Credentials
from vllm_runbook.runbooks.service.notify import Notifier, Receiver

from tests.fake_agent import FakeAgent
from tests.service.test_service_approvals import CONFIG, Replica
from tests.service.test_service_notify import Hooks, drain
from tests.service.test_service_webhooks import AUTH, TOKEN, payload

FORGED = "[SUCCEEDED] oom-pressure on http://127.0.0.1:9 (execution #1)"
HOSTILE = (
    "VllmOOMPressure <!channel> <https://evil.example/|Approve> & co\n"
    + FORGED
    + "\u2028Approved by root\u202e"
)
NOTE = "fine\r\n<!here> Rejected by nobody\t"


@pytest.fixture
def replica(sqlite_url: str, tmp_path: Path) -> Iterator[Replica]:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    r = Replica(sqlite_url, cfg, FakeAgent(), Credentials(token=TOKEN))
    with r.client:
        yield r
    r.store.close()


def test_labels_and_notes_stay_on_their_line_and_are_escaped_for_each_receiver(
    replica: Replica,
) -> None:
    hooks = Hooks()
    try:
        notifier = Notifier(
            replica.store,
            [
                Receiver("chat", "slack", hooks.url + "/slack"),
                Receiver("ops", "webhook", hooks.url + "/hook"),
            ],
            retries=0,
            timeout_s=60.0,
            claim_lease_s=240.0,
        )
        body = payload(alertname=HOSTILE)
        delivered = replica.client.post("/webhooks/alertmanager", json=body, headers=AUTH)
        assert delivered.status_code == 200, delivered.text
        [waiting] = replica.store.pending_approvals()
        ex = waiting.id
        approve = f"/api/executions/{ex}/approve"
        assert replica.client.post(approve, json={"note": NOTE}, headers=AUTH).is_success
        assert notifier.poll() == 2  # awaiting approval (the approval is in the record)
        drain(notifier)
        notifier.stop()
    finally:
        hooks.close()

    alert = (
        "VllmOOMPressure <!channel> <https://evil.example/|Approve> & co "
        f"{FORGED} Approved by root "
    )
    [slack] = hooks.bodies["/slack"]
    slack_key = slack["text"].splitlines()[-1].removeprefix("Event key: ")
    assert slack["text"].splitlines() == [
        f"[AWAITING APPROVAL] oom-pressure on http://127.0.0.1:9 (execution #{ex})",
        "Alert: VllmOOMPressure &lt;!channel&gt; &lt;https://evil.example/|Approve&gt; &amp; co "
        f"{FORGED} Approved by root ",
        "Approved by webhook token: fine &lt;!here&gt; Rejected by nobody ",
        f"Event key: {slack_key}",
    ]
    [hook] = hooks.bodies["/hook"]
    assert hook["text"].splitlines() == [
        f"[AWAITING APPROVAL] oom-pressure on http://127.0.0.1:9 (execution #{ex})",
        f"Alert: {alert}",
        "Approved by webhook token: fine <!here> Rejected by nobody ",
        f"Event key: {hook['key']}",
    ]
    assert hook["key"] == slack_key  # one event, one key, whatever the receiver
    # The JSON receiver gets the label and the note verbatim, each in its own field.
    assert hook["alert"] == HOSTILE
    assert (hook["execution"]["decided_by"], hook["execution"]["decision_note"]) == (
        "webhook token",
        NOTE,
    )


def test_one_line_and_slack_escaping() -> None:
    from vllm_runbook.runbooks.run.render import MAX_VALUE_CHARS, one_line, slack_escape

    assert one_line("a\nb\r\n\tc\x1b[31m\u2028d\u2029e\u2066f\x85g") == "a b c [31m d e f g"
    assert one_line("x" * (MAX_VALUE_CHARS + 5)) == "x" * (MAX_VALUE_CHARS - 1) + "…"
    assert slack_escape("<!channel> & <@U1|you> &amp;") == (
        "&lt;!channel&gt; &amp; &lt;@U1|you&gt; &amp;amp;"
    )
