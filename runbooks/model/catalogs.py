"""Where the rule catalog and the runbook catalog meet, each checked against the other.

Neither package keeps a list of the other's names. A runbook's `triggers`
are checked against the alerts of the rule catalog it is loaded with, and a
rule's `runbook` label (and the configuration's `automation:` keys) against
the runbooks of the runbook catalog it is deployed with, here:

    deployment = load_deployment("runbook.yaml", [Path("my-runbooks")], registry)
    deployment.rules          # bound with the file's overrides, labels checked
    deployment.runbooks       # triggers checked against deployment.alerts
    deployment.alert_runbooks # alert -> runbook (None: diagnose only)

`runbook serve` loads its catalogs this way, so a deployment may rename
alerts and runbooks as long as the two catalogs agree with each other.
`runbook rules check|export` check the labels against the runbook catalog
given with `--catalog` (default: the shipped one).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_runbook.rules.model import Catalog as RuleCatalog
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.model import load_catalog as load_rule_catalog
from vllm_runbook.rules.slo import slo_rules
from vllm_runbook.runbooks.model import config as runbook_config
from vllm_runbook.runbooks.model.actions import ActionRegistry
from vllm_runbook.runbooks.model.config import Config
from vllm_runbook.runbooks.model.spec import Catalog as RunbookCatalog
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog


@dataclass(frozen=True)
class Deployment:
    config: Config
    rule_catalog: RuleCatalog
    rules: list[Rule]
    runbooks: RunbookCatalog

    @property
    def alerts(self) -> list[str]:
        return self.rule_catalog.alerts

    @property
    def alert_runbooks(self) -> dict[str, str | None]:
        return {r.alert: r.runbook for r in self.rules}

    @property
    def alert_for_seconds(self) -> dict[str, float]:
        """Alert -> its rule's `for` (the longest, where severities differ): how long
        its condition held before it fired (the checks read the episode from then)."""
        longest: dict[str, float] = {}
        for r in self.rules:
            longest[r.alert] = max(r.for_seconds, longest.get(r.alert, 0.0))
        return longest


def runbook_names(
    directories: Iterable[Path] | None = None, registry: ActionRegistry | None = None
) -> list[str]:
    """The names of the runbook catalog (default: the shipped one), triggers unchecked;
    CatalogError (rules.errors) when a file is broken."""
    return list(load_runbook_catalog(directories, registry))


def load_rules(
    config: Config, runbooks: Collection[str], path: str | Path | None = None
) -> list[Rule]:
    """The rule catalog (`path`, else the configuration's), bound with its overrides,
    every `runbook` label checked against `runbooks`; CatalogError if broken."""
    rules = config.bind(load_rule_catalog(path or config.catalog, runbooks=list(runbooks)))
    return rules + slo_rules(config.slos)


def load_deployment(
    config_path: str | Path | None,
    runbook_dirs: Iterable[Path] | None = None,
    registry: ActionRegistry | None = None,
) -> Deployment:
    """The configuration, the rule catalog it names and the runbook catalog, each
    checked against the others. Raises CatalogError (rules.errors) with every
    problem; its `what` says which file is broken."""
    dirs = list(runbook_dirs) if runbook_dirs is not None else None
    names = runbook_names(dirs, registry)
    config = runbook_config.load_config(config_path, runbooks=names)
    rule_catalog = load_rule_catalog(config.catalog, runbooks=names)
    rules = config.bind(rule_catalog) + slo_rules(config.slos)
    runbooks = load_runbook_catalog(dirs, registry, alerts=rule_catalog.alerts)
    return Deployment(config, rule_catalog, rules, runbooks)
