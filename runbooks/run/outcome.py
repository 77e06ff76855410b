"""What an execution (or a revert) ends with: the result (its exit code from
exit_codes.py) and the errors that end one early.

The bottom of the executor's modules: outcome <- guardrails <- revert <-
executor (revert only names the executor's types, for mypy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.store import ExecutionRecord


class UnknownRunbook(RunbookError, LookupError):
    """No runbook of that name in the catalog."""

    exit_code = ExitCode.USAGE


class EngineBusy(Exception):
    """Another live execution holds the engine's lock."""


@dataclass(frozen=True)
class ExecutionResult:
    """What happened, for the CLI and the service."""

    record: ExecutionRecord
    exit_code: ExitCode
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

    def __init__(self, status: str, exit_code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.exit_code = exit_code
        self.message = message


def one_line(error: BaseException) -> str:
    """An error as one line for the journal and the terminal."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class EngineGone(Abort):
    """The engine left the inventory while its execution ran: it ends there,
    failed, and nothing is reverted on an engine that no longer exists."""

    def __init__(self, message: str) -> None:
        super().__init__("failed", ExitCode.ENGINE, message)
