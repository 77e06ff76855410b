"""Grafana dashboards for vLLM and vllm-runbook, generated from the metric and rule catalogs.

`python -m vllm_runbook.dashboards.generate` writes the JSON (and the Prometheus rule file)
beside this module; docs/dashboards.md describes them and how to provision Grafana. What
lives here: the dashboards' builders, queries, panel definitions and lint, the generated JSON,
and the Prometheus and Alertmanager configuration. It imports only what a dashboard needs:
the metric specs of collector/ and runbooks/service/metric_specs.py, and the rule catalog,
signals, SLOs and PromQL export of rules/; nothing of the service's or the store's machinery (one
enum excepted: definitions.py names the execution statuses by
runbooks/store/models.py's `ExecutionStatus`). The docs generator, which imports every
layer, is not here: it is tools/docs.py, a tool of the source checkout.
"""
