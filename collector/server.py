"""The agent's HTTP endpoint inside the engine process: /metrics (and routes
added by the control plane).

A stdlib ThreadingHTTPServer on a daemon thread: no event loop to share with
vLLM, nothing to install, and a slow client never blocks the scheduler.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger("vllm_runbook.collector")

MAX_BODY_BYTES = 64 * 1024


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


class AgentServer:
    """Serves `routes` ((METHOD, path) → handler) plus GET /metrics of `registry`."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        before_scrape: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.before_scrape = before_scrape
        self.routes: dict[tuple[str, str], Handler] = {("GET", "/metrics"): self._metrics}
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        address = self._httpd.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="vllm-runbook-agent", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> AgentServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _metrics(self, request: Request) -> Response:
        if self.before_scrape is not None:
            self.before_scrape()
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(200, encoder(self.registry), content_type)

    def dispatch(self, request: Request) -> Response:
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            allowed = [m for (m, p) in self.routes if p == request.path]
            if allowed:
                return Response.json(405, {"error": f"method not allowed; use {allowed[0]}"})
            return Response.json(404, {"error": f"no such path: {request.path}"})
        try:
            return handler(request)
        except Exception:  # a bug in a handler must not kill the server thread
            logger.exception("vllm-runbook agent: handler for %s failed", request.path)
            return Response.json(500, {"error": "internal error (see engine log)"})

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "vllm-runbook-agent"

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("content-length") or 0)
                if length > MAX_BODY_BYTES:
                    self._send(Response.json(413, {"error": "request body too large"}))
                    return
                body = self.rfile.read(length) if length else b""
                request = Request(
                    method=method,
                    path=parts.path.rstrip("/") or "/",
                    query=parse_qs(parts.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                self._send(server.dispatch(request))

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
