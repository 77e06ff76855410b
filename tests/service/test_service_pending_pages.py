"""A backlog of approvals stays a bounded page: `GET /` and `/api/pending` page
through 10,000 executions awaiting approval, newest first, with the count of the
rest and filters by engine and runbook (on SQLite and PostgreSQL)."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import insert
from vllm_runbook.runbooks.service.app import PENDING_API_DEFAULT, PENDING_API_MAX
from vllm_runbook.runbooks.service.page import PENDING_PAGE
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import (
    ApprovalState,
    Execution,
    ExecutionStatus,
    episode_key,
    utcnow,
)

from tests.service.test_service_webhooks import AUTH, make_client

ENGINES = [f"http://10.0.0.{i}:9000" for i in range(1, 5)]
RUNBOOKS = ["latency-spike", "oom-pressure", "kv-thrash"]
BACKLOG = 10_000


def bulk_awaiting(url: str) -> dict[tuple[str, str], list[int]]:
    """BACKLOG executions awaiting approval, in one insert; their ids by (engine, runbook)."""
    pairs = list(product(ENGINES, RUNBOOKS))
    now = utcnow()
    rows = [
        {
            "runbook": pairs[i % len(pairs)][1],
            "engine": pairs[i % len(pairs)][0],
            "trigger": "alert",
            "who": "alertmanager",
            "alert_fingerprint": f"fp-{i}",
            "alert_starts_at": now,
            "episode_key": episode_key(
                pairs[i % len(pairs)][1], pairs[i % len(pairs)][0], f"fp-{i}", now
            ),
            "status": ExecutionStatus.PENDING,
            "reason": ApprovalState.AWAITING,
            "created_at": now,
            "updated_at": now,
        }
        for i in range(BACKLOG)
    ]
    store = Journal(url)
    try:
        with store.session(write=True) as s:
            s.execute(insert(Execution), rows)
        ids: dict[tuple[str, str], list[int]] = {}
        for record in store.pending_approvals():
            ids.setdefault((record.engine, record.runbook), []).append(record.id)
    finally:
        store.close()
    assert sum(len(v) for v in ids.values()) == BACKLOG
    return ids


def shown(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr id="pending-(\d+)">', html)]


def test_the_page_and_the_api_page_through_a_backlog(db_url: str, tmp_path: Path) -> None:
    ids = bulk_awaiting(db_url)
    every = sorted((i for v in ids.values() for i in v), reverse=True)
    client: TestClient = make_client(db_url, tmp_path)

    # The page: the newest PENDING_PAGE, the total, how many older, a link on.
    r = client.get("/")
    assert r.status_code == 200
    assert len(r.content) < 200_000  # 7.2 MB before it was paged
    assert shown(r.text) == every[:PENDING_PAGE]
    assert f"Awaiting approval ({BACKLOG})" in r.text
    rest = BACKLOG - PENDING_PAGE
    assert f"newest {PENDING_PAGE} shown; {rest} older" in r.text
    following = re.search(r'<a href="([^"]+)" id="pending-next">', r.text)
    assert following is not None
    r = client.get(following.group(1).replace("&amp;", "&"))
    assert shown(r.text) == every[PENDING_PAGE : 2 * PENDING_PAGE]
    assert f"{rest - PENDING_PAGE} older" in r.text

    # Filtered by engine and runbook: that pair's newest, its count.
    engine, runbook = ENGINES[2], RUNBOOKS[1]
    mine = sorted(ids[(engine, runbook)], reverse=True)
    r = client.get("/", params={"engine": engine, "runbook": runbook})
    assert shown(r.text) == mine[:PENDING_PAGE]
    assert f"Awaiting approval ({len(mine)}: engine {engine}, runbook {runbook})" in r.text
    assert f"{len(mine) - PENDING_PAGE} older" in r.text
    # The refresh keeps the filters.
    assert 'url=/?engine=http%3A%2F%2F10.0.0.3%3A9000&amp;runbook=oom-pressure"' in r.text

    # The API: the same order, X-Total-Count and X-Rest-Count, a Link to the next page.
    r = client.get("/api/pending", headers=AUTH)
    assert [e["id"] for e in r.json()] == every[:PENDING_API_DEFAULT]
    assert r.headers["x-total-count"] == str(BACKLOG)
    assert r.headers["x-rest-count"] == str(BACKLOG - PENDING_API_DEFAULT)
    link = f"</api/pending?limit={PENDING_API_DEFAULT}&before={every[PENDING_API_DEFAULT - 1]}>"
    assert r.headers["link"] == link + '; rel="next"'
    assert len(r.content) < 200_000  # 5.7 MB before
    r = client.get("/api/pending", params={"limit": 100_000}, headers=AUTH)
    assert [e["id"] for e in r.json()] == every[:PENDING_API_MAX]
    params = {"engine": engine, "runbook": runbook, "limit": 10, "before": mine[9]}
    r = client.get("/api/pending", params=params, headers=AUTH)
    assert [e["id"] for e in r.json()] == mine[10:20]
    assert r.headers["x-total-count"] == str(len(mine))
    assert r.headers["x-rest-count"] == str(len(mine) - 20)
    r = client.get("/api/pending", params={"engine": ENGINES[0]}, headers=AUTH)
    by_engine = sum(len(v) for (e, _), v in ids.items() if e == ENGINES[0])
    assert r.headers["x-total-count"] == str(by_engine)
    assert {e["engine"] for e in r.json()} == {ENGINES[0]}
    # The last page: no rest, no link.
    r = client.get("/api/pending", params={"before": every[-3]}, headers=AUTH)
    assert [e["id"] for e in r.json()] == every[-2:]
    assert r.headers["x-rest-count"] == "0" and "link" not in r.headers


def test_the_backlog_pages_in_a_real_browser(sqlite_url: str, tmp_path: Path) -> None:
    """The paged page as the on-call sees it: headless chromium on `runbook serve`
    (SQLite, no worker) holding the 10,000 executions: the newest page, a click
    on "next page", the filter form; screenshots in the test's tmp dir."""
    import yaml
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from tests.service.chromium import chromium, wait_until
    from tests.service.processes import RunbookServe

    db = sqlite_url
    ids = bulk_awaiting(db)
    every = sorted((i for v in ids.values() for i in v), reverse=True)
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "database": db,
                "engines": [{"name": f"e{i}", "agent": url} for i, url in enumerate(ENGINES)],
                "automation": {"oom-pressure": "approve"},
            }
        )
    )

    def rows(browser: Any) -> list[int]:
        try:
            found = browser.find_elements(By.CSS_SELECTOR, "tr[id^='pending-']")
            return [int(r.get_attribute("id").removeprefix("pending-")) for r in found]
        except StaleElementReferenceException:  # the old page went mid-read
            return []

    with (
        RunbookServe.run(cfg, tmp_path / "serve.log", "--no-rules", "--no-worker") as svc,
        chromium() as browser,
    ):
        browser.get(svc.url + "/")
        assert rows(browser) == every[:PENDING_PAGE]
        heading = browser.find_element(By.ID, "pending").text
        assert heading == f"Awaiting approval ({BACKLOG})"
        rest = browser.find_element(By.ID, "pending-rest").text
        assert rest == f"newest {PENDING_PAGE} shown; {BACKLOG - PENDING_PAGE} older: next page"
        browser.save_screenshot(str(tmp_path / "backlog-first.png"))

        browser.find_element(By.ID, "pending-next").click()
        second = every[PENDING_PAGE : 2 * PENDING_PAGE]
        wait_until("the next page", lambda: rows(browser) == second or None, 30)
        rest = browser.find_element(By.ID, "pending-rest").text
        assert rest.startswith(f"newest {PENDING_PAGE} shown; {BACKLOG - 2 * PENDING_PAGE} older")

        engine, runbook = ENGINES[2], RUNBOOKS[1]
        mine = sorted(ids[(engine, runbook)], reverse=True)
        Select(browser.find_element(By.ID, "filter-engine")).select_by_value(engine)
        Select(browser.find_element(By.ID, "filter-runbook")).select_by_value(runbook)
        browser.find_element(By.ID, "filter-apply").click()
        wait_until("the filtered page", lambda: rows(browser) == mine[:PENDING_PAGE] or None, 30)
        heading = browser.find_element(By.ID, "pending").text
        assert heading == (f"Awaiting approval ({len(mine)}: engine {engine}, runbook {runbook})")
        browser.save_screenshot(str(tmp_path / "backlog-filtered.png"))
        print(f"\nscreenshots: {tmp_path}")
