"""The agent's HTTP endpoint inside the engine process: /metrics (and routes
added by the control plane).

A stdlib HTTP server on a daemon thread: no event loop to share with vLLM,
nothing to install, and a slow client never blocks the scheduler. It runs in
someone else's serving process, so every client is bounded (`ServerLimits`):
- at most `max_connections` handler threads, of which one client address
  holds at most `per_client` (half, at least 1): its next connection gets a
  503 at once and is closed, so one peer cannot take every slot;
- one more slot is kept for scrapes: a connection that finds every other slot
  busy is served there a single request, `GET /metrics`, else 503;
- when that is busy too, a connection waits `queue_seconds` for a slot, then
  gets a 503 and is closed;
- a silent socket times out after `idle_timeout`; a request (line, headers,
  body) that has not fully arrived `request_timeout` after its handler started
  reading is cut off (a client trickling one byte at a time gains nothing);
- a protected route checks its credentials before a byte of the body is read;
  Content-Length must be a plain number (400), present where a body is
  required (411) and small (413);
- a broken client is a closed connection, never a traceback in the engine log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from vllm_runbook.collector.exporter import OnlySamples

logger = logging.getLogger("vllm_runbook.collector")

MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the engine process."""

    max_connections: int = 16
    queue_seconds: float = 1.0
    idle_timeout: float = 10.0
    request_timeout: float = 15.0
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def per_client(self) -> int:
        """The handler slots one client address may hold at once."""
        return max(1, self.max_connections // 2)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerLimits:
        """VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS and VLLM_RUNBOOK_AGENT_TIMEOUT (the
        idle timeout; a request gets 1.5× it). ValueError on a bad value."""
        env = dict(os.environ) if env is None else env
        default = cls()
        connections = int(env.get("VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS", default.max_connections))
        timeout = float(env.get("VLLM_RUNBOOK_AGENT_TIMEOUT", default.idle_timeout))
        if connections < 1 or not timeout > 0:
            raise ValueError(
                "VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS must be ≥ 1 and VLLM_RUNBOOK_AGENT_TIMEOUT > 0"
            )
        return cls(max_connections=connections, idle_timeout=timeout, request_timeout=1.5 * timeout)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        if not self.body:
            return {}
        return json.loads(self.body)


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, payload: Any) -> Response:
        return cls(status, (json.dumps(payload, sort_keys=True) + "\n").encode())


Handler = Callable[[Request], Response]
# Looks at a request's line and headers (no body yet): a refusal, or None to go on.
Guard = Callable[[Request], Response | None]


def body_length(method: str, headers: dict[str, str], limit: int) -> int | Response:
    """The body's length from the headers, or the refusal to send."""
    if "transfer-encoding" in headers:
        return Response.json(411, {"error": "chunked bodies are not accepted; send Content-Length"})
    text = headers.get("content-length")
    if text is None:
        if method == "POST":
            return Response.json(411, {"error": "Content-Length is required"})
        return 0
    text = text.strip()
    # int() would take "+5", " 5", "5_0" and "٥"; HTTP takes ASCII digits only.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return Response.json(400, {"error": "Content-Length must be a non-negative integer"})
    length = int(text)
    if length > limit:
        return Response.json(413, {"error": f"request body too large (limit {limit} bytes)"})
    return length


SCRAPE: tuple[str, str] = ("GET", "/metrics")


class _BoundedHTTPServer(HTTPServer):
    """One daemon thread per connection, at most `limits.max_connections` at
    once (`limits.per_client` of one address), and one more for a scrape."""

    daemon_threads = True
    # The accept loop answers an excess connection at once: a flood drains from
    # the kernel's queue instead of keeping everyone else's connect() waiting.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, limits: ServerLimits) -> None:
        self.limits = limits
        self.refused_connections = 0
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._scrape_slot = threading.Lock()
        self._scrape_only: set[socket.socket] = set()
        self._clients: Counter[str] = Counter()
        self._clients_lock = threading.Lock()
        # Sockets of handlers still reading a request → when to cut them off.
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        self._deadlines_changed = threading.Condition(self._deadlines_lock)
        self._closing = threading.Event()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if client_address else ""
        with self._clients_lock:
            if self._clients[client] >= self.limits.per_client:
                full = True
            else:
                full = False
                self._clients[client] += 1
        if full:
            self._refuse(request, b"too many connections from this address; retry")
            return
        scrape_only = False
        if not self._slots.acquire(blocking=False):
            scrape_only = self._scrape_slot.acquire(blocking=False)
            if not scrape_only and not self._slots.acquire(timeout=self.limits.queue_seconds):
                self._left(client)
                self._refuse(request)
                return
        if scrape_only:
            self._scrape_only.add(request)
        try:
            threading.Thread(
                target=self._serve_connection,
                args=(request, client_address, client, scrape_only),
                name="vllm-runbook-agent-conn",
                daemon=True,
            ).start()
        except RuntimeError:  # cannot start a thread: drop this client, keep serving
            self._release(request, client, scrape_only)
            self.shutdown_request(request)

    def scrape_only(self, sock: socket.socket) -> bool:
        """Whether `sock` holds the scrape slot: one GET /metrics, nothing else."""
        return sock in self._scrape_only

    def _left(self, client: str) -> None:
        with self._clients_lock:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]

    def _release(self, request: socket.socket, client: str, scrape_only: bool) -> None:
        if scrape_only:
            self._scrape_only.discard(request)
            self._scrape_slot.release()
        else:
            self._slots.release()
        self._left(client)

    def _serve_connection(
        self, request: Any, client_address: Any, client: str, scrape_only: bool
    ) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.disarm(request)
            self.shutdown_request(request)
            self._release(request, client, scrape_only)

    def _refuse(
        self, request: socket.socket, message: bytes = b"too many connections; retry"
    ) -> None:
        self.refused_connections += 1
        body = b'{"error": "' + message + b'"}\n'
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.settimeout(0.2)
            request.sendall(head.encode() + body)
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to the engine's stderr.
        logger.debug("vllm-runbook agent: connection from %s failed", client_address, exc_info=True)

    # -- request deadlines ------------------------------------------------------

    def arm(self, sock: socket.socket) -> None:
        with self._deadlines_changed:
            self._deadlines[sock] = time.monotonic() + self.limits.request_timeout
            self._deadlines_changed.notify()

    def disarm(self, sock: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(sock, None)

    def reap_forever(self) -> None:
        """Shut down sockets whose request did not arrive in time: their
        handler's blocked read returns at once. Sleeps until the earliest
        deadline, and without a timeout while none is armed: a thread that
        wakes on a timer takes the GIL from the engine's step each time (on a
        busy machine a forced GIL switch can cost the step a time slice)."""
        while True:
            with self._deadlines_changed:
                if self._closing.is_set():
                    return
                if not self._deadlines:
                    self._deadlines_changed.wait()
                    continue
                now = time.monotonic()
                earliest = min(self._deadlines.values())
                if earliest > now:
                    self._deadlines_changed.wait(earliest - now)
                    continue
                late = [s for s, deadline in self._deadlines.items() if deadline <= now]
                for sock in late:
                    del self._deadlines[sock]
            for sock in late:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        with self._deadlines_changed:
            self._closing.set()
            self._deadlines_changed.notify_all()
        super().server_close()


class AgentServer:
    """Serves `routes` ((METHOD, path) → handler) plus GET /metrics of `registry`.
    A route in `guards` is refused before its body is read when its guard says so."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        before_scrape: Callable[[], None] | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.registry = registry
        self.before_scrape = before_scrape
        self.limits = limits or ServerLimits()
        self.routes: dict[tuple[str, str], Handler] = {("GET", "/metrics"): self._metrics}
        self.guards: dict[tuple[str, str], Guard] = {}
        self._httpd = _BoundedHTTPServer((host, port), self._handler_class(), self.limits)
        address = self._httpd.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread = threading.Thread(
            # No poll timer (see reap_forever): select() sleeps until a client
            # connects; close() wakes it with a connection of its own.
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": None},
            name="vllm-runbook-agent",
            daemon=True,
        )
        self._reaper = threading.Thread(
            target=self._httpd.reap_forever, name="vllm-runbook-agent-reaper", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def refused_connections(self) -> int:
        """Connections answered 503 because every handler slot was busy, or
        their client address held its share of them."""
        return self._httpd.refused_connections

    def start(self) -> AgentServer:
        self._thread.start()
        self._reaper.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            # shutdown() waits for serve_forever's loop, asleep in select() until
            # a connection comes: knock until it has seen the request to stop.
            stopper = threading.Thread(target=self._httpd.shutdown, daemon=True)
            stopper.start()
            while stopper.is_alive():
                with contextlib.suppress(OSError):
                    socket.create_connection((self.host, self.port), timeout=0.5).close()
                stopper.join(0.05)
        self._httpd.server_close()

    def _metrics(self, request: Request) -> Response:
        if self.before_scrape is not None:
            self.before_scrape()
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        names = request.query.get("name[]")
        # `name[]=...`: only those samples, as prometheus_client's own exposition does
        registry = OnlySamples(self.registry, names) if names else self.registry
        return Response(200, encoder(registry), content_type)

    def route(self, method: str, path: str) -> Handler | Response:
        """The handler for (method, path), or the 404/405 to answer."""
        handler = self.routes.get((method, path))
        if handler is not None:
            return handler
        allowed = [m for (m, p) in self.routes if p == path]
        if allowed:
            return Response.json(405, {"error": f"method not allowed; use {allowed[0]}"})
        return Response.json(404, {"error": f"no such path: {path}"})

    def guard(self, request: Request) -> Response | None:
        check = self.guards.get((request.method, request.path))
        return check(request) if check is not None else None

    def dispatch(self, request: Request) -> Response:
        handler = self.route(request.method, request.path)
        if isinstance(handler, Response):
            return handler
        refusal = self.guard(request)
        if refusal is not None:
            return refusal
        try:
            return handler(request)
        except Exception:  # a bug in a handler must not kill the server thread
            logger.exception("vllm-runbook agent: handler for %s failed", request.path)
            return Response.json(500, {"error": "internal error (see engine log)"})

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self
        httpd_limits = self.limits

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "vllm-runbook-agent"
            # HTTP/0.9 answers have no status line: a garbled request line gets a real 400.
            default_request_version = "HTTP/1.1"
            timeout = httpd_limits.idle_timeout  # socket timeout for every read and write
            # An answer is two writes (head, body): with Nagle's algorithm the body
            # waits for the client's delayed ACK of the head, ~40 ms per answer.
            disable_nagle_algorithm = True

            def handle_one_request(self) -> None:
                server._httpd.arm(self.connection)
                try:
                    super().handle_one_request()
                except OSError:  # reset, timed out, cut off at the deadline
                    self.close_connection = True
                finally:
                    server._httpd.disarm(self.connection)

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                head = Request(
                    method=method,
                    path=parts.path.rstrip("/") or "/",
                    query=parse_qs(parts.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=b"",
                )
                if server._httpd.scrape_only(self.connection):
                    # The slot kept for scrapes: one GET /metrics, then closed.
                    self.close_connection = True
                    if (head.method, head.path) != SCRAPE:
                        busy = Response.json(503, {"error": "too many connections; retry"})
                        busy.headers = {"Retry-After": "1", "Connection": "close"}
                        self._send(busy)
                        return
                handler = server.route(head.method, head.path)
                if isinstance(handler, Response):
                    self._refuse(handler, head)
                    return
                refusal = server.guard(head)  # before a byte of the body is read
                if refusal is not None:
                    self._refuse(refusal, head)
                    return
                declared = {v.strip() for v in self.headers.get_all("content-length") or []}
                if len(declared) > 1:
                    self._refuse(Response.json(400, {"error": "conflicting Content-Length"}), head)
                    return
                length = body_length(method, head.headers, httpd_limits.max_body_bytes)
                if isinstance(length, Response):
                    self._refuse(length, head)
                    return
                body = self.rfile.read(length) if length else b""
                if len(body) < length:  # the client went away or was cut off
                    self.close_connection = True
                    return
                # The request is in: a handler may take long (a control command
                # waits for a step boundary) and must not be cut off.
                server._httpd.disarm(self.connection)
                try:
                    response = handler(replace(head, body=body))
                except Exception:  # a bug in a handler must not kill the server thread
                    logger.exception("vllm-runbook agent: handler for %s failed", head.path)
                    response = Response.json(500, {"error": "internal error (see engine log)"})
                self._send(response)

            def _refuse(self, response: Response, head: Request) -> None:
                # An unread body would be parsed as the next request: close.
                if "content-length" in head.headers or "transfer-encoding" in head.headers:
                    self.close_connection = True
                    response.headers = {**response.headers, "Connection": "close"}
                self._send(response)

            def _send(self, response: Response) -> None:
                self.send_response(response.status)
                self.send_header("Content-Type", response.content_type)
                self.send_header("Content-Length", str(len(response.body)))
                for name, value in response.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(response.body)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no per-request log lines in the engine's log

        return _Handler
