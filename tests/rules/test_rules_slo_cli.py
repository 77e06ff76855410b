"""`runbook slo` against a real Prometheus holding series that burn at known rates.

The series are backfilled (`promtool tsdb create-blocks-from openmetrics`):
two engines at a constant burn each, so every window's burn rate is that
burn and the budget left is 1 - burn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_runbook.rules.slo import BURN_PAIRS, WINDOWS
from vllm_runbook.runbooks.operate.cli.entry import main

from tests.engines import PrometheusServer, require_tool

STEP = 60
SAMPLES = 40
PER_STEP = 1000
CONFIG = """\
slos:
  - name: ttft
    objective: ttft
    threshold: 1s
    target: 0.99
  - name: avail
    objective: availability
    target: 0.999
"""
# engine -> (TTFT burn, availability burn)
BURNS = {"i-0": (20.0, 0.5), "i-1": (0.5, 3.0)}


def _openmetrics(end: int) -> str:
    ttft, done = "vllm:time_to_first_token_seconds", "vllm:request_success_total"
    families: dict[str, list[str]] = {}
    for instance, (ttft_burn, avail_burn) in BURNS.items():
        labels = f'instance="{instance}",model_name="m",engine="0"'
        slow = ttft_burn * 0.01 * PER_STEP
        failed = avail_burn * 0.001 * PER_STEP
        for i in range(SAMPLES):
            ts = end - (SAMPLES - 1 - i) * STEP
            families.setdefault(ttft + "_count", []).append(
                f"{ttft}_count{{{labels}}} {i * PER_STEP} {ts}"
            )
            families.setdefault(ttft + "_bucket", []).append(
                f'{ttft}_bucket{{{labels},le="1.0"}} {i * (PER_STEP - slow)} {ts}'
            )
            for reason, n in (("stop", PER_STEP - failed), ("error", failed)):
                families.setdefault(done, []).append(
                    f'{done}{{{labels},finished_reason="{reason}"}} {i * n} {ts}'
                )
    lines = []
    for name, samples in families.items():
        lines.append(f"# TYPE {name} unknown")
        lines.extend(sorted(samples, key=lambda s: (s.split("} ")[0], int(s.rsplit(" ", 1)[1]))))
    return "\n".join(lines) + "\n# EOF\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory):
    promtool = require_tool("promtool")
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("slo-prom")
    end = int(time.time()) - 300
    (tmp / "data.om").write_text(_openmetrics(end))
    data = tmp / "prometheus" / "data"
    data.mkdir(parents=True)
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(tmp / "data.om"), str(data)],
        check=True,
        capture_output=True,
    )
    (tmp / "runbook.yaml").write_text(CONFIG)
    config = "global: {scrape_interval: 1m}\nscrape_configs: []\n"
    with PrometheusServer.run(config, tmp / "prometheus", binary) as prom:
        yield prom, end, tmp / "runbook.yaml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_gives_the_known_burn_rates_and_budget(prometheus, capsys) -> None:
    prom, end, config = prometheus
    code, out, err = _run(
        capsys,
        "slo",
        "--config",
        str(config),
        "--prometheus",
        prom.url,
        "--time",
        str(end),
        "--json",
    )
    assert code == 0, err
    rows = {(r["slo"], r["engine"]["instance"]): r for r in json.loads(out)}
    assert set(rows) == {("ttft", "i-0"), ("ttft", "i-1"), ("avail", "i-0"), ("avail", "i-1")}
    for (slo, instance), row in rows.items():
        burn = BURNS[instance][0 if slo == "ttft" else 1]
        # every window holds the same constant burn (the 30d one: the 40 min there are)
        assert set(row["burn_rate"]) == {"5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d"}
        assert len(WINDOWS) + 1 == len(row["burn_rate"])
        for window, value in row["burn_rate"].items():
            assert value == pytest.approx(burn, rel=1e-9), (slo, instance, window)
        assert row["budget_left"] == pytest.approx(1 - burn, rel=1e-9)
        firing = {f["alert"] for f in row["firing"]}
        assert firing == {
            f"VllmSloBurn_{slo}_{w}"
            for w, p in zip(("1h", "6h", "1d", "3d"), BURN_PAIRS, strict=True)
            if p.factor < burn
        }


def test_table(prometheus, capsys) -> None:
    prom, end, config = prometheus
    code, out, err = _run(
        capsys, "slo", "--config", str(config), "--prometheus", prom.url, "--time", str(end)
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "SLO", "ENGINE", "OBJECTIVE", "BUDGET", "LEFT", "BURN", "1h", "BURN", "6h",
        "BURN", "1d", "BURN", "3d", "FIRING",
    ]  # fmt: skip
    ttft0 = next(line for line in lines if line.startswith("ttft") and "i-0/m/0" in line)
    assert "99% of first tokens within 1s over 30d" in ttft0
    assert ttft0.split("30d", 1)[1].split() == [
        "-1900.0%", "20.00", "20.00", "20.00", "20.00",
        "VllmSloBurn_ttft_1h,", "VllmSloBurn_ttft_6h,", "VllmSloBurn_ttft_1d,",
        "VllmSloBurn_ttft_3d",
    ]  # fmt: skip
    avail1 = next(line for line in lines if line.startswith("avail") and "i-1/m/0" in line)
    assert avail1.split("30d", 1)[1].split() == [
        "-200.0%", "3.00", "3.00", "3.00", "3.00", "VllmSloBurn_avail_3d"
    ]  # fmt: skip


def test_errors_are_one_line_with_their_exit_codes(prometheus, tmp_path: Path) -> None:
    prom, _end, config = prometheus
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "slos:\n  - name: ttft\n    objective: ttft\n    threshold: 0.3s\n    target: 0.99\n"
    )
    cases = [
        (["--config", str(config), "--prometheus", "http://127.0.0.1:1"], 1, "did not answer"),
        (["--prometheus", prom.url], 2, "no slos:"),
        (["--config", str(config), "--prometheus", "nope"], 2, "http(s) URL"),
        (
            ["--config", str(bad), "--prometheus", prom.url],
            2,
            f"{bad}:4: slos[0].threshold: 0.3 s is not a bucket boundary of "
            "vllm:time_to_first_token_seconds (vLLM's default buckets); the nearest are 0.25 s "
            "and 0.5 s",
        ),
    ]
    for argv, code, text in cases:
        done = subprocess.run(
            [sys.executable, "-m", "vllm_runbook.runbooks.operate.cli", "slo", *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == code, (argv, done.stderr)
        assert text in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1, done.stderr


def test_the_table_reads_each_slos_own_scaled_pairs() -> None:
    """A 7-day SLO's burn rates are over its own long windows (14m, 1h24m, ...): the
    columns are named by them when every SLO shown has that window, by the pair when
    the windows differ."""
    from vllm_runbook.rules.slo import SloSpec, SloStatus, windows
    from vllm_runbook.runbooks.operate.cli.slo import table

    week = SloSpec(name="week", objective="availability", target=0.99, window=7 * 86400.0)
    month = SloSpec(name="month", objective="availability", target=0.99)
    engine = {"instance": "i-0", "model_name": "m", "engine": "0"}

    def status(slo: SloSpec) -> SloStatus:
        ratios = {w: (0.2 if w == slo.pairs[0].long else 0.01) for w in windows(slo.window)}
        return SloStatus(slo, engine, {**ratios, slo.window: 0.005})

    alone = table([status(week)]).splitlines()
    assert alone[0].endswith("BURN 14m  BURN 1h24m  BURN 5h36m  BURN 16h48m  FIRING")
    # budget left 1 - 0.005 / 0.01; the 14m window burns at 20, the others at 1
    assert alone[1].split()[-6:] == ["50.0%", "20.00", "1.00", "1.00", "1.00", "-"]
    mixed = table([status(week), status(month)]).splitlines()
    assert mixed[0].endswith("BURN PAIR 1  BURN PAIR 2  BURN PAIR 3  BURN PAIR 4  FIRING")
