"""The `runbook` command line: one module per command group, mounted by entry.py.

    engines    status, set, restore    (the live engines' knobs)
    journal    db upgrade, history, list, show
    execute    exec, revert
    approvals  pending, approve, reject
    rules      rules export, rules check
    check      check                   (the production checklist)
    serve      serve                   (the service itself: runbooks.service)
    report     report
    demo       demo                    (the story itself: runbooks.demo)

Handlers return an `ExitCode` or raise; `main` maps every error to one line
on stderr and its code (errors.py; the table: runbooks/model/exit_codes.py).
Nothing else in `vllm_runbook.runbooks` imports this package (an import
contract): it is the top of the runbooks.
"""

from __future__ import annotations

from vllm_runbook.runbooks.operate.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
