"""The `runbook` command's exit codes, defined once, and the base of the errors that carry one.

Every command returns an `ExitCode`; every error that ends a command on purpose
is a `RunbookError` whose `exit_code` says which, and the CLI's one `main`
prints its one line and returns that code. docs/cli.md's table is generated
from `ExitCode` (`python -m tools.docs`; a test fails while
it is stale).

Standard library only: the executor, the engine client and the store import
this, and so does everything that imports them.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """What a `runbook` command's exit status means: one meaning per number."""

    meaning: str

    def __new__(cls, value: int, meaning: str) -> ExitCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = (
        0,
        "done: the command did what was asked (also a dry run, every check passed or n/a, "
        "a decision recorded)",
    )
    FAILED = (
        1,
        "ran, but the outcome is not the one asked for: an execution that failed or was "
        "rolled back, a failed production check, an approval answered too late (expired, "
        "the alert resolved, already decided), no signal history for `runbook report`'s "
        "picture, a demo whose story did not happen",
    )
    USAGE = (
        2,
        "refused before anything changed: a usage error (bad argument, malformed URL, a file "
        "that is not UTF-8 text, a token a header cannot carry, an unknown runbook or "
        "execution id), a broken catalog or configuration, a value out of the engine's bounds, "
        "or a guardrail's refusal",
    )
    ENGINE = (
        3,
        "the engine's agent cannot be used: unreachable (refused, no answer within "
        "`--timeout`, a truncated answer), not an agent (the URL answers, but not as a "
        "vllm-runbook agent does), or authentication failed",
    )
    STORE = (
        4,
        "the journal's database cannot be used: down, locked, not migrated (run `runbook db "
        "upgrade`), at an unknown revision, or a file that is not a database",
    )
    SERVICE = (
        5,
        "the service (`runbook top --server URL`) cannot be used: unreachable, not a "
        "`runbook serve`, or it refused the credentials",
    )
    INTERRUPTED = (
        130,
        "interrupted (Ctrl-C, SIGTERM); every process the command started is stopped "
        "(128 + SIGINT, the shell's convention)",
    )


class RunbookError(Exception):
    """Base of the errors that end a command on purpose; `exit_code` is the code it ends with."""

    exit_code: ClassVar[ExitCode] = ExitCode.FAILED
