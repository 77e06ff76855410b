"""`python -m vllm_runbook.runbooks.cli …`: the `runbook` command (`make demo` runs it so)."""

import sys

from vllm_runbook.runbooks.cli import main

sys.exit(main())
