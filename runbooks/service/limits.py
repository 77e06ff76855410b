"""What `runbook serve` takes from a client before it refuses or hangs up.

Two layers, because uvicorn calls the app only once a request's head is in:

- `timed_h11_protocol`: uvicorn's h11 protocol with a deadline on the request
  head. A connection must deliver a complete head (request line and headers,
  at most MAX_HEAD_BYTES) within `header_timeout` of opening, and again of each
  response; else it gets 408 and is closed. That also closes a silent
  connection, one that dribbles a header a byte at a time, and one that goes on
  sending a body nobody reads after its answer. (uvicorn itself has only an
  idle keep-alive timeout, which every received byte resets.)
- `RequestLimits`, an ASGI middleware: every route's body limit, enforced
  before the body is read — a Content-Length over it is answered 413 at once,
  a body without one (chunked) is cut as it crosses the limit — and the whole
  body must arrive within `body_timeout` of the head (408). Both answers say
  `Connection: close`, so nothing more is read from that client. A client that
  hangs up mid-upload is one log line, not a traceback.

Connections (`Connections`, counted by the protocol, read by the middleware):
- one client address holds at most `limits.client_connections` open at once
  (`max_client_connections`, by default half of `max_connections`): a
  connection beyond it is answered 503 and closed before anything is read, so
  one peer cannot take every slot;
- while more than `limits.max_connections` are open in all, every request but
  the health check (`/healthz`, the liveness and readiness probes' path) is
  answered 503 (Alertmanager retries): the probes answer whatever the load.
`serve_cli` passes the protocol and the keep-alive timeout from the
configuration's `limits` section (not uvicorn's `limit_concurrency`, which
counts a probe's connection like any other and answers it 503 too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm_runbook.runbooks.model.config import KIB, LimitsConfig
from vllm_runbook.runbooks.service.browser import SECURITY_HEADERS

log = logging.getLogger("vllm_runbook.service")

WEBHOOK_PATH: Final = "/webhooks/alertmanager"
# Answered whatever the connections' load (the Kubernetes probes' path).
HEALTH_PATHS: Final = frozenset({"/healthz"})
# Every other route: approve/reject (a JSON body or the page's form) carry a
# note of at most 4096 characters, which escaped (\\uXXXX, %XX) stays under this;
# the rest read no body at all.
OTHER_BODY_BYTES: Final = 64 * KIB
# uvicorn's (h11's) own limit on a request head, stated here to be documented.
MAX_HEAD_BYTES: Final = 16 * KIB

# Why a request was refused or cut (the service's requests_refused `reason`).
BODY_TOO_LARGE: Final = "body_too_large"
BODY_TIMEOUT: Final = "body_timeout"
HEADER_TIMEOUT: Final = "header_timeout"
CLIENT_DISCONNECTED: Final = "client_disconnected"
CLIENT_CONNECTIONS: Final = "client_connections"
TOO_MANY_CONNECTIONS: Final = "too_many_connections"
REFUSAL_REASONS: Final = (
    BODY_TOO_LARGE,
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    CLIENT_DISCONNECTED,
    CLIENT_CONNECTIONS,
    TOO_MANY_CONNECTIONS,
)

OnRefused = Callable[[str, str], None]  # (path or "", reason)


class Connections:
    """The server's open connections, in all and per client address: the
    protocol counts them (`opened`/`closed`), RequestLimits reads `busy`."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.max_connections = limits.max_connections
        self.per_client = limits.client_connections
        self.open = 0
        self._by_client: Counter[str] = Counter()
        self._lock = threading.Lock()  # the event loop's thread only, but cheap

    def opened(self, client: str) -> bool:
        """Count a new connection from `client`; False (not counted) when that
        client already holds its share."""
        with self._lock:
            if self._by_client[client] >= self.per_client:
                return False
            self._by_client[client] += 1
            self.open += 1
            return True

    def closed(self, client: str) -> None:
        with self._lock:
            self.open -= 1
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]

    def held_by(self, client: str) -> int:
        with self._lock:
            return self._by_client[client]

    @property
    def busy(self) -> bool:
        """More connections are open than `limits.max_connections`."""
        return self.open > self.max_connections


class _BodyTooLarge(Exception):
    pass


class _BodyTimedOut(Exception):
    pass


def body_limit(path: str, limits: LimitsConfig) -> int:
    """The largest body `path` takes, in bytes."""
    return limits.webhook_body_bytes if path == WEBHOOK_PATH else OTHER_BODY_BYTES


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed one before the app sees it
    return None


async def _answer(send: Send, status: int, message: str, *, retry_after: bool = False) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # Read nothing more from this client: the rest of its body is refused.
                (b"connection", b"close"),
                *([(b"retry-after", b"1")] if retry_after else []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class _Upload:
    limit: int
    deadline: float
    received: int = 0
    complete: bool = False


class RequestLimits:
    """Body limits and the body-read timeout, for every route of the app it
    wraps, and 503 for every route but the health check while `connections`
    is busy."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: LimitsConfig,
        on_refused: OnRefused | None = None,
        connections: Connections | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_refused = on_refused
        self.connections = connections

    def _refused(self, path: str, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(path, reason)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if self.connections is not None and self.connections.busy and path not in HEALTH_PATHS:
            log.warning(
                "%s %s: refused, %d connections open (limit %d)",
                method,
                path,
                self.connections.open,
                self.connections.max_connections,
            )
            self._refused(path, TOO_MANY_CONNECTIONS)
            await _answer(send, 503, "too many connections; retry later", retry_after=True)
            return
        limit = body_limit(path, self.limits)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            log.warning(
                "%s %s: refused a body of %d bytes (limit %d)", method, path, declared, limit
            )
            self._refused(path, BODY_TOO_LARGE)
            await _answer(send, 413, f"request body larger than {limit} bytes")
            return
        loop = asyncio.get_running_loop()
        upload = _Upload(limit, loop.time() + self.limits.body_timeout_seconds)
        upload.complete = declared == 0 and not _chunked(scope)
        started = False

        async def limited_receive() -> Message:
            if upload.complete:  # after the body: only a disconnect can come, no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(upload.deadline):  # no task per read (wait_for)
                    message = await receive()
            except TimeoutError:
                raise _BodyTimedOut from None
            if message["type"] == "http.request":
                upload.received += len(message.get("body", b""))
                if upload.received > upload.limit:
                    raise _BodyTooLarge
                upload.complete = not message.get("more_body", False)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge:
            log.warning(
                "%s %s: body cut at %d bytes (limit %d)", method, path, upload.received, limit
            )
            self._refused(path, BODY_TOO_LARGE)
            if not started:
                await _answer(send, 413, f"request body larger than {limit} bytes")
        except _BodyTimedOut:
            log.warning(
                "%s %s: body not received within %g s (%d bytes came); closed",
                method,
                path,
                self.limits.body_timeout_seconds,
                upload.received,
            )
            self._refused(path, BODY_TIMEOUT)
            if not started:
                await _answer(
                    send,
                    408,
                    f"request body not received within {self.limits.body_timeout_seconds:g} s",
                )
        except ClientDisconnect:
            expected = "?" if declared is None else str(declared)
            log.info(
                "%s %s: client disconnected after %d of %s body bytes; nothing done",
                method,
                path,
                upload.received,
                expected,
            )
            self._refused(path, CLIENT_DISCONNECTED)


def _chunked(scope: Scope) -> bool:
    return any(
        name == b"transfer-encoding" and b"chunked" in value.lower()
        for name, value in scope.get("headers", ())
    )


def _raw_answer(status_line: bytes, message: bytes, *extra: bytes) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with the security
    headers every other answer carries (service/browser.py)."""
    body = b'{"error": "' + message + b'"}'
    headers = [
        b"content-type: application/json",
        b"connection: close",
        *extra,
        *(name + b": " + value for name, value in SECURITY_HEADERS),
        b"content-length: " + str(len(body)).encode(),
    ]
    return b"HTTP/1.1 " + status_line + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + body


_HEAD_TIMEOUT_RESPONSE: Final = _raw_answer(
    b"408 Request Timeout", b"request head not received in time"
)
_CLIENT_CONNECTIONS_RESPONSE: Final = _raw_answer(
    b"503 Service Unavailable", b"too many connections from this address; retry", b"retry-after: 1"
)


def timed_h11_protocol(
    header_timeout_s: float,
    on_refused: OnRefused | None = None,
    connections: Connections | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol whose connections must send each request head
    within `header_timeout_s` (from the connection's start, and from each
    response), counted in `connections` (a client beyond its share is
    answered 503 and closed at once); pass it as `uvicorn.run(..., http=...)`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _counted: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if connections is not None:
                peer = self.client[0] if self.client else ""
                if not connections.opened(peer):
                    if on_refused is not None:
                        on_refused("", CLIENT_CONNECTIONS)
                    held = connections.held_by(peer)
                    log.info("%s: refused, it holds %d connections already", peer, held)
                    self.transport.write(_CLIENT_CONNECTIONS_RESPONSE)
                    self.transport.close()
                    return
                self._counted = peer
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if connections is not None and self._counted is not None:
                connections.closed(self._counted)
                self._counted = None
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a head arrived: its body has the app's deadline
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered (a pipelined one came in)
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            log.info("%s: no complete request head within %g s; closed", peer, header_timeout_s)
            if on_refused is not None:
                on_refused("", HEADER_TIMEOUT)
            self.transport.write(_HEAD_TIMEOUT_RESPONSE)
            self.transport.close()

    return TimedH11Protocol
