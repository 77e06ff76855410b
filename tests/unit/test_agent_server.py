"""The agent's HTTP server against raw sockets: lying and malformed headers,
slow and idle clients, more connections than handler slots."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from vllm_runbook.collector.server import (
    AgentServer,
    Request,
    Response,
    ServerLimits,
    body_length,
)

TOKEN = "s3cret"


@contextlib.contextmanager
def running(limits: ServerLimits) -> Iterator[tuple[AgentServer, list[bytes]]]:
    registry = CollectorRegistry()
    Counter("probe", "a series to scrape", registry=registry).inc()
    server = AgentServer("127.0.0.1", 0, registry, limits=limits)
    bodies: list[bytes] = []

    def echo(request: Request) -> Response:
        bodies.append(request.body)
        return Response.json(200, {"bytes": len(request.body)})

    def bearer(request: Request) -> Response | None:
        ok = request.headers.get("authorization") == f"Bearer {TOKEN}"
        return None if ok else Response.json(401, {"error": "token"})

    server.routes[("POST", "/write")] = echo
    server.guards[("POST", "/write")] = bearer
    server.start()
    try:
        yield server, bodies
    finally:
        server.close()


def exchange(server: AgentServer, raw: bytes, timeout: float = 30.0) -> bytes:
    """Send `raw`, half-close, read until the server closes."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def metrics_ok(server: AgentServer) -> bool:
    r = httpx.get(server.url + "/metrics", timeout=30)
    return r.status_code == 200 and "probe_total 1.0" in r.text


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[AgentServer, list[bytes]]]:
    with running(ServerLimits(idle_timeout=5, request_timeout=5)) as pair:
        yield pair


@pytest.mark.parametrize(
    "headers, status",
    [
        (b"Content-Length: abc\r\n", 400),
        (b"Content-Length: -1\r\n", 400),
        (b"Content-Length: +5\r\n", 400),
        (b"Content-Length: 1e3\r\n", 400),
        (b"Content-Length: 99999999999999999999999999\r\n", 400),
        (b"Content-Length: 3\r\nContent-Length: 4\r\n", 400),
        (b"", 411),  # a POST needs a length
        (b"Transfer-Encoding: chunked\r\n", 411),
        (b"Content-Length: 65537\r\n", 413),
    ],
)
def test_content_length_is_validated(
    agent: tuple[AgentServer, list[bytes]], headers: bytes, status: int
) -> None:
    server, bodies = agent
    seen = len(bodies)
    raw = b"POST /write HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n" + headers + b"\r\n"
    answer = exchange(server, raw + b"abcd")
    assert status_of(answer) == status
    assert len(bodies) == seen  # the handler never ran
    assert metrics_ok(server)


def test_token_is_checked_before_the_body_is_read(agent: tuple[AgentServer, list[bytes]]) -> None:
    server, bodies = agent
    seen = len(bodies)
    # A lying length and no body: the answer comes at once, nothing waits for it.
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /write HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # ends only when the server closes
            answer += chunk
    assert status_of(answer) == 401
    assert b"Connection: close" in answer and answer.endswith(b'{"error": "token"}\n')
    assert len(bodies) == seen


def test_a_good_body_is_read_exactly(agent: tuple[AgentServer, list[bytes]]) -> None:
    server, bodies = agent
    r = httpx.post(
        server.url + "/write", content=b"x" * 1000, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 200 and r.json() == {"bytes": 1000}
    assert bodies[-1] == b"x" * 1000


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
        (b"\x00\xff\xfe\r\n\r\n", 400),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"DELETE /metrics HTTP/1.1\r\n\r\n", 501),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
    ],
)
def test_garbage_requests_get_an_answer(
    agent: tuple[AgentServer, list[bytes]], raw: bytes, status: int
) -> None:
    server, _ = agent
    assert status_of(exchange(server, raw)) == status
    assert metrics_ok(server)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    line=st.binary(max_size=200),
    headers=st.lists(
        st.tuples(
            st.sampled_from([b"Content-Length", b"Authorization", b"Transfer-Encoding", b"X"]),
            st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b),
        ),
        max_size=4,
    ),
)
def test_any_request_head_is_answered_or_closed_without_a_traceback(
    agent: tuple[AgentServer, list[bytes]],
    caplog: pytest.LogCaptureFixture,
    line: bytes,
    headers: list[tuple[bytes, bytes]],
) -> None:
    server, _ = agent
    head = b"POST /write " + line + b"\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    with caplog.at_level(logging.DEBUG, logger="vllm_runbook.collector"):
        answer = exchange(server, head + b"\r\n")
    if answer:
        assert answer.startswith(b"HTTP/1.")
        assert status_of(answer) != 500
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_idle_and_trickling_clients_are_cut_off() -> None:
    with running(ServerLimits(idle_timeout=0.5, request_timeout=1.0)) as (server, _):
        with socket.create_connection((server.host, server.port), timeout=30) as idle:
            assert idle.recv(1) == b""  # closed by the server, nothing sent
        # One byte at a time, each well inside the idle timeout: the request
        # deadline ends it long before its 400 bytes are in.
        sent = 0
        with socket.create_connection((server.host, server.port), timeout=30) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: ")
            closed = threading.Event()

            def watch() -> None:
                with contextlib.suppress(OSError):
                    while slow.recv(1):
                        pass
                closed.set()

            threading.Thread(target=watch, daemon=True).start()
            while sent < 400 and not closed.wait(0.05):
                with contextlib.suppress(OSError):
                    slow.sendall(b"a")
                sent += 1
        assert closed.is_set() and sent < 400
        assert metrics_ok(server)


def exchange_from(server: AgentServer, source: str, raw: bytes) -> bytes:
    """`exchange` from another loopback address (all of 127/8 is this host's)."""
    with socket.create_connection(
        (server.host, server.port), timeout=30, source_address=(source, 0)
    ) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_connections_beyond_the_slots_are_refused_then_served() -> None:
    with running(ServerLimits(max_connections=3, queue_seconds=0.2)) as (server, _):
        release, entered = threading.Event(), threading.Semaphore(0)

        def hold(request: Request) -> Response:
            entered.release()
            release.wait(60)
            return Response.json(200, {})

        def get_from(source: str) -> None:
            transport = httpx.HTTPTransport(local_address=source)
            with httpx.Client(transport=transport, timeout=60) as client:
                client.get(server.url + "/hold")

        server.routes[("GET", "/hold")] = hold
        holders = [threading.Thread(target=get_from, args=(f"127.0.0.{2 + i}",)) for i in range(3)]
        for t in holders:
            t.start()
        for _ in range(3):
            assert entered.acquire(timeout=60)  # every slot is busy now
        # The slot kept for scrapes: a scrape is served, anything else refused.
        answer = exchange(server, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status_of(answer) == 200 and b"probe_total 1.0" in answer
        while server._httpd._scrape_slot.locked():  # its thread leaves after the answer
            time.sleep(0.01)
        answer = exchange(server, b"GET /hold HTTP/1.1\r\n\r\n")
        assert status_of(answer) == 503 and server.refused_connections == 0
        # It was refused from the scrape slot, which its thread leaves after the
        # answer: free again before the idle connection below may take it (else
        # the wait below can see this one's hold, on a busy runner).
        while server._httpd._scrape_slot.locked():
            time.sleep(0.01)
        # The scrape slot held too (an idle connection): refused after queue_seconds.
        with socket.create_connection((server.host, server.port), timeout=30) as idle:
            # Accepted into the scrape slot (a fixed 0.2 s was too short on a busy runner).
            deadline = time.monotonic() + 30
            while not server._httpd._scrape_slot.locked() and time.monotonic() < deadline:
                time.sleep(0.01)
            answer = exchange_from(server, "127.0.0.9", b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status_of(answer) == 503 and server.refused_connections == 1
            idle.close()
        release.set()
        for t in holders:
            t.join(60)
        assert metrics_ok(server)  # slots come back


def test_one_client_holds_at_most_half_the_slots() -> None:
    with running(ServerLimits(max_connections=4, queue_seconds=5)) as (server, _):
        assert server.limits.per_client == 2
        idle = [socket.create_connection((server.host, server.port), timeout=30) for _ in range(2)]
        try:
            # Both accepted (a fixed 0.2 s can be too short on a busy runner).
            deadline = time.monotonic() + 30
            while server._httpd._clients["127.0.0.1"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # The same address again: refused at once, not after queue_seconds,
            # before anything is read (so this client sends nothing: data sent
            # to a socket the server already closed is answered with a reset,
            # which can drop the answer before it is read).
            with socket.create_connection((server.host, server.port), timeout=30) as sock:
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            answer = b"".join(chunks)
            assert status_of(answer) == 503
            assert b"too many connections from this address" in answer
            # Another address: served.
            answer = exchange_from(server, "127.0.0.2", b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status_of(answer) == 200
        finally:
            for sock in idle:
                sock.close()


def test_answers_are_sent_at_once_not_held_back_by_nagle(
    agent: tuple[AgentServer, list[bytes]],
) -> None:
    """An answer goes out in two writes (head, then body). With Nagle's algorithm
    on, the body waits for the client's delayed ACK of the head: measured 44 ms
    per /v1/state over loopback. The agent's connections send at once."""
    server, _ = agent
    nodelay: list[int] = []
    served = threading.Event()
    finish_request = server._httpd.finish_request

    def spy(request: socket.socket, client_address: object) -> None:
        try:
            finish_request(request, client_address)
        finally:
            nodelay.append(request.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            served.set()

    server._httpd.finish_request = spy  # type: ignore[method-assign]
    try:
        assert metrics_ok(server)
        # The client has its answer before the connection's thread leaves
        # finish_request (the spy's record comes after): wait for it.
        assert served.wait(timeout=10)
    finally:
        del server._httpd.finish_request
    assert len(nodelay) == 1 and nodelay[0] != 0


def test_body_length_rules() -> None:
    assert body_length("GET", {}, 10) == 0
    assert body_length("POST", {"content-length": "10"}, 10) == 10
    assert body_length("POST", {"content-length": " 7 "}, 10) == 7
    for bad in ("", "٥", "5_0", "0x10", "-0"):
        refusal = body_length("POST", {"content-length": bad}, 10)
        assert isinstance(refusal, Response) and refusal.status == 400


def test_limits_from_env() -> None:
    limits = ServerLimits.from_env(
        {"VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS": "4", "VLLM_RUNBOOK_AGENT_TIMEOUT": "2"}
    )
    assert (limits.max_connections, limits.idle_timeout, limits.request_timeout) == (4, 2.0, 3.0)
    assert ServerLimits.from_env({}) == ServerLimits()
    with pytest.raises(ValueError):
        ServerLimits.from_env({"VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS": "0"})
