"""Rules engine: the anomaly catalog, its in-service evaluator and its PromQL export.

catalog = load_catalog()                     # rules/catalog/*.yaml, CatalogError if broken
rules = catalog.bind({"VllmLatencySpike": {"p99_sla_seconds": 0.5}})
store = store_for_rules(rules)               # windows sized by the longest rule window
evaluator = Evaluator(rules, store, MemoryIncidentSink())
scraper = Scraper(store, [Target("http://127.0.0.1:8000/metrics", "llama-0")])
scraper.scrape_once(); evaluator.evaluate()  # or scheduling.schedule(...)
text = export(catalog, overrides)            # Prometheus rule file

config = load_config("runbook.yaml")          # the deployment's file, ConfigError if broken
service = RulesService.from_config(config, store=Store(url), hook=executor_hook)
service.start(scheduler)                      # refuses (CatalogError) on a broken catalog
"""

from __future__ import annotations

from rules.config import Automation, AutomationMode, Config, EngineConfig, load_config
from rules.errors import CatalogError, ConfigError, RuleProblem, RulesError
from rules.evaluator import Evaluator, store_for_rules
from rules.incidents import IncidentEvent, IncidentSink, MemoryIncidentSink, OpenAlert, engine_name
from rules.model import RUNBOOK_NAMES, Catalog, Rule, load_catalog
from rules.promql import export
from rules.remediation import Dispatcher, Handoff, LoggingRemediationHook, RemediationHook
from rules.scrape import Scraper, ScrapeResult, Target
from rules.service import RulesService
from rules.sql_sink import SqlIncidentSink
from rules.window import WindowStore

__all__ = [
    "RUNBOOK_NAMES",
    "Automation",
    "AutomationMode",
    "Catalog",
    "CatalogError",
    "Config",
    "ConfigError",
    "Dispatcher",
    "EngineConfig",
    "Evaluator",
    "Handoff",
    "IncidentEvent",
    "IncidentSink",
    "LoggingRemediationHook",
    "MemoryIncidentSink",
    "OpenAlert",
    "RemediationHook",
    "Rule",
    "RuleProblem",
    "RulesError",
    "RulesService",
    "ScrapeResult",
    "Scraper",
    "SqlIncidentSink",
    "Target",
    "WindowStore",
    "engine_name",
    "export",
    "load_catalog",
    "load_config",
    "store_for_rules",
]
