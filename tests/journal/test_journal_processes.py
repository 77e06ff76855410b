"""Process liveness for the journal: real child processes, no mocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_runbook.runbooks.store import Execution, Journal, process_alive, process_start


def _stat_starttime(pid: int) -> int:
    # The oracle: field 22 of /proc/PID/stat, the unit earlier versions
    # stored in `pid_start` (rows they wrote must still compare equal).
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_start_time_is_clock_ticks_since_boot() -> None:
    child = _sleeper()
    try:
        assert process_start(child.pid) == _stat_starttime(child.pid)
        assert process_start(os.getpid()) == _stat_starttime(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None  # reaped: nothing to read


def test_live_child_is_alive_and_a_reused_pid_is_not() -> None:
    child = _sleeper()
    try:
        start = process_start(child.pid)
        assert start is not None
        assert process_alive(child.pid, start) is True
        assert process_alive(child.pid, None) is True  # no stamp: the pid decides
        # The same pid with another start time is another process.
        assert process_alive(child.pid, start + 1) is False
        assert process_alive(child.pid, start - 1) is False
    finally:
        child.kill()
        child.wait()


def test_exited_child_is_not_alive() -> None:
    child = _sleeper()
    start = process_start(child.pid)
    child.kill()
    # Dead but not yet reaped: a zombie runs nothing.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert process_alive(child.pid, start) is False
    child.wait()  # reaped: the pid is gone
    assert process_alive(child.pid, start) is False
    assert process_alive(child.pid, None) is False


def test_rows_carry_this_process_start(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    record, _ = store.create_execution("warmup", "e", trigger="cli", who="me")
    store.transition(record.id, "running")
    with store.session() as s:
        row = s.get(Execution, record.id)
        assert row is not None
        assert (row.pid, row.pid_start) == (os.getpid(), _stat_starttime(os.getpid()))
        # Another start time on this pid: the row's process is gone.
        row.pid_start = _stat_starttime(os.getpid()) + 1
    assert store.get_execution(record.id).interrupted is True
    assert store.recover_interrupted() == [record.id]
    store.close()
