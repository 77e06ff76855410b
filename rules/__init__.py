"""Rules engine: the anomaly catalog, its in-service evaluator and its PromQL export.

catalog = load_catalog()                     # rules/catalog/*.yaml, CatalogError if broken
rules = catalog.bind({"VllmLatencySpike": {"p99_sla_seconds": 0.5}})
store = store_for_rules(rules)               # windows sized by the longest rule window
evaluator = Evaluator(rules, store, MemoryIncidentSink())
scraper = Scraper(store, [Target("http://127.0.0.1:8000/metrics", "llama-0")])
scraper.scrape_once(); evaluator.evaluate()  # or scheduling.schedule(...)
text = export(catalog, overrides)            # Prometheus rule file
"""

from __future__ import annotations

from rules.errors import CatalogError, RuleProblem, RulesError
from rules.evaluator import Evaluator, store_for_rules
from rules.incidents import IncidentEvent, IncidentSink, MemoryIncidentSink
from rules.model import RUNBOOK_NAMES, Catalog, Rule, load_catalog
from rules.promql import export
from rules.scrape import Scraper, ScrapeResult, Target
from rules.window import WindowStore

__all__ = [
    "RUNBOOK_NAMES",
    "Catalog",
    "CatalogError",
    "Evaluator",
    "IncidentEvent",
    "IncidentSink",
    "MemoryIncidentSink",
    "Rule",
    "RuleProblem",
    "RulesError",
    "ScrapeResult",
    "Scraper",
    "Target",
    "WindowStore",
    "export",
    "load_catalog",
    "store_for_rules",
]
