"""CLI parsing: engines files, knob assignments, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.operate.cli.engines import parse_assignments, read_engines_file
from vllm_runbook.runbooks.operate.cli.errors import UsageError


def test_engines_file_plain_and_yaml(tmp_path: Path) -> None:
    plain = tmp_path / "engines.txt"
    plain.write_text("# fleet\nhttp://127.0.0.1:9360\n\n127.0.0.1:9361  # rank 1\n")
    assert read_engines_file(str(plain)) == ["http://127.0.0.1:9360", "127.0.0.1:9361"]
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text("engines:\n  - name: a\n    agent: http://127.0.0.1:9360\n")
    assert read_engines_file(str(cfg)) == ["http://127.0.0.1:9360"]
    cfg.write_text("engines:\n  - name: a\n    agent: [\n")
    with pytest.raises(UsageError, match=r"runbook.yaml:\d+: invalid YAML"):
        read_engines_file(str(cfg))
    with pytest.raises(UsageError, match="cannot read"):
        read_engines_file(str(tmp_path / "missing"))


def test_assignments() -> None:
    assert parse_assignments(["max_num_batched_tokens=x0.5", "policy=fcfs"]) == {
        "scale_max_num_batched_tokens": 0.5,
        "policy": "fcfs",
    }
    assert parse_assignments(["max_num_seqs=8"]) == {"max_num_seqs": 8}
    for bad in (["max_num_seqs=eight"], ["foo=1"], ["max_num_seqs"], ["max_num_batched_tokens=xa"]):
        with pytest.raises(UsageError):
            parse_assignments(bad)


def test_user_mistakes_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["set", "--engine", "http://127.0.0.1:9", "max_num_seqs=x"]) == 2
    assert main(["status"]) == 2
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "Traceback" not in err
    assert main(["status", "--engine", "http://127.0.0.1:9"]) == 3
