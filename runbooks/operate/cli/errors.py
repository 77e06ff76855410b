"""The CLI's one error → exit-code mapping, and its usage error.

Errors of this package and of the layers under it carry their code
(`RunbookError.exit_code`, exit_codes.py). The rules and the collector sit
below the runbooks and cannot import that base, so their few errors are
mapped here, in `FOREIGN`. `main` (entry.py) is the only caller: it prints
`message(error)` as `runbook: error: …` on stderr and exits `exit_code(error)`.
"""

from __future__ import annotations

from vllm_runbook.collector.auth import TokenError
from vllm_runbook.rules.errors import RUNBOOK_CATALOG, CatalogError, RulesError
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError


class UsageError(RunbookError):
    """A command line (or a file it names) that cannot be used as given."""

    exit_code = ExitCode.USAGE


# The errors raised below the runbooks, most specific first.
FOREIGN: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (RulesError, ExitCode.USAGE),  # a broken rule/runbook catalog or configuration
    (TokenError, ExitCode.USAGE),  # an agent or webhook token that cannot be read or used
    (UnicodeDecodeError, ExitCode.USAGE),  # a binary file where text was expected
)


def exit_code(error: BaseException) -> ExitCode | None:
    """The code `error` ends a command with; None for a bug (its traceback is kept)."""
    if isinstance(error, RunbookError):
        return error.exit_code
    for kind, code in FOREIGN:
        if isinstance(error, kind):
            return code
    return None


def message(error: BaseException) -> str:
    """What to tell the person, after `runbook: error: ` (a catalog: one line per problem)."""
    if isinstance(error, CatalogError) and error.what == RUNBOOK_CATALOG:
        return f"invalid runbook catalog:\n{error}"
    if isinstance(error, UnicodeDecodeError):
        return f"a file given is not UTF-8 text ({error.reason})"
    return str(error)
