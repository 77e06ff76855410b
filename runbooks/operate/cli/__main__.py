"""`python -m vllm_runbook.runbooks.operate.cli …`: the `runbook` command (`make demo`)."""

import sys

from vllm_runbook.runbooks.operate.cli import main

sys.exit(main())
