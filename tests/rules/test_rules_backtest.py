"""`runbook backtest` over a recorded storm, read from a real Prometheus.

tests/data/storm.om.gz holds the series of two real CPU engines recorded by
tests/data/record_storm.py: `cpu-storm` driven into a preemption storm and
`cpu-healthy` under light traffic beside it. The module backfills them into a
fresh TSDB with `promtool tsdb create-blocks-from openmetrics` (shifted to end
just before now) and starts a real Prometheus on loopback over it; no HTTP is
mocked.

Oracles, all exact:
- the storming engine's VllmOOMPressure finding names runbook oom-pressure,
  and the healthy engine has no finding at all;
- the knob change it would make is the action's arithmetic on the recorded
  samples (kv capacity from blocks used/free and requests running);
- agreement: for every exported alerting rule, Prometheus' own answer to its
  expression at every step of the range (query_range), put through the
  alerting-rule state machine (pending -> firing after `for`), gives exactly
  the embedded evaluator's findings (alert, severity, engine, fired, resolved);
- precision and recall against a known-incident file; a PNG is written;
  user mistakes are one line and exit 2, a Prometheus that does not answer 1.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.promql import export
from vllm_runbook.runbooks.operate.cli import main

from tests.engines import PrometheusServer, free_port, require_tool

pytestmark = pytest.mark.service

DATA = Path(__file__).parent.parent / "data" / "storm.om.gz"
STEP = 15.0
STORM, HEALTHY = "cpu-storm", "cpu-healthy"


@dataclass
class Recorded:
    url: str
    start: float
    end: float
    samples: dict[str, list[tuple[float, float]]]  # series text -> (t, value)


def _parse(text: str, shift: float) -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    lines, samples = [], {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value, at = line.rsplit(" ", 2)
        t = round(float(at) + shift, 3)
        lines.append(f"{series} {value} {t:.3f}")
        samples.setdefault(series, []).append((t, float(value)))
    return lines, samples


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    import time

    promtool = require_tool("promtool")
    binary = require_tool("prometheus")
    text = gzip.decompress(DATA.read_bytes()).decode()
    last = max(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#")
    # Whole seconds, ending two minutes before now (well inside the 1 h retention).
    shift = math.floor(time.time()) - 120 - math.ceil(last)
    lines, samples = _parse(text, shift)
    work = tmp_path_factory.mktemp("backtest")
    om = work / "storm.om"
    om.write_text("\n".join(lines) + "\n# EOF\n", encoding="utf-8")
    data = work / "prometheus" / "data"
    data.mkdir(parents=True)
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
        check=True,
        capture_output=True,
    )
    first = min(t for points in samples.values() for t, _ in points)
    with PrometheusServer.run("global: {}\n", work / "prometheus", binary) as prom:
        yield Recorded(prom.url, first, last + shift + 60, samples)


def _backtest(
    rec: Recorded, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str, str]:
    capsys.readouterr()
    argv = ["backtest", "--prometheus", rec.url, "--from", f"{rec.start:.3f}"]
    code = main([*argv, "--to", f"{rec.end:.3f}", "--step", f"{STEP:g}s", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(yaml.safe_dump({"automation": {"oom-pressure": "auto"}}), encoding="utf-8")
    return path


def _latest(rec: Recorded, name: str, instance: str, t: float) -> float:
    [series] = [s for s in rec.samples if s.startswith(name + "{") and f'"{instance}"' in s]
    return [v for at, v in rec.samples[series] if at <= t][-1]


def test_backtest_names_the_storm_and_nothing_on_the_healthy_engine(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _backtest(recorded, capsys, "--json", "--config", str(_config(tmp_path)))
    assert code == 0, err
    doc = json.loads(out)
    assert sorted(e.split("/")[0] for e in doc["engines"]) == [HEALTHY, STORM]
    findings = doc["findings"]
    assert [f for f in findings if f["engine"].startswith(HEALTHY + "/")] == []
    [oom] = [f for f in findings if f["alert"] == "VllmOOMPressure"]
    assert oom["engine"].startswith(STORM + "/") and oom["runbook"] == "oom-pressure"
    assert oom["labels"]["instance"] == STORM
    assert oom["pending_at"] < oom["fired_at"] and oom["fired_at"] - oom["pending_at"] >= 30
    assert oom["decision"] == "would run", oom
    # the knob change: set_max_num_seqs(kv_capacity) on the samples recorded then
    t = oom["fired_at"]
    used = _latest(recorded, "vllm_runbook_kv_blocks_used", STORM, t)
    free = _latest(recorded, "vllm_runbook_kv_blocks_free", STORM, t)
    running = _latest(recorded, "vllm_runbook_num_requests_running", STORM, t)
    limit = _latest(recorded, "vllm_runbook_max_num_seqs", STORM, t)
    seqs = [c for c in oom["changes"] if c["knob"] == "max_num_seqs"]
    if running and used:
        capacity = max(1, int((used + free) * running // used))
        target = max(1, math.floor(capacity * 0.5))
        assert seqs[:1] == (
            []
            if target >= limit
            else [
                {
                    "action": "set_max_num_seqs",
                    "knob": "max_num_seqs",
                    "before": int(limit),
                    "after": target,
                }
            ]
        )
    # the checks' values are the recorded samples at the firing time
    assert oom["checks"]["running"] == running, oom
    assert oom["checks"]["kv_capacity"] == (
        max(1, int((used + free) * running // used)) if running and used else None
    ), oom

    # the text timeline says the same per engine
    code, text, err = _backtest(recorded, capsys, "--config", str(_config(tmp_path)))
    assert code == 0, err
    assert (
        f"{HEALTHY}/" in text and "no findings" in text.split(f"{HEALTHY}/", 1)[1].splitlines()[0]
    )
    storm_lines = text.split(f"{STORM}/", 1)[1]
    assert "VllmOOMPressure (critical) fired" in storm_lines
    assert "runbook oom-pressure would run" in storm_lines


def test_evaluator_and_prometheus_agree(
    recorded: Recorded, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _backtest(recorded, capsys, "--json")
    assert code == 0, err
    ours = sorted(
        (
            f["alert"],
            f["labels"]["severity"],
            f["labels"]["instance"],
            _r(f["fired_at"]),
            _r(f["resolved_at"]),
        )
        for f in json.loads(out)["findings"]
    )
    prom = PrometheusServer.__new__(PrometheusServer)
    prom.url = recorded.url
    theirs = []
    rules = yaml.safe_load(export(load_catalog(), annotations=False))
    steps = int((recorded.end - recorded.start) // STEP)
    times = [round(recorded.start + i * STEP, 3) for i in range(steps + 1)]
    for group in rules["groups"]:
        for rule in group["rules"]:
            for_s = _seconds(rule.get("for", "0s"))
            result = prom.query_range(rule["expr"], recorded.start, times[-1], STEP)
            for series in result:
                held = {round(float(t), 3) for t, _ in series["values"]}
                theirs += _episodes(rule, series["metric"], held, times, for_s, recorded.end)
    assert ours == sorted(theirs)
    assert any(a == "VllmOOMPressure" and i == STORM for a, _, i, _, _ in ours)


def _r(t: float | None) -> float | None:
    return None if t is None else round(t, 3)


def _seconds(text: str) -> float:
    from vllm_runbook.rules.durations import parse_duration

    return parse_duration(text)


def _episodes(
    rule: dict[str, Any],
    labels: dict[str, str],
    held: set[float],
    times: list[float],
    for_s: float,
    end: float,
) -> list[tuple[str, str, str, float, float | None]]:
    """Prometheus' alerting-rule states over the steps: fired and resolved times."""
    out: list[tuple[str, str, str, float, float | None]] = []
    active: float | None = None
    fired: float | None = None
    for t in times:
        if t in held:
            active = t if active is None else active
            if fired is None and t - active >= for_s:
                fired = t
        else:
            if fired is not None:
                out.append(
                    (rule["alert"], rule["labels"]["severity"], labels["instance"], fired, t)
                )
            active = fired = None
    if fired is not None:
        out.append((rule["alert"], rule["labels"]["severity"], labels["instance"], fired, None))
    return out


def test_incidents_png_and_mistakes(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = _backtest(recorded, capsys, "--json")
    [oom] = [f for f in json.loads(out)["findings"] if f["alert"] == "VllmOOMPressure"]
    incidents = tmp_path / "incidents.yaml"
    incidents.write_text(
        yaml.safe_dump(
            [
                {"engine": STORM, "start": oom["pending_at"] - 30, "end": oom["fired_at"] + 30},
                {
                    "engine": HEALTHY,
                    "start": oom["pending_at"],
                    "end": oom["fired_at"],
                    "alerts": ["VllmOOMPressure"],
                },
            ]
        ),
        encoding="utf-8",
    )
    png = tmp_path / "backtest.png"
    code, text, err = _backtest(recorded, capsys, "--incidents", str(incidents), "--png", str(png))
    assert code == 0, err
    [row] = [line.split() for line in text.splitlines() if line.startswith("VllmOOMPressure ")]
    assert row == ["VllmOOMPressure", "1", "100%", "1/2", "50%"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --engine: Prometheus selects the series; the storm is not read at all
    code, out, err = _backtest(recorded, capsys, "--json", "--engine", f'instance="{HEALTHY}"')
    assert code == 0, err
    doc = json.loads(out)
    assert [e.split("/")[0] for e in doc["engines"]] == [HEALTHY] and doc["findings"] == []

    code, _, err = _backtest(recorded, capsys, "--step", "0s")
    assert code == 2 and err.count("\n") == 1 and "--step" in err
    capsys.readouterr()
    code = main(["backtest", "--prometheus", "localhost:9090", "--from", "now-1h"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "http(s) URL" in err
    code = main(["backtest", "--prometheus", f"http://127.0.0.1:{free_port()}", "--from", "now-1h"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "did not answer" in err, err
