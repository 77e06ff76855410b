"""Helpers for the executor tests: the `runbook` CLI of this checkout in a subprocess."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.engines import REPO_ROOT, runbook_cli, runbook_cli_command, runbook_cli_env


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return runbook_cli(*args, timeout=timeout)


def cli_json(*args: str) -> tuple[int, dict[str, Any], str]:
    """Run the CLI with --json; (exit code, parsed stdout, stderr)."""
    done = runbook_cli(*args, "--json")
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}, done.stderr


def cli_background(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        runbook_cli_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=runbook_cli_env(),
    )
