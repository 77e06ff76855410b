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

The connection limit is uvicorn's `limit_concurrency` (requests beyond it are
answered 503, which Alertmanager retries); `serve_cli` passes it and the
keep-alive timeout from the configuration's `limits` section.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm_runbook.runbooks.model.config import KIB, LimitsConfig

log = logging.getLogger("vllm_runbook.service")

WEBHOOK_PATH: Final = "/webhooks/alertmanager"
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
REFUSAL_REASONS: Final = (BODY_TOO_LARGE, BODY_TIMEOUT, HEADER_TIMEOUT, CLIENT_DISCONNECTED)

OnRefused = Callable[[str, str], None]  # (path or "", reason)


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


async def _answer(send: Send, status: int, message: str) -> None:
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
    """Body limits and the body-read timeout, for every route of the app it wraps."""

    def __init__(
        self, app: ASGIApp, *, limits: LimitsConfig, on_refused: OnRefused | None = None
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_refused = on_refused

    def _refused(self, path: str, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(path, reason)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
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


_HEAD_TIMEOUT_BODY: Final = b'{"error": "request head not received in time"}'
_HEAD_TIMEOUT_RESPONSE: Final = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: application/json\r\n"
    b"connection: close\r\n"
    b"content-length: " + str(len(_HEAD_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _HEAD_TIMEOUT_BODY
)


def timed_h11_protocol(
    header_timeout_s: float, on_refused: OnRefused | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol whose connections must send each request head
    within `header_timeout_s` (from the connection's start, and from each
    response); pass it as `uvicorn.run(..., http=...)`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
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
