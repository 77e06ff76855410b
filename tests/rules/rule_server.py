"""A real HTTP server on loopback whose answers the test sets, path by path."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, bytes]


class Routes:
    def __init__(self) -> None:
        self.answers: dict[str, Answer | Callable[[], Answer]] = {}
        self.hits: dict[str, int] = {}
        self.url = ""

    def text(self, path: str, body: str | Callable[[], str], status: int = 200) -> None:
        if callable(body):
            fn = body
            self.answers[path] = lambda: (status, fn().encode())
        else:
            self.answers[path] = (status, body.encode())

    def json(self, path: str, doc: Any, status: int = 200) -> None:
        self.answers[path] = (status, json.dumps(doc).encode())


@contextlib.contextmanager
def serve() -> Iterator[Routes]:
    routes = Routes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            routes.hits[path] = routes.hits.get(path, 0) + 1
            answer = routes.answers.get(path, (404, b"not found\n"))
            status, body = answer() if callable(answer) else answer
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    routes.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield routes
    finally:
        httpd.shutdown()
        httpd.server_close()
