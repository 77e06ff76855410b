"""The in-memory agent the tests use (tests/fake_agent.py's FakeAgent) is an `Agent`
(runbooks/engine/client.py), as mypy sees it, like the real EngineClient.

`make lint`'s mypy checks the package, not the tests: this test runs mypy, with the
project's settings, on tests/fake_agent.py (whose `as_agent` returns a FakeAgent as
an Agent) and on a fake that drifted from the Protocol, which must fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collector", "rules", "runbooks", "dashboards")

DRIFTED = """
from typing import Any

from vllm_runbook.collector.agent_api import AgentState, ChangeResult
from vllm_runbook.runbooks.engine.client import Agent


class Drifted:
    url = "http://127.0.0.1:9"
    timeout = 5.0

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        raise NotImplementedError

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> ChangeResult:
        raise NotImplementedError

    def restore(self) -> ChangeResult:  # lost its dry_run
        raise NotImplementedError


def as_agent(agent: Drifted) -> Agent:
    return agent
"""


def run_mypy(tmp_path: Path, *files: str) -> subprocess.CompletedProcess[str]:
    # The package under its import names (what `make typecheck-tree` links in build/ns).
    tree = tmp_path / "ns" / "vllm_runbook"
    tree.mkdir(parents=True)
    for package in PACKAGES:
        (tree / package).symlink_to(ROOT / package, target_is_directory=True)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            *files,
        ],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(tmp_path / "ns")},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_fake_agent_is_an_agent_and_a_drifted_one_is_not(tmp_path: Path) -> None:
    drifted = tmp_path / "drifted_agent.py"
    drifted.write_text(DRIFTED, encoding="utf-8")
    result = run_mypy(tmp_path, "tests/fake_agent.py", str(drifted))
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if "fake_agent.py" in e], result.stdout + result.stderr
    # The Protocol is seen (not Any, as an unresolved import would be): the drift fails.
    assert any(
        "drifted_agent.py" in e and '(got "Drifted", expected "Agent")' in e for e in errors
    ), result.stdout + result.stderr
