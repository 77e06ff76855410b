"""Grafana dashboards for vLLM and vllm-runbook, generated from the metric and rule catalogs.

`python -m vllm_runbook.dashboards.generate` writes the JSON (and the Prometheus rule file)
beside this module; see README-section.md for provisioning.
"""
