"""The one process helper of the demo, the tests and the benchmarks, on real
short-lived children: Python's http.server started, waited for and stopped."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from vllm_runbook.runbooks.demo.servers import (
    NotReady,
    ProcessExited,
    free_port,
    http_ok,
    log_tail,
    logged_process,
    start_logged,
    stop_group,
    wait_http,
)

SERVER = """\
import functools, http.server, signal, sys
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
print("serving", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
"""


def http_server(port: int, directory: Path, ignore_term: bool = False) -> list[str]:
    """Python's http.server on 127.0.0.1:`port`; with `ignore_term` it ignores SIGTERM."""
    script = directory / "server.py"
    script.write_text(SERVER)
    mode = "ignore-term" if ignore_term else "-"
    return [sys.executable, str(script), str(port), str(directory), mode]


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_started_waited_for_and_stopped_with_its_children(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    (tmp_path / "index.html").write_text("hello")
    child_pid = tmp_path / "child.pid"
    # A shell that leaves a child behind, then becomes the server: stopping the
    # group must stop the child too.
    server = shlex.join(http_server(port, tmp_path))
    cmd = ["sh", "-c", f"sleep 300 & echo $! > {shlex.quote(str(child_pid))}; exec {server}"]
    proc = start_logged(cmd, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/index.html", 60, proc, log)
        assert proc.poll() is None
        assert http_ok(f"http://127.0.0.1:{port}/index.html")
        assert not http_ok(f"http://127.0.0.1:{port}/missing.html")  # 404 is not ready
        assert os.getpgid(proc.pid) == proc.pid  # its own process group
        sleeper = int(child_pid.read_text())
        assert os.getpgid(sleeper) == proc.pid
    finally:
        stop_group(proc, 20)
    assert proc.returncode == -signal.SIGTERM
    assert refused(port)
    # SIGTERM reached the whole group; the orphaned sleep is reaped by init.
    deadline = time.monotonic() + 30
    while not gone(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(sleeper)
    assert "serving" in log.read_text()
    stop_group(proc)  # stopping a stopped process is a no-op


def test_a_process_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "stubborn.log"
    proc = start_logged(http_server(port, tmp_path, ignore_term=True), log)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 60, proc, log)
    finally:
        stop_group(proc, timeout=1)
    assert proc.returncode == -signal.SIGKILL


def test_a_process_that_dies_at_once_is_a_clear_error_with_its_log_tail(
    tmp_path: Path,
) -> None:
    log = tmp_path / "dies.log"
    code = "import sys; print('x' * 5000); print('bad config: no such model'); sys.exit(3)"
    url = f"http://127.0.0.1:{free_port()}/health"
    proc = start_logged([sys.executable, "-c", code], log)
    with pytest.raises(ProcessExited) as info:
        wait_http(url, 600, proc, log)
    exc = info.value
    assert exc.returncode == 3 and exc.log_path == log
    message = str(exc)
    first = message.splitlines()[0]
    assert first.startswith("`python")
    assert first.endswith(f"exited with 3 before {url} answered; the end of {log}:")
    assert message.endswith("bad config: no such model\n")
    assert exc.tail == log.read_text()[-4000:]
    assert len(exc.tail) == 4000


def test_logged_process_raises_the_exit_and_keeps_the_log(tmp_path: Path) -> None:
    log = tmp_path / "dies.log"
    cmd = [sys.executable, "-c", "import sys; print('port in use'); sys.exit(1)"]
    with (
        pytest.raises(ProcessExited, match=r"exited with 1 .*\nport in use\n$"),
        logged_process(cmd, log, f"http://127.0.0.1:{free_port()}/", 600),
    ):
        pytest.fail("yielded a process that never answered")
    assert log.read_text() == "port in use\n"


def test_a_process_that_never_answers_times_out_and_is_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log, pid_file = tmp_path / "silent.log", tmp_path / "silent.pid"
    code = (
        "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
        "print('starting', flush=True); time.sleep(600)"
    )
    url = f"http://127.0.0.1:{free_port()}/"
    with (
        pytest.raises(NotReady, match=r"did not answer within 5 s"),
        logged_process([sys.executable, "-c", code, str(pid_file)], log, url, 5),
    ):
        pytest.fail("yielded a process that never answered")
    assert capfd.readouterr().err == "starting\n"  # the log's tail, for the failing test
    assert log.read_text() == "starting\n"
    assert gone(int(pid_file.read_text()))  # stopped and reaped


def test_logged_process_stops_the_group_after_the_block(tmp_path: Path) -> None:
    port = free_port()
    with logged_process(
        http_server(port, tmp_path), tmp_path / "ok.log", f"http://127.0.0.1:{port}/", 60
    ) as proc:
        assert proc.poll() is None
    assert proc.returncode == -signal.SIGTERM
    assert refused(port)


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"a" * 10 + b"bcd")
    assert log_tail(log, 3) == "bcd"
    assert log_tail(log, 100) == "a" * 10 + "bcd"
    assert log_tail(tmp_path / "missing.log") == ""
