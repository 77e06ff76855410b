"""The `runbook` commands' number arguments at the edges of their type: through
the real parser, one line and exit USAGE (2), never a traceback."""

from __future__ import annotations

import pytest
from vllm_runbook.runbooks.operate.cli import main


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("exec", "oom-pressure", "--engine", "http://127.0.0.1:9", "--verify-seconds", "nan"),
         "argument --verify-seconds: must be >= 0 seconds, got nan"),
        (("exec", "oom-pressure", "--engine", "http://127.0.0.1:9", "--verify-seconds", "inf"),
         "argument --verify-seconds: must be >= 0 seconds, got inf"),
        (("exec", "oom-pressure", "--engine", "http://127.0.0.1:9", "--verify-seconds", "-1"),
         "argument --verify-seconds: must be >= 0 seconds, got -1"),
        (("status", "--engine", "http://127.0.0.1:9", "--timeout", "1e400"),
         "argument --timeout: must be > 0 seconds, got 1e400"),
        (("status", "--engine", "http://127.0.0.1:9", "--timeout", "0"),
         "argument --timeout: must be > 0 seconds, got 0"),
        (("status", "--engine", "http://127.0.0.1:9", "--timeout", "soon"),
         "argument --timeout: 'soon' is not a number of seconds"),
        (("history", "--limit", "0"), "argument --limit: must be at least 1, got 0"),
        (("history", "--limit", "1.5"), "argument --limit: '1.5' is not an integer"),
        (("tune", "--engine", "http://127.0.0.1:9", "--window", "nan"),
         "argument --window: must be > 0 seconds, got nan"),
    ],
)  # fmt: skip
def test_numbers_at_the_edges_are_refused_in_one_line(
    args: tuple[str, ...], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"runbook: error: {error}"]
