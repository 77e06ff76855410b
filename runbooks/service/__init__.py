"""`runbook serve`: Alertmanager's webhooks in, remediation out. The FastAPI app
and its doors (app.py, webhooks.py, auth.py, limits.py, page.py), the worker
that runs the executions an alert asks for (worker.py), the jobs every replica
runs on one scheduler (jobs.py, leader.py, retention.py, the circuit breaker in
breaker.py and breaker_job.py), notifications (notify.py), discovery of the
engines (discovery.py), the embedded rules' wiring (rules_service.py,
sql_sink.py) and the service's own metrics (telemetry.py, metric_specs.py).

It starts executions through run/ and writes only through store/. Nothing
below it imports it; the demo and the operator's tools may.
"""
