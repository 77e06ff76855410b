"""`runbook check`: each checklist line on exact synthetic scrapes, then the command
against real HTTP servers on loopback (exit codes 0, 1, 2, 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rule_server import Routes, serve
from vllm_runbook.rules.checklist import READS, Scrape, parse_exposition, run_checklist
from vllm_runbook.runbooks.operate.cli import main

from tests.fake_agent import agent_state

ROOT = Path(__file__).resolve().parents[2]
ENGINE = 'model_name="tiny",engine="0"'
STATE = agent_state(model_name="tiny").model_dump(mode="json")


def agent_text(
    *,
    nvml: int = 0,
    util: tuple[float, ...] = (),
    mem: tuple[float, ...] = (),
    running: int = 0,
    frag: float = 0.0,
    tokens: float = 0.0,
    preemptions: float = 0.0,
) -> str:
    lines = [
        f"vllm_runbook_nvml_up{{{ENGINE}}} {nvml}",
        f"vllm_runbook_num_requests_running{{{ENGINE}}} {running}",
        f"vllm_runbook_block_fragmentation_ratio{{{ENGINE}}} {frag}",
        f"vllm_runbook_scheduled_tokens_total{{{ENGINE}}} {tokens}",
        f"vllm_runbook_preemptions_total{{{ENGINE}}} {preemptions}",
        # another engine's series on the same page must be ignored
        'vllm_runbook_preemptions_total{model_name="tiny",engine="1"} 999',
    ]
    lines += [
        f'vllm_runbook_gpu_utilization_ratio{{{ENGINE},gpu="{i}"}} {u}' for i, u in enumerate(util)
    ]
    lines += [
        f'vllm_runbook_gpu_memory_used_bytes{{{ENGINE},gpu="{i}"}} {m}' for i, m in enumerate(mem)
    ]
    return "\n".join(lines) + "\n"


def vllm_text(buckets: tuple[float, float, float, float] = (0, 0, 0, 0), ok: float = 0,
              errors: float = 0) -> str:  # fmt: skip
    lines = [
        f'vllm:e2e_request_latency_seconds_bucket{{{ENGINE},le="{le}"}} {n}'
        for le, n in zip(("0.5", "1.0", "2.0", "+Inf"), buckets, strict=True)
    ]
    lines += [
        f'vllm:request_success_total{{{ENGINE},finished_reason="stop"}} {ok}',
        f'vllm:request_success_total{{{ENGINE},finished_reason="error"}} {errors}',
        'vllm:request_success_total{model_name="tiny",engine="1",finished_reason="error"} 50',
    ]
    return "\n".join(lines) + "\n"


def scrapes(agents: list[str], vllms: list[str] | None = None, step: float = 2.0) -> list[Scrape]:
    match = {"model_name": "tiny", "engine": "0"}
    return [
        Scrape(
            i * step,
            parse_exposition(a, **match),
            parse_exposition(vllms[i], **match) if vllms else None,
        )
        for i, a in enumerate(agents)
    ]


def results(
    agents: list[str], vllms: list[str] | None = None, sla: float = 1.0
) -> dict[str, tuple]:
    return {
        r.name: (r.status, r.value, r.shown, r.note)
        for r in run_checklist(scrapes(agents, vllms), "tiny", "0", sla)
    }


def test_no_gpu_idle_engine_without_vllm_is_all_n_a() -> None:
    got = results([agent_text()] * 3)
    assert got == {
        "GPU utilisation": ("n/a", None, "n/a", "no NVIDIA GPU on the engine's machine "
                            "(nvml_up 0): NVML exports no GPU series"),
        "block fragmentation": ("n/a", None, "n/a", "no request was running at any scrape "
                                "(defined under load only)"),
        "P99 latency": ("n/a", None, "n/a", "give --vllm URL: latency comes from vLLM's /metrics"),
        "throughput variation": ("n/a", None, "n/a", "engine idle: no token scheduled while "
                                 "sampling"),
        "OOM (preemption) rate": ("n/a", None, "n/a", "give --vllm URL: finished requests come "
                                  "from vLLM's /metrics"),
        "error rate": ("n/a", None, "n/a", "give --vllm URL: finished requests come from vLLM's "
                       "/metrics"),
        "GPU memory difference": ("n/a", None, "n/a", "no NVIDIA GPU on the engine's machine "
                                  "(nvml_up 0): NVML exports no GPU series"),
        "KV block retention": ("n/a", None, "n/a", "give --vllm URL: block residency comes "
                               "from vLLM's /metrics"),
    }  # fmt: skip


RESIDENCY_LE = ("1", "5", "10", "30", "60", "+Inf")


def residency_text(idle: tuple[float, ...], lifetime: tuple[float, ...], reuse_gaps: float) -> str:
    """vLLM's residency histograms (--kv-cache-metrics), cumulative counts per bucket
    of RESIDENCY_LE; the reuse-gap histogram by its +Inf bucket only."""
    lines = [
        f'vllm:kv_block_idle_before_evict_seconds_bucket{{{ENGINE},le="{le}"}} {n}'
        for le, n in zip(RESIDENCY_LE, idle, strict=True)
    ]
    lines += [
        f'vllm:kv_block_lifetime_seconds_bucket{{{ENGINE},le="{le}"}} {n}'
        for le, n in zip(RESIDENCY_LE, lifetime, strict=True)
    ]
    lines += [
        f'vllm:kv_block_reuse_gap_seconds_bucket{{{ENGINE},le="+Inf"}} {reuse_gaps}',
        # another engine's blocks on the same page must be ignored
        'vllm:kv_block_idle_before_evict_seconds_bucket{model_name="tiny",engine="1",le="1"} 9',
    ]
    return vllm_text() + "\n".join(lines) + "\n"


def retention(first: str, last: str) -> tuple:
    return results([agent_text()] * 2, [first, last])["KV block retention"]


def test_kv_block_retention_is_the_median_idle_time_of_the_blocks_evicted_meanwhile() -> None:
    # 100 sampled blocks evicted before, idle over 60 s; 40 more while sampling, idle
    # 5-10 s (median 5 + 5 x 20/40 = 7.5 s), alive 10-30 s (10 + 20 x 20/40 = 20 s).
    before = residency_text((0, 0, 0, 0, 0, 100), (0, 0, 0, 0, 0, 100), reuse_gaps=30)
    short = residency_text((0, 0, 40, 40, 40, 140), (0, 0, 0, 40, 40, 140), reuse_gaps=42)
    assert retention(before, short) == (
        "warn", 7.5, "7.5 s idle (P50)",
        "40 sampled blocks evicted, lifetime P50 20 s, 12 reuse gaps; a prefix back later "
        "than that is recomputed: more KV cache or a lower max_num_seqs keeps blocks longer",
    )  # fmt: skip
    # The same evictions with no block reused meanwhile: nothing was lost.
    unused = residency_text((0, 0, 40, 40, 40, 140), (0, 0, 0, 40, 40, 140), reuse_gaps=30)
    assert retention(before, unused)[:3] == ("pass", 7.5, "7.5 s idle (P50)")
    assert retention(before, unused)[3].endswith("0 reuse gaps; no block was reused: none lost")
    # Kept 30-60 s after their last use (30 + 30 x 20/40 = 45 s): long enough.
    kept = residency_text((0, 0, 0, 0, 40, 140), (0, 0, 0, 0, 40, 140), reuse_gaps=42)
    assert retention(before, kept) == (
        "pass", 45.0, "45 s idle (P50)",
        "40 sampled blocks evicted, lifetime P50 45 s, 12 reuse gaps",
    )  # fmt: skip


def test_kv_block_retention_without_evictions_or_without_the_flag() -> None:
    before = residency_text((0, 0, 40, 40, 40, 40), (0, 0, 0, 40, 40, 40), reuse_gaps=5)
    # Nothing evicted while sampling: the blocks evicted since the engine started.
    assert retention(before, before) == (
        "warn", 7.5, "7.5 s idle (P50)",
        "no sampled block evicted while sampling: since the engine started; 40 sampled "
        "blocks evicted, lifetime P50 20 s, 5 reuse gaps; a prefix back later than that is "
        "recomputed: more KV cache or a lower max_num_seqs keeps blocks longer",
    )  # fmt: skip
    never = residency_text((0,) * 6, (0,) * 6, reuse_gaps=0)
    assert retention(never, never) == (
        "n/a",
        None,
        "n/a",
        "no sampled KV block has been evicted yet",
    )
    assert retention(vllm_text(), vllm_text()) == (
        "n/a", None, "n/a",
        "vLLM exports no KV block residency: start it with --kv-cache-metrics",
    )  # fmt: skip


def test_kv_block_retention_limit_is_the_rules() -> None:
    from vllm_runbook.rules.checklist import KV_RETENTION_SECONDS
    from vllm_runbook.rules.model import load_catalog

    [rule] = [r for r in load_catalog().bind() if r.alert == "VllmKVCacheRetentionShort"]
    assert rule.params["idle_seconds"] == KV_RETENTION_SECONDS
    # A soak keeps the samples the line reads.
    assert {
        "vllm:kv_block_idle_before_evict_seconds_bucket",
        "vllm:kv_block_lifetime_seconds_bucket",
        "vllm:kv_block_reuse_gap_seconds_bucket",
    } <= READS


def test_gpu_lines() -> None:
    ok = results([agent_text(nvml=1, util=(0.7, 0.9), mem=(100.0, 90.0))] * 2)
    assert ok["GPU utilisation"][:3] == ("pass", 0.7, "gpu0 70.0%, gpu1 90.0%")
    assert ok["GPU memory difference"][:3] == ("pass", 0.1, "10.0%")
    bad = results(
        [
            agent_text(nvml=1, util=(0.8, 0.9), mem=(100.0, 80.0)),
            agent_text(nvml=1, util=(0.8, 1.0), mem=(100.0, 75.0)),
        ]
    )
    # Means per GPU over the scrapes: 0.80 and 0.95; memory from the latest scrape.
    assert bad["GPU utilisation"][:3] == ("fail", 0.95, "gpu0 80.0%, gpu1 95.0%")
    assert bad["GPU memory difference"][:3] == ("fail", 0.25, "25.0%")
    one = results([agent_text(nvml=1, util=(0.8,), mem=(100.0,))] * 2)
    assert one["GPU memory difference"] == ("n/a", None, "n/a", "1 GPU: nothing to compare")


def test_fragmentation_averages_the_busy_scrapes() -> None:
    got = results(
        [
            agent_text(running=2, frag=0.125),
            agent_text(running=0, frag=0.9),  # idle: 0 by definition, not counted
            agent_text(running=3, frag=0.25),
        ]
    )
    assert got["block fragmentation"][:3] == ("pass", 0.1875, "18.8%")
    got = results([agent_text(running=1, frag=0.25)] * 2)
    assert got["block fragmentation"][:3] == ("fail", 0.25, "25.0%")


def test_throughput_variation_over_the_intervals() -> None:
    # 2 s apart: 100 and 110 tokens/s -> (110 - 100) / 105.
    got = results([agent_text(tokens=t) for t in (0, 200, 420)])
    assert got["throughput variation"] == (
        "pass",
        10 / 105,
        "9.5%",
        "2 rates over 4 s, mean 105 tokens/s; the seeds mean 1 h",
    )
    got = results([agent_text(tokens=t) for t in (0, 200, 440)])
    assert got["throughput variation"][:3] == ("fail", 20 / 110, "18.2%")
    got = results([agent_text(tokens=t) for t in (0, 200)])
    assert got["throughput variation"][0:1] == ("n/a",)
    assert got["throughput variation"][3] == "needs two intervals: --scrapes 3 or more"


def test_p99_over_the_sampled_interval() -> None:
    vllms = [vllm_text((5, 5, 5, 5)), vllm_text((95, 104, 105, 105))]
    # Interval: 90, 99, 100, 100 -> rank 99 falls at the top of the (0.5, 1.0] bucket.
    got = results([agent_text()] * 2, vllms, sla=1.0)
    assert got["P99 latency"] == ("fail", 1.0, "1 s", "")
    assert results([agent_text()] * 2, vllms, sla=1.5)["P99 latency"][0] == "pass"
    quiet = [vllm_text((90, 99, 100, 100))] * 2
    got = results([agent_text()] * 2, quiet, sla=1.5)
    assert got["P99 latency"] == (
        "pass",
        1.0,
        "1 s",
        "no request finished while sampling: since the engine started",
    )
    got = results([agent_text()] * 2, [vllm_text()] * 2)
    assert got["P99 latency"] == ("n/a", None, "n/a", "no request has finished yet")


def test_oom_and_error_rates() -> None:
    agents = [agent_text(preemptions=3), agent_text(preemptions=4)]
    vllms = [vllm_text(ok=1000, errors=5), vllm_text(ok=2990, errors=15)]
    got = results(agents, vllms)
    # 1 preemption and 10 errors among 2000 requests finished while sampling.
    assert got["OOM (preemption) rate"][:3] == ("pass", 1 / 2000, "0.05%")
    assert got["error rate"][:3] == ("fail", 10 / 2000, "0.5%")
    agents = [agent_text(preemptions=3)] * 2
    vllms = [vllm_text(ok=990, errors=10)] * 2
    got = results(agents, vllms)
    assert got["OOM (preemption) rate"] == (
        "fail",
        3 / 1000,
        "0.3%",
        "no request finished while sampling: since the engine started",
    )
    assert got["error rate"][:3] == ("fail", 0.01, "1%")


# -- the command, against real HTTP servers -------------------------------------------


@pytest.fixture
def agent() -> Iterator[Routes]:
    with serve() as routes:
        routes.json("/v1/state", STATE)
        yield routes


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", "--interval", "0.01", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_all_n_a_exits_0_with_the_table(agent: Routes, capsys: pytest.CaptureFixture[str]) -> None:
    agent.text("/metrics", agent_text())
    code, out, err = check(capsys, "--engine", agent.url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"engine {agent.url}  model tiny  dp rank 0  (3 scrapes over 0.")
    assert lines[1].split() == ["result", "check", "limit", "measured", "note"]
    assert lines[2].split()[:4] == ["N/A", "GPU", "utilisation", "70-90%"]
    assert [line.split()[0] for line in lines[2:10]] == ["N/A"] * 8
    # Then the configuration checks (rules/config_checks.py; tested there): an agent
    # without `config` and no traffic leaves only the token budget to judge.
    assert [line.split()[:2] for line in lines[10:17]] == [
        ["PASS", "token"],
        ["N/A", "block"],
        ["N/A", "chunked"],
        ["N/A", "memory"],
        ["N/A", "max_num_seqs"],
        ["N/A", "scheduling"],
        ["N/A", "hardware"],
    ]
    assert lines[17] == "0 failed, 1 passed, 14 n/a"
    assert agent.hits["/metrics"] == 3


def test_failing_check_exits_1_and_json(agent: Routes, capsys: pytest.CaptureFixture[str]) -> None:
    agent.text("/metrics", agent_text(nvml=1, util=(0.95, 0.95), mem=(100.0, 100.0)))
    code, out, _ = check(capsys, "--engine", agent.url, "--json", "--scrapes", "2")
    assert code == 1
    doc = json.loads(out)
    assert (doc["ok"], doc["summary"], doc["scrapes"]) == (
        False,
        {"pass": 2, "fail": 1, "n/a": 12},
        2,
    )
    by_name = {c["name"]: c for c in doc["checks"]}
    assert by_name["GPU utilisation"] == {
        "name": "GPU utilisation",
        "limit": "70-90%",
        "status": "fail",
        "value": 0.95,
        "shown": "gpu0 95.0%, gpu1 95.0%",
        "note": "",
    }
    assert by_name["GPU memory difference"]["status"] == "pass"


def test_vllm_series_are_used_when_given(agent: Routes, capsys: pytest.CaptureFixture[str]) -> None:
    agent.text("/metrics", agent_text())
    with serve() as vllm:
        vllm.text("/metrics", vllm_text((90, 99, 100, 100), ok=100))
        code, out, _ = check(capsys, "--engine", agent.url, "--vllm", vllm.url, "--json",
                             "--sla-seconds", "2")  # fmt: skip
    doc = json.loads(out)
    by_name = {c["name"]: (c["status"], c["value"]) for c in doc["checks"]}
    assert by_name["P99 latency"] == ("pass", 1.0)
    assert by_name["OOM (preemption) rate"] == ("pass", 0.0)
    assert by_name["error rate"] == ("pass", 0.0)
    assert (code, doc["vllm"]) == (0, vllm.url)


def test_unreachable_and_not_an_agent_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    with serve() as dead:
        url = dead.url
    code, out, err = check(capsys, "--engine", url)
    assert (code, out) == (3, "")
    assert err.startswith(f"runbook: error: engine agent {url}/v1/state unreachable: ConnectError")
    assert len(err.splitlines()) == 1
    with serve() as other:
        other.json("/v1/state", {"hello": 1})
        code, _, err = check(capsys, "--engine", other.url)
    assert (code, err) == (
        3,
        f"runbook: error: {other.url} is not a vllm-runbook agent "
        "(/v1/state: engine: Field required)\n",
    )


def test_vllm_unreachable_exits_3(agent: Routes, capsys: pytest.CaptureFixture[str]) -> None:
    agent.text("/metrics", agent_text())
    with serve() as vllm:
        vllm.text("/metrics", "oops", status=500)
        code, _, err = check(capsys, "--engine", agent.url, "--vllm", vllm.url)
    assert (code, err) == (3, f"runbook: error: vLLM server {vllm.url}/metrics answered HTTP 500\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "http://h:1", "--scrapes", "1"], "--scrapes must be at least 2"),
        (["--engine", "http://h:1", "--interval", "0"], "--interval must be positive"),
        (["--engine", "ftp://h:1"], "not an engine agent URL: 'ftp://h:1'"),
        (
            ["--engine", "http://h:1", "--scrapes", "two"],
            "argument --scrapes: invalid int value: 'two'",
        ),
        (
            ["--engine", "http://h:1", "--soak", "1h", "--scrapes", "5"],
            "--soak takes its scrapes from DURATION / --interval: drop --scrapes",
        ),
        (["--engine", "http://h:1", "--config", "x.yaml"], "--config is read only with --soak"),
        (
            ["--engine", "http://h:1", "--soak", "10s"],
            "--soak 10s is shorter than --interval 15 s",
        ),
        (
            ["--engine", "http://h:1", "--soak", "an hour"],
            "--soak: bad duration 'an hour': expected e.g. '30s', '5m', '1h30m'",
        ),
        (
            ["--engine", "http://h:1", "--soak", "60"],
            "--soak: bad duration '60': expected e.g. '30s', '5m', '1h30m'",
        ),
    ],
)
def test_usage_errors_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", *args]) == 2
    assert capsys.readouterr() == ("", f"runbook: error: {message}\n")


def test_usage_error_as_an_operator_sees_it() -> None:
    # A separate process, as typed: one line, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_runbook.runbooks.operate.cli", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        "runbook: error: the following arguments are required: --engine\n",
    )


def test_the_checks_read_only_the_samples_a_soak_keeps() -> None:
    """A soak keeps only READS of each scrape: the checks give the same verdicts."""
    from vllm_runbook.runbooks.operate.cli.check import slim

    unread = f"vllm_runbook_padding_ratio{{{ENGINE}}} 0.1\n"  # no check reads it
    full = [
        Scrape(float(t), parse_exposition(agent_text(running=2, frag=0.1, tokens=100.0 * t,
               preemptions=t, nvml=1, util=(0.8,), mem=(1e9,)) + unread),
               parse_exposition(vllm_text((5 * t, 8 * t, 9 * t, 10 * t), ok=10.0 * t, errors=t)))
        for t in range(4)
    ]  # fmt: skip
    slimmed = [slim(s) for s in full]
    assert all(set(s.agent) | set(s.vllm or {}) <= READS for s in slimmed)
    assert all(len(s.agent) < len(f.agent) for s, f in zip(slimmed, full, strict=True))
    assert run_checklist(slimmed, "tiny", "0", 1.0) == run_checklist(full, "tiny", "0", 1.0)
