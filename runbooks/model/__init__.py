"""Declarations, read and validated, that every other room reads: what a runbook
says (spec.py: its checks, steps, verification, revert and guardrails), the
deployment's configuration file and its one loader (config.py; catalogs.py
loads the rule and runbook catalogs it names), the action registry (actions.py:
what a step may call, its parameters model and the knobs it may change; the
actions themselves are engine/operations.py) and the exit codes of every
command (exit_codes.py).

Nothing here talks to an engine, a database or the network, and nothing here
imports another room of the runbooks (it is the bottom floor); it may import
the rules layer and the agent's wire models (collector/agent_api.py).
"""
