"""Every door of the `runbook` CLI fed what users and networks really send:
malformed URLs, servers that are not agents, HTML, empty and truncated
bodies, slow servers, wrong tokens, a database file that is not SQLite.
Each ends in one line on stderr and the documented exit code."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_runbook.runbooks.engine.client import CommandRefused, EngineClient, normalize_url
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.store import upgrade


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    declared_length: int | None = None  # lie about the length (truncated body)
    delay_s: float = 0.0


class FakeServer:
    """A loopback HTTP server answering every request with `answer`."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                server.requests.append((self.command, self.path))
                a = server.answer
                if a.delay_s:
                    time.sleep(a.delay_s)
                self.send_response(a.status)
                self.send_header("Content-Type", a.content_type)
                declared = a.declared_length if a.declared_length is not None else len(a.body)
                self.send_header("Content-Length", str(declared))
                if a.declared_length is not None:
                    self.send_header("Connection", "close")
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(a.body)
                if a.declared_length is not None:
                    self.close_connection = True

            do_GET = do_POST = _reply

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'runbook.db'}"
    upgrade(url)
    return url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def assert_one_line(err: str) -> None:
    assert err.startswith("runbook:") and err.count("\n") == 1, err
    assert "Traceback" not in err


def engine_doors(url: str, db: str, timeout: str = "20") -> list[list[str]]:
    """Every command that talks to an engine's agent, pointed at `url`."""
    return [
        ["status", "--engine", url, "--token", "t", "--timeout", timeout],
        ["set", "--engine", url, "--token", "t", "--timeout", timeout, "max_num_seqs=2"],
        ["restore", "--engine", url, "--token", "t", "--timeout", timeout],
        [
            *("exec", "oom-pressure", "--engine", url, "--token", "t", "--dry-run"),
            *("--db", db, "--timeout", timeout, "--poll-seconds", "0"),
        ],
        ["tune", "--engine", url, "--token", "t", "--timeout", timeout, "--db", db],
    ]


NOT_AN_AGENT = {
    "json object": Answer(body=b'{"hello": "world"}'),
    "json list": Answer(body=b"[1, 2]"),
    "json string": Answer(body=b'"agent"'),
    "almost a state": Answer(body=b'{"engine": {"model_name": "m"}, "knobs": {}}'),
    "vllm's /v1/models": Answer(body=b'{"object": "list", "data": [{"id": "m"}]}'),
    "html": Answer(body=b"<!doctype html><h1>hi</h1>", content_type="text/html"),
    "empty body": Answer(body=b""),
    "not utf-8": Answer(body=b"\xff\xfe{}"),
    "truncated body": Answer(body=b'{"engine": {', declared_length=100),
    "500 with a list": Answer(status=500, body=b"[1]"),
    "502 with html": Answer(status=502, body=b"<html>bad gateway</html>", content_type="text/html"),
    "422 without an error": Answer(status=422, body=b'{"detail": []}'),
    "redirect": Answer(status=302, body=b""),
    "slow": Answer(body=b"{}", delay_s=1.5),
}


@pytest.mark.parametrize("case", sorted(NOT_AN_AGENT))
def test_a_server_that_is_not_an_agent_is_exit_3_in_one_line(
    case: str, fake: FakeServer, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.answer = NOT_AN_AGENT[case]
    for argv in engine_doors(fake.url, db, timeout="0.5" if case == "slow" else "20"):
        code, err = run(capsys, *argv)
        assert code == ExitCode.ENGINE, (argv[0], err)
        assert_one_line(err)
        if case == "slow":
            assert "no answer within 0.5 s" in err


def test_wrong_token_is_exit_3(
    fake: FakeServer, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.answer = Answer(status=401, body=b'{"error": "missing or wrong bearer token"}\n')
    for argv in engine_doors(fake.url, db):
        code, err = run(capsys, *argv)
        assert code == ExitCode.ENGINE and "refused the token" in err, (argv[0], err)
        assert_one_line(err)


def test_an_agent_error_message_stays_one_line(
    fake: FakeServer, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.answer = Answer(status=422, body=json.dumps({"error": "too\nmany\r\nlines"}).encode())
    code, err = run(capsys, "set", "--engine", fake.url, "--token", "t", "max_num_seqs=2")
    assert code == ExitCode.USAGE and "too many lines" in err
    assert_one_line(err)


MALFORMED_URLS = [
    "http://[::1",
    "http://[::1]:99999",
    "http://127.0.0.1:abc",
    "http://127.0.0.1:-1",
    "ftp://127.0.0.1",
    "http://",
    "http:// 127.0.0.1",
    "http://127.0.0.1:9\n360",
    "",
]


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_malformed_urls_are_usage_errors(
    url: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in engine_doors(url, db):
        code, err = run(capsys, *argv)
        assert code == ExitCode.USAGE, (argv[0], url, err)
        assert_one_line(err)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_url_text_is_accepted_or_refused_as_a_usage_error(text: str) -> None:
    # No request is sent: only what the client makes of the text.
    try:
        url = normalize_url(text)
        client = EngineClient(text, token="t")
    except CommandRefused:
        return
    assert client.url == url and url.startswith(("http://", "https://"))


def test_tokens_a_header_cannot_carry_are_usage_errors(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    for token in ("two words", "naïve", "line\nbreak"):
        code, err = run(capsys, "status", "--engine", fake.url, "--token", token)
        assert code == ExitCode.USAGE
        assert_one_line(err)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["engine", "knobs", "stats", "error", "dry_run", "changes", "x"]),
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    ),
    st.sampled_from([200, 400, 404, 422, 500, 503]),
)
def test_any_json_answer_ends_in_one_line_and_a_documented_code(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], payload: Any, status: int
) -> None:
    fake.answer = Answer(status=status, body=json.dumps(payload).encode())
    for argv in (
        ["status", "--engine", fake.url, "--token", "t"],
        ["set", "--engine", fake.url, "--token", "t", "policy=fcfs"],
    ):
        code, err = run(capsys, *argv)
        assert code in (1, 2, 3), err
        assert_one_line(err)


def test_engines_file_that_is_not_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("engines.txt", "engines.yaml"):
        path = tmp_path / name
        path.write_bytes(b"\xff\xfe\x00binary")
        code, err = run(capsys, "status", "--engines-file", str(path))
        assert code == ExitCode.USAGE and "not UTF-8" in err
        assert_one_line(err)


def test_config_that_is_not_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runbook.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    code, err = run(capsys, "rules", "export", "--config", str(path))
    assert code == ExitCode.USAGE
    assert_one_line(err)


def test_database_file_that_is_not_sqlite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runbook.db"
    path.write_bytes(b"this is not a database\n" * 200)
    url = f"sqlite:///{path}"
    for argv in (
        ["history", "--db", url],
        ["history", "1", "--db", url],
        ["report", "1", "--db", url],
        ["db", "upgrade", "--db", url],
        ["exec", "oom-pressure", "--engine", "http://127.0.0.1:9", "--dry-run", "--db", url],
        ["revert", "1", "--db", url],
    ):
        code, err = run(capsys, *argv)
        assert code == ExitCode.STORE and "file is not a database" in err, (argv, err)
        assert_one_line(err)
    assert path.read_bytes() == b"this is not a database\n" * 200  # left as it was


def test_the_first_departure_from_the_agents_model_is_named(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    hint = "is the URL the agent's (VLLM_RUNBOOK_PORT), not vLLM's API server?"
    for body, where in (
        (b'{"engine": {"model_name": "m"}, "knobs": {}}', "engine.engine: Field required"),
        (b"[1, 2]", "Input should be a valid dictionary or instance of AgentState"),
    ):
        fake.answer = Answer(body=body)
        code, err = run(capsys, "status", "--engine", fake.url, "--token", "t")
        assert (code, err) == (
            ExitCode.ENGINE,
            f"runbook: error: {fake.url} does not answer like a vllm-runbook agent ({where}): "
            f"{hint}\n",
        )


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("policy=lifo", "policy must be one of fcfs, priority, tiered, got 'lifo'"),
        ("max_num_batched_tokens=x2", "scale_max_num_batched_tokens must be in (0, 1], got 2.0"),
    ],
)
def test_a_bad_value_is_refused_before_anything_is_sent(
    assignment: str, message: str, fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # The client builds its command with the agent's model: the agent's own message, exit 2.
    sent = len(fake.requests)
    code, err = run(capsys, "set", "--engine", fake.url, "--token", "t", assignment)
    assert (code, err) == (ExitCode.USAGE, f"runbook: error: {message}\n")
    assert len(fake.requests) == sent
