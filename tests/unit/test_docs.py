"""The README stays true to the code it documents."""

from __future__ import annotations

from pathlib import Path

from vllm_runbook.collector import metrics as M

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_lists_every_metric() -> None:
    for spec in M.ALL_METRICS:
        # Table rows may abbreviate a sibling as `/ _suffix`.
        assert spec.series_name.removeprefix("vllm_runbook") in README, spec.series_name


def test_readme_shows_the_two_commands_and_the_default_port() -> None:
    assert "make demo" in README and "make test" in README
    from vllm_runbook.collector.hook import DEFAULT_PORT

    assert f"`{DEFAULT_PORT}`" in README
