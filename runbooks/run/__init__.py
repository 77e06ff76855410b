"""One execution of a runbook against one engine, from its checks to its
verdict: executor.py (the run, its steps, its rollback), verification.py
(before/after judgement), guardrails.py (the engine lock, admission, the
refusals and the circuit breaker's hold, read from the journal), revert.py
(restoring what an execution recorded, stepwise), outcome.py (results and
aborts) and render.py (how values and records read as text).

It uses engine/ to act and store/ to journal, and knows no web service,
scheduler of periodic work or notification channel: the service (above it)
starts executions and reverts, and the breaker, a service job, asks it to
revert. Nothing here imports service/, demo/ or operate/.
"""
