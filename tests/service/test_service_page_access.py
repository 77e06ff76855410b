"""What the service requires of a browser request (service/browser.py), on the
real app: the names it answers to (Host), the origin of a state change
(Origin / Sec-Fetch-Site, every route), the page's session cookie and form
tokens (bound, expiring), who an answer is recorded as, the headers that
forbid framing and inline code, and the reads' credentials off loopback
(`/metrics`, `/openapi.json`). The same attacks in a real browser:
test_service_browser.py."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from vllm_runbook.runbooks.service.app import Credentials
from vllm_runbook.runbooks.service.browser import (
    CONTENT_SECURITY_POLICY,
    FORM_TOKEN_LIFETIME_S,
    SESSION_LIFETIME_S,
    BrowserPolicy,
)
from vllm_runbook.runbooks.service.page import PAGE_CSS
from vllm_runbook.runbooks.service.serve_cli import build

from tests.fake_agent import FakeAgent
from tests.service.test_service_approvals import CONFIG, Replica
from tests.service.test_service_webhooks import AUTH, TOKEN, payload

OWN = {"Origin": "http://127.0.0.1"}
CROSS_SITE = (
    "cross-site request refused: this service answers state changes only from its own pages\n"
)
COOKIE = re.compile(r"^runbook-session=([^;]+); HttpOnly; Max-Age=43200; Path=/; SameSite=strict$")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def replica(sqlite_url: str, tmp_path: Path, clock: Clock) -> Iterator[Replica]:
    """A loopback service (the page open, answers anonymous) with a clock for its sessions."""
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    policy = BrowserPolicy.build(TOKEN, clock=clock)
    r = Replica(sqlite_url, cfg, FakeAgent(), Credentials(token=TOKEN), browser=policy)
    with r.client:
        yield r
    r.store.close()


def waiting(r: Replica, fingerprint: str) -> int:
    answer = r.client.post(
        "/webhooks/alertmanager", json=payload(fingerprint=fingerprint), headers=AUTH
    )
    assert answer.status_code == 200, answer.text
    [created] = answer.json()["executions"]
    return int(created["id"])


def open_page(client: TestClient) -> tuple[str, str]:
    """GET / as a browser: (the session cookie it set, the form token)."""
    page = client.get("/")
    assert page.status_code == 200, page.text
    found = re.search(r'name="token" value="([^"]+)"', page.text)
    assert found is not None
    cookie = COOKIE.match(page.headers.get("set-cookie", ""))
    return (cookie[1] if cookie else client.cookies["runbook-session"]), found[1]


def answer(client: TestClient, ex: int, token: str, **headers: str) -> Any:
    return client.post(
        f"/ui/executions/{ex}/approve",
        data={"token": token, "note": "go", "by": "mallory"},
        headers={**OWN, **headers},
        follow_redirects=False,
    )


def test_an_answer_on_loopback_is_anonymous_whatever_the_request_claims(replica: Replica) -> None:
    first, second = waiting(replica, "a"), waiting(replica, "b")
    page = replica.client.get("/")
    assert COOKIE.match(page.headers["set-cookie"]) is not None
    assert "answers are recorded as anonymous (loopback)" in page.text
    assert 'name="by"' not in page.text  # no name to type: it would be a claim
    _, token = open_page(replica.client)
    # A basic-auth header with a wrong password names nobody; nor does the form's `by`.
    ok = answer(replica.client, first, token, **basic("mallory", "guess"))
    assert (ok.status_code, ok.headers["location"]) == (
        303,
        f"/?msg=execution%20%23{first}%20%28oom-pressure%20on%20http%3A//127.0.0.1%3A9%29"
        "%20approved%20by%20anonymous%20%28loopback%29%3B%20the%20service%20runs%20it",
    )
    done = replica.store.get_execution(first)
    assert (done.decision, done.decided_by, done.decision_note) == (
        "approved",
        "anonymous (loopback)",
        "go",
    )
    # The webhook's own credentials, sent by the browser, name who answers.
    basic_replica_creds = Credentials(token=TOKEN, name="ops-bot")
    assert basic_replica_creds.identity(AUTH["Authorization"]) == "ops-bot"
    assert basic_replica_creds.identity("Bearer wrong") is None
    assert answer(replica.client, second, token, **AUTH).status_code == 303
    assert replica.store.get_execution(second).decided_by == "webhook token"


def test_a_state_change_from_another_origin_is_refused_on_every_route(replica: Replica) -> None:
    ex = waiting(replica, "a")
    _, token = open_page(replica.client)
    action = f"/ui/executions/{ex}/approve"
    form = {"token": token, "note": "x"}
    refused: list[dict[str, str]] = [
        {},  # the page's forms always carry Origin / Sec-Fetch-Site
        {"Origin": "http://127.0.0.2"},
        {"Origin": "http://127.0.0.1:9999"},  # same site, another origin
        {"Origin": "null"},  # a sandboxed frame, a data: URL
        {"Origin": "http://rebind.example", "Host": "rebind.example"},  # a name not ours
        {**OWN, "Sec-Fetch-Site": "same-site"},
        {**OWN, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "none"},
    ]
    for headers in refused:
        r = replica.client.post(action, data=form, headers=headers, follow_redirects=False)
        assert (r.status_code, r.text) == (403, CROSS_SITE), headers
    # The JSON API and the webhook too, when a browser says where the request came from.
    elsewhere = {"Origin": "http://127.0.0.2", **AUTH}
    api = replica.client.post(f"/api/executions/{ex}/approve", json={}, headers=elsewhere)
    assert (api.status_code, api.text) == (403, CROSS_SITE)
    hook = replica.client.post("/webhooks/alertmanager", json=payload(), headers=elsewhere)
    assert (hook.status_code, hook.text) == (403, CROSS_SITE)
    assert replica.store.get_execution(ex).decision is None
    # Alertmanager and curl send neither header; the page's own origin passes.
    assert replica.client.post("/webhooks/alertmanager", json=payload(), headers=AUTH).is_success
    own = {**OWN, "Sec-Fetch-Site": "same-origin"}
    assert answer(replica.client, ex, token, **own).status_code == 303


def test_a_form_token_answers_for_its_own_session_and_expires(
    replica: Replica, clock: Clock, sqlite_url: str, tmp_path: Path
) -> None:
    ex = waiting(replica, "a")
    mine, token = open_page(replica.client)
    other = TestClient(replica.client.app, base_url="http://127.0.0.1")
    theirs, their_token = open_page(other)
    assert (mine, token) != (theirs, their_token)
    client = replica.client

    def refused_with(tok: str, cookie: str | None) -> str:
        client.cookies.clear()
        if cookie is not None:
            client.cookies.set("runbook-session", cookie)
        r = answer(client, ex, tok)
        assert r.status_code == 403, r.text
        return str(r.text)

    stale = "stale or foreign form: reload the page\n"
    no_session = "no page session (or it expired): reload the page; it needs its cookie\n"
    assert refused_with(their_token, mine) == stale  # another session's token
    assert refused_with(token, theirs) == stale
    assert refused_with(token, None) == no_session  # the cookie was not sent (another site)
    assert refused_with(token, mine + "x") == no_session  # a session the service did not sign
    assert refused_with("", mine) == stale
    assert refused_with("9999999999.é.ü", mine) == stale  # not ASCII: still a 403, not a 500
    assert not BrowserPolicy.build(TOKEN).session_valid("1.é.ü")
    # Signed by another service (another webhook secret): foreign.
    stranger = BrowserPolicy.build("another-secret", clock=clock)
    assert refused_with(stranger.form_token(mine), mine) == stale
    clock.now += FORM_TOKEN_LIFETIME_S
    assert refused_with(token, mine) == "the form expired: reload the page\n"
    clock.now += SESSION_LIFETIME_S - FORM_TOKEN_LIFETIME_S
    assert refused_with(token, mine) == no_session
    assert replica.store.get_execution(ex).decision is None
    # Reloading the page starts a new session whose token answers.
    client.cookies.clear()
    fresh, token = open_page(client)
    assert fresh != mine
    assert answer(client, ex, token).status_code == 303
    assert replica.store.get_execution(ex).decided_by == "anonymous (loopback)"


BUILD_CONFIG = """\
engines:
  - name: engine-a
    agent: http://127.0.0.1:9
    labels: {instance: "10.1.2.3:8000"}
automation:
  oom-pressure: approve
webhook:
  token_file: TOKEN_FILE
  token_name: alertmanager-prod
page:
  hosts: [Runbook.Internal]
notifications:
  page_url: https://oncall.example/runbook/
"""


def served(host: str, tmp_path: Path, sqlite_url: str, base_url: str) -> TestClient:
    """The app `runbook serve --host HOST` would serve, reached at `base_url`."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = tmp_path / "runbook.yaml"
    config.write_text(BUILD_CONFIG.replace("TOKEN_FILE", str(token_file)))
    service = build(str(config), sqlite_url, host, worker=False, rules=False)
    return TestClient(service.app, base_url=base_url)


def test_the_service_answers_to_its_own_names_only(tmp_path: Path, sqlite_url: str) -> None:
    client = served("127.0.0.1", tmp_path, sqlite_url, "http://127.0.0.1:8080")

    def status(path: str, host: str, **headers: str) -> int:
        return int(client.get(path, headers={"Host": host, **headers}).status_code)

    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST", "127.0.0.2"):
        assert status("/", host) == 200, host
    assert status("/", "runbook.internal:8080") == 200  # page.hosts
    assert status("/", "oncall.example") == 200  # notifications.page_url's host
    for host in ("rebind.example:8080", "127.0.0.1.nip.io:8080", "runbook.internal.evil", ""):
        for path in ("/", "/api/pending", "/api/executions", "/metrics", "/openapi.json"):
            r = client.get(path, headers={"Host": host})
            assert (r.status_code, r.text) == (
                400,
                f"unknown Host {host or '(none)'}: this service answers to its own names only\n",
            ), (host, path)
    # Liveness answers any name (a kubelet probes the pod's address); credentials need none.
    assert status("/healthz", "rebind.example") == 200
    assert status("/api/pending", "rebind.example", **AUTH) == 200
    hook = client.post(
        "/webhooks/alertmanager", json=payload(), headers={"Host": "am.example", **AUTH}
    )
    assert hook.status_code == 200
    # The token's configured name is who its answers are recorded as.
    [ex] = [e["id"] for e in hook.json()["executions"]]
    done = client.post(f"/api/executions/{ex}/approve", headers=AUTH)
    assert done.json()["execution"]["decided_by"] == "alertmanager-prod"


def test_off_loopback_the_bind_address_is_a_name_too(tmp_path: Path, sqlite_url: str) -> None:
    client = served("10.1.2.3", tmp_path, sqlite_url, "http://10.1.2.3:8080")
    assert client.get("/", headers=AUTH).status_code == 200
    wrong = client.get("/", headers={"Host": "10.9.9.9:8080", **AUTH})
    assert wrong.status_code == 400


def test_the_session_cookie_is_secure_over_https_and_behind_an_https_page_url(
    tmp_path: Path, sqlite_url: str
) -> None:
    client = served("127.0.0.1", tmp_path, sqlite_url, "https://oncall.example")
    secure = re.compile(
        r"^__Host-runbook-session=[^;]+; HttpOnly; Max-Age=43200; Path=/; SameSite=strict; Secure$"
    )
    assert secure.match(client.get("/").headers["set-cookie"])
    # http behind the TLS proxy of page_url: still Secure (the browser spoke https).
    proxied = client.get("http://oncall.example/")
    assert secure.match(proxied.headers["set-cookie"])
    # Loopback over plain http (a port-forward): a plain cookie, or the browser would drop it.
    local = client.get("http://127.0.0.1:8080/")
    assert COOKIE.match(local.headers["set-cookie"])
    # The page_url's origin may answer (a proxy that rewrites Host), and only it.
    ex = int(
        client.post("/webhooks/alertmanager", json=payload(), headers=AUTH).json()["executions"][0][
            "id"
        ]
    )
    page = client.get("http://127.0.0.1:8080/")
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    assert token is not None
    r = client.post(
        f"http://127.0.0.1:8080/ui/executions/{ex}/approve",
        data={"token": token[1]},
        headers={"Origin": "https://oncall.example"},
        follow_redirects=False,
    )
    assert r.status_code == 303


def test_every_answer_forbids_framing_and_the_page_needs_no_inline_code(replica: Replica) -> None:
    waiting(replica, "a")
    expected = {
        "content-security-policy": CONTENT_SECURITY_POLICY,
        "x-frame-options": "DENY",
        "x-content-type-options": "nosniff",
        "referrer-policy": "same-origin",
        "cross-origin-resource-policy": "same-origin",
    }
    assert CONTENT_SECURITY_POLICY == (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "base-uri 'none'; frame-ancestors 'none'"
    )
    for path in ("/", "/page.css", "/api/pending", "/metrics", "/healthz", "/no-such-page"):
        r = replica.client.get(path)
        assert {k: r.headers.get(k) for k in expected} == expected, path
    page = replica.client.get("/")
    assert page.headers["cache-control"] == "no-store"
    # Nothing inline for the CSP to refuse: no script, no style element or attribute.
    assert re.findall(r"<script|<style|\sstyle=|\son[a-z]+=|javascript:", page.text, re.I) == []
    assert '<link rel="stylesheet" href="/page.css">' in page.text
    css = replica.client.get("/page.css")
    assert (css.status_code, css.headers["content-type"]) == (200, "text/css; charset=utf-8")
    assert css.text == PAGE_CSS.read_text(encoding="utf-8")
