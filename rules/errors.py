"""Every exception the rules package raises, drawn once.

    RulesError                      base of everything below
    ├── CatalogError                a rule catalog, a runbook catalog or the configuration
    │                               file is broken; carries one Problem per mistake, never
    │                               drops one (`what` says which of the three)
    ├── ResourceNameError           a Kubernetes name, namespace or label the export
    │                               would write and the API server would refuse
    └── Problem                     one mistake, located as
        │                           ``file:line: rule NAME: msg`` / ``file:line: runbook NAME: msg``
        ├── SyntaxProblem           malformed YAML or a field of the wrong shape (any of the
        │                           three files: `vllm_runbook.rules.yamlmarks` raises it)
        ├── UnknownSignalError      a condition names a signal the registry lacks
        ├── DurationError           a duration that does not parse (``5 minutes``)
        ├── UnknownRunbookError     a runbook name the deployed runbook catalog lacks
        ├── UnknownParameterError   ``$name`` or an override for a parameter not declared
        ├── DuplicateRuleError      the same alert and severity defined twice
        └── TemplateError           an annotation template outside the supported subset

The runbook catalog (`vllm_runbook.runbooks.model.spec`) reports its mistakes with
the same Problem and CatalogError: every YAML file an operator writes fails
the same way, and the CLI maps one class to its exit code.

Scrape failures are not exceptions to callers: the scraper counts them and
goes on (see ``vllm_runbook.rules.scrape``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

RULE_CATALOG: Final = "rule catalog"
RUNBOOK_CATALOG: Final = "runbook catalog"
CONFIGURATION: Final = "configuration"
Broken = Literal["rule catalog", "runbook catalog", "configuration"]


class RulesError(Exception):
    """Base class of the rules package's errors."""


class ResourceNameError(RulesError):
    """A Kubernetes object name, namespace or label that the API server would refuse."""


class Problem(RulesError):
    """One mistake in a rule file, a runbook file or the configuration file, with where it is."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        rule: str | None = None,
        runbook: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.rule = rule
        self.runbook = runbook
        super().__init__(str(self))

    def located(
        self, *, file: str | None = None, line: int | None = None, rule: str | None = None
    ) -> Problem:
        """Fill in location parts the raiser did not know (inner parsers know less)."""
        self.file = self.file or file
        self.line = self.line or line
        self.rule = self.rule or rule
        self.args = (str(self),)
        return self

    def __str__(self) -> str:
        where = self.file or "<rules>"
        if self.line is not None:
            where += f":{self.line}"
        who = f" rule {self.rule}:" if self.rule else ""
        who += f" runbook {self.runbook}:" if self.runbook else ""
        return f"{where}:{who} {self.message}"


class SyntaxProblem(Problem):
    pass


class UnknownSignalError(Problem):
    pass


class DurationError(Problem):
    pass


class UnknownRunbookError(Problem):
    pass


class UnknownParameterError(Problem):
    pass


class DuplicateRuleError(Problem):
    pass


class TemplateError(Problem):
    pass


class CatalogError(RulesError):
    """A broken catalog or configuration file: every problem found, one line each.

    One class for the rule catalog, the runbook catalog and the configuration:
    callers treat them alike (nothing may start; exit 2 on the command line),
    and `what` names which one for a heading."""

    def __init__(self, problems: Iterable[Problem], *, what: Broken = RULE_CATALOG) -> None:
        self.problems = list(problems)
        self.what: Broken = what
        super().__init__("\n".join(str(p) for p in self.problems))
