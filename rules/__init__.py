"""Rules engine: the anomaly catalog, its in-service evaluator and its PromQL export.

catalog = load_catalog()                     # rules/catalog/*.yaml, CatalogError if broken
rules = catalog.bind({"VllmLatencySpike": {"p99_sla_seconds": 0.5}})
store = store_for_rules(rules)               # windows sized by the longest rule window
evaluator = Evaluator(rules, store, MemoryIncidentSink())
scraper = Scraper(store, [Target("http://127.0.0.1:8000/metrics", "llama-0")])
scraper.scrape_once(); evaluator.evaluate()  # or scheduling.schedule(...)
text = export(catalog, overrides)            # Prometheus rule file
config = load_file(RulesConfig, "runbook.yaml")  # its sections; the file: runbooks/model

This layer knows no store, no web service and no agent client: the service
that wires the rules to the store (RulesService, SqlIncidentSink) lives in
vllm_runbook.runbooks.service. A rule's `runbook` label is checked against
the runbook names it is given (`load_catalog(path, runbooks=names)`): the
runbooks layer passes those of the runbook catalog it deploys.
"""

from __future__ import annotations

from vllm_runbook.rules.config import (
    Automation,
    AutomationMode,
    EngineConfig,
    RulesConfig,
    load_file,
)
from vllm_runbook.rules.errors import CatalogError, Problem, RulesError
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import (
    IncidentEvent,
    IncidentSink,
    MemoryIncidentSink,
    OpenAlert,
    engine_name,
)
from vllm_runbook.rules.model import Catalog, Rule, load_catalog
from vllm_runbook.rules.promql import export
from vllm_runbook.rules.remediation import (
    Dispatcher,
    Handoff,
    LoggingRemediationHook,
    RemediationHook,
)
from vllm_runbook.rules.scrape import Scraper, ScrapeResult, Target
from vllm_runbook.rules.window import WindowStore

__all__ = [
    "Automation",
    "AutomationMode",
    "Catalog",
    "CatalogError",
    "Dispatcher",
    "EngineConfig",
    "Evaluator",
    "Handoff",
    "IncidentEvent",
    "IncidentSink",
    "LoggingRemediationHook",
    "MemoryIncidentSink",
    "OpenAlert",
    "Problem",
    "RemediationHook",
    "Rule",
    "RulesConfig",
    "RulesError",
    "ScrapeResult",
    "Scraper",
    "Target",
    "WindowStore",
    "engine_name",
    "export",
    "load_catalog",
    "load_file",
    "store_for_rules",
]
