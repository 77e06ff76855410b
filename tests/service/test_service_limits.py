"""What `runbook serve` takes from a client: body limits enforced before the body
is read, time limits on incomplete requests, a connection limit, a client that
hangs up mid-upload, notes, ids and JSON the journal cannot take.

The server tests speak raw HTTP/1.1 over sockets to a real `runbook serve`
(uvicorn) on loopback: what a slow, broken or hostile client does."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from vllm_runbook.runbooks.service.app import Credentials
from vllm_runbook.runbooks.service.browser import SECURITY_HEADERS, SESSION_COOKIE, BrowserPolicy
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.approvals import MAX_NOTE_CHARS

from tests.engines import runbook_cli
from tests.service.processes import RunbookServe
from tests.service.test_service_webhooks import AUTH, CONFIG, TOKEN, make_client, payload

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 1.5, 2.5, 6
LIMITS = f"""\
limits:
  header_timeout: {HEADER_TIMEOUT_S * 1000:g}ms
  body_timeout: {BODY_TIMEOUT_S * 1000:g}ms
  max_connections: {MAX_CONNECTIONS}
"""
WEBHOOK_LIMIT = 4 * 1024 * 1024  # the default limits.webhook_body
OTHER_LIMIT = 64 * 1024  # every other route


@dataclass
class Served:
    port: int
    log_path: Path
    db_url: str

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `runbook serve` on SQLite with short time limits, for every socket test."""
    tmp = tmp_path_factory.mktemp("limits")
    cfg = tmp / "runbook.yaml"
    cfg.write_text(CONFIG + LIMITS)
    url = f"sqlite:///{tmp / 'runbook.db'}"
    log = tmp / "serve.log"
    env = {"RUNBOOK_WEBHOOK_TOKEN": TOKEN}
    with RunbookServe.run(cfg, log, "--db", url, "--no-rules", env=env) as serve:
        yield Served(int(urlsplit(serve.url).port or 0), log, url)


def read_all(sock: socket.socket, timeout: float) -> tuple[bytes, str, float]:
    """What the server sends until it closes the connection (or `timeout`):
    (bytes, how it ended: eof | reset | timeout, seconds)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        how = "eof"
    except TimeoutError:
        how = "timeout"
    except ConnectionResetError:
        how = "reset"
    return data, how, time.monotonic() - start


def status_of(response: bytes) -> int | None:
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[0].startswith(b"HTTP/1.1") else None


def head(path: str, *headers: str) -> bytes:
    # The page's routes take only same-origin browser requests (else 403 before the body).
    own = ["Sec-Fetch-Site: same-origin"] if path.startswith("/ui/") else []
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *own, *headers, "", ""]
    return "\r\n".join(lines).encode()


ROUTES = [
    pytest.param("/webhooks/alertmanager", WEBHOOK_LIMIT, id="webhook"),
    pytest.param("/ui/executions/1/approve", OTHER_LIMIT, id="page-approve"),
    pytest.param("/api/executions/1/approve", OTHER_LIMIT, id="api-approve"),
]


@pytest.mark.parametrize(("path", "limit"), ROUTES)
def test_a_declared_body_over_the_limit_is_refused_before_a_byte_of_it(
    served: Served, path: str, limit: int
) -> None:
    # 600 MB announced, none sent: the answer must come without the body.
    with served.connect() as sock:
        sock.sendall(head(path, f"Authorization: Bearer {TOKEN}", "Content-Length: 600000000"))
        response, how, seconds = read_all(sock, 10)
    assert status_of(response) == 413, response
    assert b"connection: close" in response.lower() and how == "eof"
    assert f"request body larger than {limit} bytes".encode() in response
    assert seconds < 5
    # The same security headers as every other answer (service/browser.py).
    for name, value in SECURITY_HEADERS:
        assert (name + b": " + value).lower() in response.lower(), name


@pytest.mark.parametrize(("path", "limit"), ROUTES)
def test_a_chunked_body_is_cut_at_the_limit(served: Served, path: str, limit: int) -> None:
    # No Content-Length: the server counts what it reads and stops at the limit.
    # What it did not read stays in the sockets' buffers (a few MiB on loopback).
    total, chunk = 150 * 1024 * 1024, 64 * 1024
    piece = b"%x\r\n" % chunk + b"x" * chunk + b"\r\n"
    sent, response = 0, b""
    with served.connect() as sock:
        sock.sendall(head(path, f"Authorization: Bearer {TOKEN}", "Transfer-Encoding: chunked"))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered
                sock.sendall(piece)
                sent += chunk
            else:
                sock.sendall(b"0\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            response += read_all(sock, 10)[0]
    assert sent < limit + 32 * 1024 * 1024, f"{sent} bytes sent before the answer"
    assert status_of(response) == 413, response[:200]


def test_incomplete_requests_time_out(served: Served) -> None:
    # A silent connection, a head dribbled a byte at a time, a body that stops:
    # each gets 408 and is closed, within its limit (plus scheduling slack).
    with served.connect() as sock:
        response, how, seconds = read_all(sock, 15)
    assert (status_of(response), how) == (408, "eof"), response
    assert HEADER_TIMEOUT_S - 0.1 < seconds < HEADER_TIMEOUT_S + 3
    assert b"x-frame-options: DENY" in response

    with served.connect() as sock:
        start = time.monotonic()
        closed = False
        for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([sock], [], [], 0.1)[0]:
                closed = True
                break
        response, how, _ = read_all(sock, 5)
        seconds = time.monotonic() - start
    assert closed and status_of(response) == 408, response
    assert seconds < HEADER_TIMEOUT_S + 3

    with served.connect() as sock:
        sock.sendall(
            head("/webhooks/alertmanager", f"Authorization: Bearer {TOKEN}", "Content-Length: 100")
            + b'{"version": '
        )
        response, how, seconds = read_all(sock, 15)
    assert (status_of(response), how) == (408, "eof"), response
    assert f"request body not received within {BODY_TIMEOUT_S:g} s".encode() in response
    assert BODY_TIMEOUT_S - 0.1 < seconds < BODY_TIMEOUT_S + 3
    log = served.log()
    assert "no complete request head within 1.5 s; closed" in log
    assert "POST /webhooks/alertmanager: body not received within 2.5 s (12 bytes came)" in log


def connect_from(served: Served, source: str) -> socket.socket:
    """A connection from another loopback address (all of 127/8 is this host's)."""
    return socket.create_connection(
        ("127.0.0.1", served.port), timeout=10, source_address=(source, 0)
    )


def ask(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    return read_all(sock, 10)[0]


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Partial: "


def delivery(fingerprint: str) -> bytes:
    # latency-spike awaits approval: nothing runs (and logs) behind the other tests
    body = json.dumps(
        payload("VllmLatencySpike", "latency-spike", fingerprint=fingerprint)
    ).encode()
    return (
        head(
            "/webhooks/alertmanager",
            f"Authorization: Bearer {TOKEN}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
        )
        + body
    )


def open_held(served: Served, source: str, count: int) -> tuple[list[socket.socket], int]:
    """`count` connections from `source`, each with a partial request: (those the
    server kept open, how many it refused with 503 at once)."""
    held, refused = [], 0
    for _ in range(count):
        sock = connect_from(served, source)
        sock.sendall(PARTIAL)
        held.append(sock)
    time.sleep(0.3)  # the refusals arrive
    kept = []
    for sock in held:
        if select.select([sock], [], [], 0)[0]:
            answer = read_all(sock, 2)[0]
            assert status_of(answer) == 503, answer
            assert b"too many connections from this address" in answer
            refused += 1
            sock.close()
        else:
            kept.append(sock)
    return kept, refused


def still_held(socks: list[socket.socket]) -> bool:
    """Nothing came back on any of them: the server still holds them open."""
    return not select.select(socks, [], [], 0)[0]


def test_a_flood_from_one_address_leaves_health_and_others_served(served: Served) -> None:
    # 120 connections from 127.0.0.1, each a partial request: the server keeps
    # half of limits.max_connections (3), the rest get 503 at once.
    per_client = MAX_CONNECTIONS // 2
    held, refused = open_held(served, "127.0.0.1", 120)
    try:
        assert (len(held), refused) == (per_client, 120 - per_client)
        with connect_from(served, "127.0.0.2") as sock:
            assert status_of(ask(sock, HEALTHZ)) == 200
        with connect_from(served, "127.0.0.2") as sock:
            answer = ask(sock, delivery("flood-1"))
        assert status_of(answer) == 200, answer
        assert still_held(held)  # all this while the flood was held
    finally:
        for sock in held:
            sock.close()
    store = Journal(served.db_url)
    assert [e.alert_fingerprint for e in store.list_executions(limit=5)].count("flood-1") == 1
    store.close()
    assert "127.0.0.1: refused, it holds 3 connections already" in served.log()


def test_beyond_the_connection_limit_the_webhook_gets_503_and_health_200(served: Served) -> None:
    # Three addresses of three connections each: 9 open, over the limit of 6.
    held: list[socket.socket] = []
    try:
        for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
            kept, refused = open_held(served, source, 3)
            assert refused == 0
            held += kept
        with connect_from(served, "127.0.0.2") as sock:
            answer = ask(sock, delivery("over-limit-1"))
        assert status_of(answer) == 503, answer
        assert b"too many connections; retry later" in answer
        assert b"x-content-type-options: nosniff" in answer.lower()
        with connect_from(served, "127.0.0.2") as sock:
            assert status_of(ask(sock, HEALTHZ)) == 200
        assert still_held(held)
    finally:
        for sock in held:
            sock.close()
    # The connections closed: the webhook is served again (once the server has seen them go).
    deadline = time.monotonic() + 10
    while True:
        with connect_from(served, "127.0.0.2") as sock:
            status = status_of(ask(sock, delivery("over-limit-2")))
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200
    store = Journal(served.db_url)
    fingerprints = [e.alert_fingerprint for e in store.list_executions(limit=10)]
    assert "over-limit-2" in fingerprints and "over-limit-1" not in fingerprints
    store.close()


def test_a_client_gone_mid_upload_is_one_log_line(served: Served) -> None:
    before = served.log()
    with served.connect() as sock:
        sock.sendall(
            head(
                "/webhooks/alertmanager", f"Authorization: Bearer {TOKEN}", "Content-Length: 50000"
            )
            + b"x" * 1234
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "client disconnected" not in served.log()[len(before) :]:
        assert time.monotonic() < deadline, served.log()[len(before) :]
        time.sleep(0.1)
    time.sleep(0.5)  # anything else it would log
    new = served.log()[len(before) :]
    assert new.count("\n") == 1, new
    assert (
        "POST /webhooks/alertmanager: client disconnected after 1234 of 50000 body bytes; "
        "nothing done" in new
    )
    assert "Traceback" not in served.log() and "Exception in ASGI" not in served.log()


# -- notes, ids and JSON that the journal cannot take: 4xx, on SQLite and PostgreSQL --


def awaiting(client: TestClient) -> int:
    """An execution awaiting approval (latency-spike is `approve` in CONFIG)."""
    body = payload("VllmLatencySpike", "latency-spike", fingerprint="await-1")
    [execution] = client.post("/webhooks/alertmanager", json=body, headers=AUTH).json()[
        "executions"
    ]
    assert execution["mode"] == "approve"
    return int(execution["id"])


def test_a_note_over_the_limit_is_refused_everywhere(db_url: str, tmp_path: Path) -> None:
    client = make_client(db_url, tmp_path)
    execution = awaiting(client)
    # Astral characters: the longest escaped form of a note (12 bytes each in JSON).
    too_long = "\U0001f600" * (MAX_NOTE_CHARS + 1)
    url = f"/api/executions/{execution}/approve"
    r = client.post(url, json={"note": too_long}, headers=AUTH)
    assert (r.status_code, r.json()) == (
        422,
        {"error": f"the note has {MAX_NOTE_CHARS + 1} characters; at most 4096 are kept"},
    )
    r = client.post(
        f"/ui/executions/{execution}/approve",
        data={**page_form(client), "note": "n" * (MAX_NOTE_CHARS + 1)},
        headers=OWN_ORIGIN,
        follow_redirects=False,
    )
    assert (r.status_code, r.text) == (422, "the note has 4097 characters; at most 4096 are kept\n")
    done = runbook_cli(
        "approve", str(execution), "--db", db_url, "--note", "n" * (MAX_NOTE_CHARS + 1)
    )
    assert (done.returncode, done.stderr) == (
        2,
        "runbook: error: the note has 4097 characters; at most 4096 are kept\n",
    )
    store = Journal(db_url)
    assert store.get_execution(execution).awaiting_approval  # nothing decided
    # At the limit, in the longest form a person can send: taken whole.
    note = "\U0001f600" * MAX_NOTE_CHARS
    r = client.post(url, json={"note": note}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert store.get_execution(execution).decision_note == note
    store.close()


def page_form(client: TestClient) -> dict[str, str]:
    """A page session (its cookie set on `client`) and its form token, as the
    page hands them out (sessions signed with the webhook secret)."""
    policy = BrowserPolicy.build(Credentials(token=TOKEN).secret)
    session = policy.new_session()
    client.cookies.set(SESSION_COOKIE, session)
    return {"token": policy.form_token(session)}


OWN_ORIGIN = {"Origin": "http://127.0.0.1"}


OUT_OF_RANGE = [2**63, 99999999999999999999, 2**31, -1, 0]


@pytest.mark.parametrize("bad_id", OUT_OF_RANGE)
def test_ids_outside_the_databases_integers_are_unknown_ids(
    db_url: str, tmp_path: Path, bad_id: int
) -> None:
    client = make_client(db_url, tmp_path)
    for verb in ("approve", "reject"):
        r = client.post(f"/api/executions/{bad_id}/{verb}", json={}, headers=AUTH)
        assert (r.status_code, r.json()) == (404, {"error": f"no execution with id {bad_id}"})
        r = client.post(
            f"/ui/executions/{bad_id}/{verb}",
            data=page_form(client),
            headers=OWN_ORIGIN,
            follow_redirects=False,
        )
        # The page answers an unknown id as any other: back to the page, saying so.
        assert r.status_code == 303
        assert r.headers["location"] == f"/?msg=no%20execution%20with%20id%20{bad_id}"
    done = runbook_cli("approve", str(bad_id), "--db", db_url)
    assert (done.returncode, done.stderr) == (2, f"runbook: error: no execution with id {bad_id}\n")
    done = runbook_cli("history", str(bad_id), "--db", db_url)
    assert (done.returncode, done.stderr) == (2, f"runbook: error: no execution with id {bad_id}\n")


def test_deeply_nested_json_on_the_approve_routes_is_400(db_url: str, tmp_path: Path) -> None:
    client = make_client(db_url, tmp_path)
    execution = awaiting(client)
    nested = b"[" * 30_000 + b"]" * 30_000  # under the 64 KiB limit
    note_nested = b'{"note": ' + nested + b"}"
    for body in (nested, note_nested):
        r = client.post(f"/api/executions/{execution}/approve", content=body, headers=AUTH)
        assert (r.status_code, r.json()) == (400, {"error": "body is not JSON: nested too deeply"})
    store = Journal(db_url)
    assert store.get_execution(execution).awaiting_approval
    store.close()
