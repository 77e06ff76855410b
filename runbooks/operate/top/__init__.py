"""`runbook top`: a live terminal view of engines, findings and executions.

model.py    what one refresh saw (`Snapshot`) and how each cell reads
sources.py  where a snapshot comes from: the agents (with the embedded
            evaluator, and the journal when one is named) or the service's API
app.py      the textual app: tables refreshed on an interval, approve/reject
"""
