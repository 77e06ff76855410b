"""The store's exception tree, drawn once.

    StoreError                  (STORE)  e.g. a database at an unknown revision
    ├── StoreUnavailable        (STORE)  cannot be reached, opened or locked
    │   └── SchemaMissing       (STORE)  reachable, but `runbook db upgrade` has not run
    ├── IllegalTransition       (STORE)  a status change the execution state machine forbids
    ├── ExecutionNotFound       (USAGE)  no execution with that id (also a LookupError)
    └── InvalidInput            (USAGE)  a value the journal does not take (also a ValueError)

Each carries the CLI's exit code (exit_codes.py). Callers map the branch, not
the driver: the service answers 5xx on StoreUnavailable so Alertmanager
retries; InvalidInput is the person's mistake (HTTP 422). No SQLAlchemy or
driver exception leaves the store's public API.
"""

from __future__ import annotations

from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError


class StoreError(RunbookError):
    """Base of every error the store raises on purpose."""

    exit_code = ExitCode.STORE


class StoreUnavailable(StoreError):
    """The database cannot be reached, opened or locked right now (retryable)."""


class SchemaMissing(StoreUnavailable):
    """The database answers but has no (or an old) runbook schema."""


class IllegalTransition(StoreError):
    """An execution was asked to move to a status its current one cannot reach."""

    def __init__(self, execution_id: int, current: str, requested: str) -> None:
        super().__init__(
            f"execution {execution_id}: cannot go from {str(current)!r} to {str(requested)!r}"
        )
        self.execution_id = execution_id
        self.current = str(current)
        self.requested = str(requested)


class ExecutionNotFound(StoreError, LookupError):
    """No execution with the requested id."""

    exit_code = ExitCode.USAGE

    def __init__(self, execution_id: int) -> None:
        super().__init__(f"no execution with id {execution_id}")
        self.execution_id = execution_id


class InvalidInput(StoreError, ValueError):
    """A value the journal does not take (e.g. a decision's note over its limit)."""

    exit_code = ExitCode.USAGE
