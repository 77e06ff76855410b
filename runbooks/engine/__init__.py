"""The engine-facing side of the runbooks: the agent's client (client.py), the
actions a runbook step runs on an engine (operations.py, registered in
model/actions.py's registry; warmup.py; block_size.py; router.py: drain, undrain
and restart at the engine's router, bound by routing.py), and the signals read from
the engine and vLLM's own /metrics for checks and verification (sources.py).

It speaks only to engines, through the agent's wire models
(collector/agent_api.py): no journal, no service, no CLI or demo, no
database or web framework (an import contract).
"""
