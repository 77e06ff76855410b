"""The operator's tools, the top floor: the `runbook` command line (cli/), the
live terminal view (`runbook top`, top/) and the live tuning walk (`runbook
tune`, tune.py). They may import every room below; nothing imports them
(an import contract protects the CLI).
"""
