"""The runbooks: YAML runbooks that act on live engines, and the service,
journal and tools around them. Layered rooms, each importing only the rooms
below it (import-linter contracts in pyproject.toml; docs/architecture.md):

    operate/  the operator's tools: the `runbook` CLI, `runbook top`, `runbook tune`
    demo/     `runbook demo`, its report and the server processes it starts
    service/  `runbook serve`: webhooks, worker, notifications, breaker, discovery
    run/      one execution: executor, verification, guardrails, revert, outcome
    engine/   the agent's client and the actions a step runs on an engine
    store/    the journal, the only writer of the database
    model/    declarations: runbook specs, the configuration file, the action
              registry, exit codes

engine/ and store/ do not import each other; nothing imports a room above it,
and no module imports one that imports it back. The data beside them:
catalog/ (the shipped runbooks) and templates/ (reports, notifications, the
on-call page).
"""
