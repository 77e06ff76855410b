"""What an execution (or a revert) ends with: exit codes, the result, and
the errors that end one early.

The bottom of the executor's modules: outcome <- guardrails <- revert <-
executor (revert only names the executor's types, for mypy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from vllm_runbook.runbooks.client import (
    AuthFailed,
    CommandRefused,
    EngineClientError,
    EngineUnreachable,
)
from vllm_runbook.runbooks.store import ExecutionRecord

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # the execution failed or was rolled back
EXIT_REFUSED: Final = 2  # a guardrail or the engine's bounds said no
EXIT_ENGINE: Final = 3  # engine unreachable or authentication failed
EXIT_STORE: Final = 4  # the journal's database is unavailable (raised, mapped by the CLI)


class UnknownRunbook(LookupError):
    """No runbook of that name in the catalog."""


class EngineBusy(Exception):
    """Another live execution holds the engine's lock."""


@dataclass(frozen=True)
class ExecutionResult:
    """What happened, for the CLI and the service."""

    record: ExecutionRecord
    exit_code: int
    # One line for a person when the run did not succeed (refusal, error).
    message: str | None = None
    # False when an alert episode had already been executed (nothing done now).
    created: bool = True
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Stable JSON for `--json` and the service's API (keys only ever added)."""
        return {
            "execution": self.record.to_dict(),
            "exit_code": self.exit_code,
            "message": self.message,
            "created": self.created,
            "warnings": list(self.warnings),
        }


class Abort(Exception):
    """Ends an execution early with a final status, exit code and message."""

    def __init__(self, status: str, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.exit_code = exit_code
        self.message = message


def engine_error_exit(error: EngineClientError) -> int:
    """The exit code for an engine error: 3 unreachable/auth, 2 refused, else 1."""
    if isinstance(error, EngineUnreachable | AuthFailed):
        return EXIT_ENGINE
    if isinstance(error, CommandRefused):
        return EXIT_REFUSED
    return EXIT_FAILED


def one_line(error: BaseException) -> str:
    """An error as one line for the journal and the terminal."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
