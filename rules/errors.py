"""Every exception the rules package raises, drawn once.

    RulesError                      base of everything below
    ├── CatalogError                a rule catalog (or its overrides) is broken; carries
    │                               one RuleProblem per mistake, never drops a rule
    │   └── ConfigError             the configuration file is broken (same shape: problems)
    ├── ResourceNameError           a Kubernetes name, namespace or label the export
    │                               would write and the API server would refuse
    └── RuleProblem                 one mistake, located as ``file:line: rule NAME: msg``
        ├── RuleSyntaxError         malformed YAML or a field of the wrong shape
        ├── UnknownSignalError      a condition names a signal the registry lacks
        ├── DurationError           a duration that does not parse (``5 minutes``)
        ├── UnknownRunbookError     a runbook name the deployed runbook catalog lacks
        ├── UnknownParameterError   ``$name`` or an override for a parameter not declared
        ├── DuplicateRuleError      the same alert and severity defined twice
        └── TemplateError           an annotation template outside the supported subset

Scrape failures are not exceptions to callers: the scraper counts them and
goes on (see ``vllm_runbook.rules.scrape``).
"""

from __future__ import annotations


class RulesError(Exception):
    """Base class of the rules package's errors."""


class ResourceNameError(RulesError):
    """A Kubernetes object name, namespace or label that the API server would refuse."""


class RuleProblem(RulesError):
    """One mistake in a rule file, with where it is."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        rule: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.rule = rule
        super().__init__(str(self))

    def located(
        self, *, file: str | None = None, line: int | None = None, rule: str | None = None
    ) -> RuleProblem:
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
        rule = f" rule {self.rule}:" if self.rule else ""
        return f"{where}:{rule} {self.message}"


class RuleSyntaxError(RuleProblem):
    pass


class UnknownSignalError(RuleProblem):
    pass


class DurationError(RuleProblem):
    pass


class UnknownRunbookError(RuleProblem):
    pass


class UnknownParameterError(RuleProblem):
    pass


class DuplicateRuleError(RuleProblem):
    pass


class TemplateError(RuleProblem):
    pass


class CatalogError(RulesError):
    """A broken catalog: every problem found, one line each."""

    def __init__(self, problems: list[RuleProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ConfigError(CatalogError):
    """A broken configuration file: every problem found, one ``file:line: msg`` each.

    A subclass of CatalogError because callers treat both alike: nothing may
    start, and each problem is one line for the operator."""
