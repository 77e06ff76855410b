"""`runbook serve`: Alertmanager webhooks in, remediation out."""
