"""Runs one synthetic case through both backends: the in-service evaluator and promtool.

Series are written in promtool's expanding notation (``0+10x5`` = 0 10 .. 50,
``1x3`` = 1 1 1 1, ``_x2`` = two missing samples), sample i at i * SCRAPE
seconds, so the same text feeds `promtool test rules` and the evaluator.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml
from vllm_runbook.rules.durations import format_duration
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.promql import export

SCRAPE = 30.0
EVAL = 30.0
ENGINE = {"instance": "i-0", "model_name": "m", "engine": "0"}

_ITEM = re.compile(
    r"^(?P<a>[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|NaN|Inf))(?:(?P<sign>[-+])(?P<b>\d+\.?\d*(?:e[-+]?\d+)?))?x(?P<n>\d+)$"
)
_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Case:
    alert: str
    name: str  # "fire", "quiet", ...
    series: tuple[tuple[str, str], ...]  # (series selector, values)
    duration: float  # seconds of evaluation
    fires_at: float | None  # exact oracle (Prometheus 2 closed ranges); None: must not fire
    severity: str | None = None  # which variant when an alert has several
    fires_at_left_open: float | None = None  # oracle under Prometheus 3 ranges when different

    @property
    def id(self) -> str:
        return f"{self.alert}{'-' + self.severity if self.severity else ''}-{self.name}"

    def oracle(self, left_open: bool) -> float | None:
        if left_open and self.fires_at_left_open is not None:
            return self.fires_at_left_open
        return self.fires_at


def series(name: str, values: str, **labels: str) -> tuple[str, str]:
    all_labels = {**ENGINE, **labels}
    return (
        f"{name}{{{','.join(f'{k}={chr(34)}{v}{chr(34)}' for k, v in all_labels.items())}}}",
        values,
    )


def expand(values: str) -> list[float | None]:
    """promtool's expanding notation (None = missing sample)."""
    out: list[float | None] = []
    for token in values.split():
        if token == "_":
            out.append(None)
            continue
        if token.startswith("_x"):
            out.extend([None] * int(token[2:]))
            continue
        m = _ITEM.match(token)
        if m is None:
            out.append(float(token))
            continue
        value, n = float(m.group("a")), int(m.group("n"))
        step = float(m.group("b") or 0) * (-1 if m.group("sign") == "-" else 1)
        out.append(value)
        for _ in range(n):  # cumulative, exactly as promtool adds
            value += step
            out.append(value)
    return out


def parse_selector(text: str) -> tuple[str, dict[str, str]]:
    m = _SERIES.match(text.strip())
    assert m, text
    return m.group("name"), dict(_LABEL.findall(m.group("labels") or ""))


def select_rule(rules: list[Rule], case: Case) -> Rule:
    found = [r for r in rules if r.alert == case.alert and case.severity in (None, r.severity)]
    assert len(found) == 1, f"{case.id}: {len(found)} rules match"
    return found[0]


def run_evaluator(rule: Rule, case: Case, *, left_open: bool) -> float | None:
    """First evaluation time at which `rule` fires on the case's series (None: never)."""
    store = store_for_rules([rule], left_open=left_open)
    sink = MemoryIncidentSink()
    evaluator = Evaluator([rule], store, sink)
    samples: list[tuple[float, str, dict[str, str], float]] = []
    for selector, values in case.series:
        name, labels = parse_selector(selector)
        for i, v in enumerate(expand(values)):
            if v is not None:
                samples.append((i * SCRAPE, name, labels, v))
    samples.sort(key=lambda s: s[0])
    pos, t = 0, 0.0
    while t <= case.duration:
        while pos < len(samples) and samples[pos][0] <= t:
            ts, name, labels, v = samples[pos]
            store.add(labels.get("instance", ""), name, labels, ts, v)
            pos += 1
        for event in evaluator.evaluate(t):
            if event.state == "firing":
                return t
        t += EVAL
    return None


def promtool_version() -> int | None:
    """Major version of the promtool on PATH, or None."""
    exe = shutil.which("promtool")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"version (\d+)\.", out.stdout + out.stderr)
    return int(m.group(1)) if m else None


def promtool_required() -> bool:
    """With CI set (to anything) a missing promtool is a failure; without it, a skip."""
    return "CI" in os.environ


def promtool_test_file(
    rule: Rule, case: Case, evaluator_fired: float | None, rule_file: str
) -> dict[str, object]:
    """A promtool unit test asserting Prometheus fires within one EVAL of the evaluator."""
    labels = {**ENGINE, **rule.alert_labels}
    checks: list[dict[str, object]] = []
    if evaluator_fired is not None:
        checks.append(
            {
                "eval_time": format_duration(evaluator_fired + EVAL),
                "alertname": rule.alert,
                "exp_alerts": [{"exp_labels": labels}],
            }
        )
        before = evaluator_fired - 2 * EVAL
        if before >= 0:
            checks.append(
                {
                    "eval_time": format_duration(before) if before else "0s",
                    "alertname": rule.alert,
                    "exp_alerts": [],
                }
            )
    else:
        t = 0.0
        while t <= case.duration:
            checks.append(
                {
                    "eval_time": format_duration(t) if t else "0s",
                    "alertname": rule.alert,
                    "exp_alerts": [],
                }
            )
            t += 60.0
    return {
        "rule_files": [rule_file],
        "evaluation_interval": format_duration(EVAL),
        "tests": [
            {
                "name": case.id,
                "interval": format_duration(SCRAPE),
                "input_series": [{"series": s, "values": v} for s, v in case.series],
                "alert_rule_test": checks,
            }
        ],
    }


def run_promtool(
    rule: Rule, case: Case, evaluator_fired: float | None, workdir: Path
) -> subprocess.CompletedProcess[str]:
    rule_file = workdir / "rules.yml"
    rule_file.write_text(export([rule], annotations=False), encoding="utf-8")
    test_file = workdir / "test.yml"
    doc = promtool_test_file(rule, case, evaluator_fired, rule_file.name)
    test_file.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return subprocess.run(
        ["promtool", "test", "rules", test_file.name],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
