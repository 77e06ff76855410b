"""Prometheus discovery's credentials are sent, on the wire, as Prometheus' own
clients send them: a bearer token from its file, basic auth from a username and
a password file, and TLS verified against `ca_file` (a self-signed server is
refused without it). A loopback HTTP(S) server stands in for Prometheus'
/api/v1/targets and records what each request carried."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.runbooks.model.config import PrometheusDiscovery
from vllm_runbook.runbooks.service.discovery import DiscoveryError, PrometheusSD

TARGETS = {
    "status": "success",
    "data": {
        "activeTargets": [
            {
                "scrapeUrl": "http://127.0.0.1:9360/metrics",
                "labels": {"job": "agents", "instance": "127.0.0.1:9360", "pod": "p-0"},
            }
        ]
    },
}


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]]

    def do_GET(self) -> None:
        self.seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
        body = json.dumps(TARGETS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(context: ssl.SSLContext | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    handler = type("Handler", (Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    scheme = "http"
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://localhost:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    yield from serve()


@pytest.fixture
def tls_prometheus(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]], Path]]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is needed to make the test's certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    for url, seen in serve(context):
        yield url, seen, cert


def source(url: str, **auth: Any) -> PrometheusSD:
    config = {"url": url, "jobs": ["agents"], **auth}
    return PrometheusSD(PrometheusDiscovery.model_validate(config))


def test_bearer_token_file_is_sent(
    prometheus: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = prometheus
    (tmp_path / "token").write_text("s3cret-token\n")
    [engine] = source(url, bearer_token_file=str(tmp_path / "token")).read()
    assert engine.name == "127.0.0.1:9360" and engine.labels["pod"] == "p-0"
    expected = {"path": "/api/v1/targets?state=active", "authorization": "Bearer s3cret-token"}
    assert seen == [expected]


def test_basic_auth_from_username_and_password_file(
    prometheus: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = prometheus
    (tmp_path / "password").write_text("pa:ss wörd\n")
    source(url, username="ops", password_file=str(tmp_path / "password")).read()
    expected = base64.b64encode("ops:pa:ss wörd".encode()).decode()
    assert [s["authorization"] for s in seen] == [f"Basic {expected}"]


def test_no_credentials_sends_none(prometheus: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = prometheus
    source(url).read()
    assert [s["authorization"] for s in seen] == [None]


def test_tls_verified_against_ca_file(
    tls_prometheus: tuple[str, list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    url, seen, cert = tls_prometheus
    (tmp_path / "token").write_text("tls-token\n")
    [engine] = source(url, ca_file=str(cert), bearer_token_file=str(tmp_path / "token")).read()
    assert engine.name == "127.0.0.1:9360"
    assert [s["authorization"] for s in seen] == ["Bearer tls-token"]
    # Without the CA, the self-signed server is refused: nothing was asked of it.
    with pytest.raises(DiscoveryError, match="certificate verify failed"):
        source(url).read()
    assert len(seen) == 1


def test_unreadable_credentials_are_a_discovery_error(
    prometheus: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = prometheus
    with pytest.raises(DiscoveryError, match="bearer_token_file"):
        source(url, bearer_token_file=str(tmp_path / "missing")).read()
    with pytest.raises(DiscoveryError, match="ca_file"):
        source(url, ca_file=str(tmp_path / "missing.pem")).read()
    assert seen == []
