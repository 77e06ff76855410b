"""The on-call page in a real browser (Debian's chromium, headless, driven by
selenium through Debian's chromium-driver), all on loopback: a vLLM CPU engine
served with the plugin, `runbook serve` with oom-pressure in `approve` mode,
an Alertmanager delivery that leaves the execution awaiting approval. The page
shows it; a click on Approve makes the service run it on the engine, which
preempts nothing: the run is refused before any change with "nothing to
improve" (no failure); the page then shows that as the journal has it, and
the configured webhook receiver got every event of it (the service's
notifier). Screenshots go to artifacts/oncall-page/ (the docs' images are
copies of these)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engines import REPO_ROOT, ServedEngine, http_get
from tests.service.chromium import chromium, wait_until
from tests.service.processes import RunbookServe
from tests.service.test_service_notify import Hooks
from tests.service.test_service_webhooks import payload

pytestmark = [pytest.mark.engine, pytest.mark.served]

TOKEN = "page-webhook-token"
ARTIFACTS = REPO_ROOT / "artifacts" / "oncall-page"
FINAL = ("succeeded", "failed", "rolled_back", "refused")


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def deliver(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/webhooks/alertmanager",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


def test_approve_from_the_page_and_the_page_shows_what_the_run_did(
    tiny_model: Path, tmp_path: Path, browser: Any
) -> None:
    hooks = Hooks()
    try:
        run_page_test(tiny_model, tmp_path, browser, hooks)
    finally:
        hooks.close()


def run_page_test(tiny_model: Path, tmp_path: Path, browser: Any, hooks: Hooks) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (tmp_path / "webhook.token").write_text(TOKEN + "\n")
    with ServedEngine.run(tiny_model, tmp_path / "engine.log") as served:
        instance = served.api_url.removeprefix("http://")
        config = {
            "database": f"sqlite:///{tmp_path / 'runbook.db'}",
            "engines": [
                {"name": "cpu-0", "agent": served.agent_url, "labels": {"instance": instance}}
            ],
            "automation": {"oom-pressure": "approve"},
            "webhook": {"token_file": str(tmp_path / "webhook.token")},
            "approvals": {"timeout": "10m"},
            "notifications": {
                "receivers": [{"name": "ops", "type": "webhook", "url": hooks.url + "/ok"}],
                "retries": 0,
            },
            "executor": {"verify_seconds": "2s", "condition_seconds": "1s"},
        }
        cfg = tmp_path / "runbook.yaml"
        cfg.write_text(yaml.safe_dump(config))
        with RunbookServe.run(cfg, tmp_path / "serve.log", "--no-rules") as svc:
            body = payload()
            labels = {**body["alerts"][0]["labels"], "instance": instance}
            body["alerts"][0]["labels"] = body["commonLabels"] = labels
            [created] = deliver(svc.url, body)["executions"]
            assert created["mode"] == "approve"
            [waiting] = svc.get("/api/pending")
            ex = waiting["id"]

            browser.get(svc.url + "/")
            assert browser.title == "vllm-runbook on call"
            row = browser.find_element(By.ID, f"pending-{ex}")
            assert "oom-pressure" in row.text and served.agent_url in row.text
            assert browser.find_element(By.ID, f"status-{ex}").text == "pending"
            browser.save_screenshot(str(ARTIFACTS / "oncall-page-pending.png"))

            # On loopback nobody is authenticated: the page says so, the journal records it.
            assert browser.find_element(By.ID, "as-of").text.endswith(
                "answers are recorded as anonymous (loopback)"
            )
            row.find_element(By.NAME, "note").send_keys("KV cache full, go")
            browser.find_element(By.ID, f"approve-{ex}").click()

            # The click returns before the answer's page has loaded: wait for it.
            def answer() -> str | None:
                try:
                    return next((m.text for m in browser.find_elements(By.ID, "message")), None)
                except StaleElementReferenceException:  # the old page went mid-read
                    return None

            message = wait_until("the page's answer", answer, 30)
            assert message == (
                f"execution #{ex} (oom-pressure on {served.agent_url}) approved by "
                "anonymous (loopback); "
                "the service runs it"
            )

            def final() -> dict[str, Any] | None:
                [record] = svc.get("/api/executions")
                return record if record["status"] in FINAL else None

            record = wait_until("the approved execution finishes", final, 180)
            assert record["decided_by"] == "anonymous (loopback)"
            assert record["decision_note"] == "KV cache full, go"
            # The engine preempts nothing: there is nothing to fix, so the approved
            # run is refused before any change, and that is no failure.
            assert (record["status"], record["display_status"]) == (
                "refused",
                "nothing to improve",
            )
            assert record["reason"] == (
                "nothing to improve: preemptions_per_minute = 0, the runbook acts only if "
                "preemptions_per_minute > 0"
            )
            assert (record["steps"], record["verification"], record["error"]) == ([], None, None)
            status, state = http_get(served.agent_url + "/v1/state")
            assert status == 200
            assert json.loads(state)["knobs"]["max_num_batched_tokens"] == 512  # untouched

            browser.get(svc.url + "/")
            status_badge = browser.find_element(By.ID, f"status-{ex}")
            assert status_badge.text == "nothing to improve"
            assert "nothing_to_improve" in (status_badge.get_attribute("class") or "")
            assert browser.find_elements(By.ID, f"pending-{ex}") == []
            block = browser.find_element(By.ID, f"execution-{ex}").text
            assert "approved by anonymous (loopback) at " in block
            assert "KV cache full, go" in block
            assert record["reason"] in block
            engine_link = browser.find_element(By.CSS_SELECTOR, f"#execution-{ex} a")
            assert engine_link.get_attribute("href") == served.agent_url + "/v1/state"
            browser.save_screenshot(str(ARTIFACTS / "oncall-page-result.png"))

            events = ["awaiting approval", "nothing to improve"]
            wait_until("the receiver has every event", lambda: hooks.events("/ok") == events, 60)
            assert [b["execution_id"] for b in hooks.bodies["/ok"]] == [ex, ex]
