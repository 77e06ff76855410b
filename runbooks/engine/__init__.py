"""The engine-facing side of the runbooks: the agent's client, the actions a
runbook step runs on an engine (their registry and the built-in ones), the
signals read from the engine for checks and verification, and warm-up traffic."""
