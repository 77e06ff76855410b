"""Which process wrote a journal row, and whether it still runs.

A row that says `running` is only true while the process that wrote it
lives. The store stamps each execution with this host's name, the pid and
the process's start time; the start time tells a live process from a later
one that reused the pid.
"""

from __future__ import annotations

import os
import socket
from typing import Final

import psutil

HOSTNAME: Final = socket.gethostname()

# The `pid_start` column holds the start time in clock ticks since boot (the
# unit of /proc/PID/stat's `starttime`, what earlier versions stored).
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _start_ticks(process: psutil.Process) -> int:
    # create_time() is the boot time plus the ticks since boot, both read
    # now; taking the boot time off again gives a number a wall-clock step
    # between writing the row and checking it does not change.
    return round((process.create_time() - psutil.boot_time()) * _CLOCK_TICKS)


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot); None when unreadable."""
    try:
        return _start_ticks(psutil.Process(pid))
    except (psutil.Error, ValueError):
        return None


def process_alive(pid: int, pid_start: int | None) -> bool:
    """Whether the process that wrote a row is still running on this host.

    A zombie is dead (it runs nothing), and a live pid with another start time
    is a different process that reused the number. A process this user may
    not inspect counts as alive: it exists, and nothing says it is another.
    """
    if pid < 1:
        return False  # not a process id (a journal row always holds one)
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        current = None if pid_start is None else _start_ticks(process)
    except psutil.NoSuchProcess:  # includes ZombieProcess
        return False
    except psutil.AccessDenied:
        return True
    return current is None or current == pid_start
