"""Live control of a real CPU engine: budget, admission limit, policy."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.auth import find_local_token

from tests.engines import InProcessEngine, runbook_cli, while_stepping

pytestmark = pytest.mark.engine


def record_steps(engine: InProcessEngine) -> list[dict[str, Any]]:
    """Spy on the scheduler itself: what each step really scheduled."""
    scheduler, collector = engine.scheduler, engine.collector
    original = scheduler.schedule
    steps: list[dict[str, Any]] = []

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        steps.append(
            {
                "step": collector.stats.steps,
                "tokens": out.total_num_scheduled_tokens,
                "budget": scheduler.max_num_scheduled_tokens,
                "admitted": [r.req_id for r in out.scheduled_new_reqs],
            }
        )
        return out

    scheduler.schedule = schedule
    return steps


def cli_in_background(*args: str) -> subprocess.Popen[str]:
    """The installed `runbook` command; in `make compat`'s environments (a venv in
    front of the project's, without its console script) the same entry module."""
    exe = Path(sys.executable).with_name("runbook")
    cmd = (
        [str(exe)] if exe.is_file() else [sys.executable, "-m", "vllm_runbook.runbooks.operate.cli"]
    )
    return subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def ctl_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(tiny_model)
    yield eng
    eng.close()


def test_halving_the_budget_from_the_cli_under_load(ctl_engine: InProcessEngine) -> None:
    url = ctl_engine.collector.server.url
    steps = record_steps(ctl_engine)
    for i in range(32):  # 9,600 prompt tokens: many full 512-token prefill steps
        ctl_engine.add(f"load-{i}", 300, max_tokens=8, offset=37 * i)
    for _ in range(3):
        ctl_engine.step()
    proc = cli_in_background("set", "--engine", url, "max_num_batched_tokens=x0.5", "--json")
    while_stepping(ctl_engine, proc)
    code, out, err = finish(proc)
    assert code == 0, err
    [change] = json.loads(out)
    assert change["changes"] == [{"knob": "max_num_batched_tokens", "before": 512, "after": 256}]
    applied_from = change["effective_from_step"]
    for _ in range(5):
        ctl_engine.step()
    before = [s for s in steps if s["step"] < applied_from]
    after = [s for s in steps if s["step"] >= applied_from]
    assert max(s["tokens"] for s in before) == 512  # the old budget was really used
    assert after and all(s["tokens"] <= 256 for s in after)
    assert max(s["tokens"] for s in after) == 256  # ... and the new one is, from that step
    assert ctl_engine.value(M.MAX_NUM_BATCHED_TOKENS.name) == 256
    assert ctl_engine.value(M.STARTUP_MAX_NUM_BATCHED_TOKENS.name) == 512

    proc = cli_in_background("restore", "--engine", url, "--json")
    while_stepping(ctl_engine, proc)
    code, out, err = finish(proc)
    assert code == 0, err
    restored_from = json.loads(out)[0]["effective_from_step"]
    ctl_engine.run_until_done()
    restored = [s for s in steps if s["step"] >= restored_from]
    assert max(s["tokens"] for s in restored) == 512  # full prefill steps are back
    assert ctl_engine.value(M.MAX_NUM_BATCHED_TOKENS.name) == 512
    del ctl_engine.scheduler.schedule


def test_status_shows_knobs_and_signals(ctl_engine: InProcessEngine) -> None:
    result = runbook_cli("status", "--engine", ctl_engine.collector.server.url)
    assert result.returncode == 0, result.stderr
    assert "max_num_batched_tokens" in result.stdout and "512" in result.stdout
    assert "block fragmentation" in result.stdout
    as_json = runbook_cli("status", "--engine", ctl_engine.collector.server.url, "--json")
    [state] = json.loads(as_json.stdout)
    assert state["knobs"] == {
        "max_num_batched_tokens": 512,
        "max_num_seqs": 64,
        "policy": "fcfs",
        "autopilot": False,
        "autopilot_target": 0.9,
    }
    assert state["bounds"]["max_num_batched_tokens"]["max"] == 512


def test_bounds_and_auth_over_http(ctl_engine: InProcessEngine) -> None:
    url = ctl_engine.collector.server.url
    token = find_local_token(ctl_engine.collector.server.port)
    assert token
    before = httpx.get(url + "/v1/state").json()["knobs"]
    auth = {"Authorization": f"Bearer {token}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
        r = httpx.post(url + "/v1/knobs", json={"max_num_seqs": 2}, headers=headers)
        assert r.status_code == 401
    r = httpx.post(url + "/v1/knobs", json={"max_num_batched_tokens": 1024}, headers=auth)
    assert r.status_code == 422
    assert r.json()["bound"] == 512 and "above the maximum 512" in r.json()["error"]
    r = httpx.post(url + "/v1/knobs", json={"max_num_batched_tokens": 8}, headers=auth)
    assert r.status_code == 422 and r.json()["bound"] == 64  # the max_num_seqs floor
    r = httpx.post(url + "/v1/knobs", content=b"{not json", headers=auth)
    assert r.status_code == 400
    assert httpx.get(url + "/v1/state").json()["knobs"] == before  # nothing changed

    cli = runbook_cli("set", "--engine", url, "max_num_batched_tokens=4096")
    assert cli.returncode == 2 and "above the maximum 512" in cli.stderr
    assert cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr
    cli = runbook_cli("set", "--engine", url, "--token", "wrong", "max_num_seqs=2")
    assert cli.returncode == 3 and "refused the token" in cli.stderr
    cli = runbook_cli("status", "--engine", "http://127.0.0.1:9")
    assert cli.returncode == 3 and "unreachable" in cli.stderr


def test_concurrent_commands_apply_in_order_under_load(ctl_engine: InProcessEngine) -> None:
    url = ctl_engine.collector.server.url
    token = find_local_token(ctl_engine.collector.server.port)
    auth = {"Authorization": f"Bearer {token}"}
    for i in range(24):
        ctl_engine.add(f"conc-{i}", 200, max_tokens=16, offset=11 * i)
    results: list[dict[str, Any]] = []
    errors: list[str] = []

    def sender(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            for j in range(5):
                body = {"max_num_seqs": 8 + (i + j) % 8, "max_num_batched_tokens": 256 + 32 * j}
                r = client.post(url + "/v1/knobs", json=body, headers=auth)
                (results.append(r.json()) if r.status_code == 200 else errors.append(r.text))

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        while_stepping(ctl_engine, t)
    ctl_engine.run_until_done()
    assert not errors
    finished = [rid for rid in ctl_engine.finished if rid.startswith("conc-")]
    assert sorted(finished) == sorted(f"conc-{i}" for i in range(24))
    results.sort(key=lambda r: r["seq"])
    assert len(results) == 40
    for prev, cur in itertools.pairwise(results):
        assert cur["before"] == prev["after"]
        assert cur["effective_from_step"] >= prev["effective_from_step"]
    final = httpx.get(url + "/v1/state").json()["knobs"]
    assert final == results[-1]["after"]
    httpx.post(url + "/v1/restore", json={}, headers=auth).raise_for_status()


# -- policy: an engine started with `priority`, chunked prefill off --


@pytest.fixture(scope="module")
def priority_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = InProcessEngine.start(
        tiny_model, scheduling_policy="priority", enable_chunked_prefill=False, max_model_len=256
    )
    yield eng
    eng.close()


def _post(engine: InProcessEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    token = find_local_token(engine.collector.server.port)
    return httpx.post(
        engine.collector.server.url + path,
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def _switch_while_stepping(engine: InProcessEngine, policy: str) -> int:
    box: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: box.update(r=_post(engine, "/v1/knobs", {"policy": policy}))
    )
    thread.start()
    while_stepping(engine, thread)
    assert box["r"].status_code == 200, box["r"].text
    return int(box["r"].json()["effective_from_step"])


def test_policy_switch_reorders_the_waiting_requests(priority_engine: InProcessEngine) -> None:
    eng = priority_engine
    assert eng.value(M.SCHEDULER_POLICY.name, policy="priority") == 1
    # Idle engine: applied at once. One request at a time makes admission
    # order observable.
    assert _post(eng, "/v1/knobs", {"policy": "fcfs", "max_num_seqs": 1}).status_code == 200
    assert eng.value(M.SCHEDULER_POLICY.name, policy="fcfs") == 1
    steps = record_steps(eng)
    priorities = [5, 3, 8, 1, 9, 2, 7, 4, 6]
    for i, p in enumerate(priorities):
        eng.add(f"p{i}", 20, max_tokens=2, offset=40 * i, priority=p)

    def admitted() -> list[str]:
        return [rid.split("-")[0] for s in steps for rid in s["admitted"]]  # vLLM adds a suffix

    while len(admitted()) < 3:
        eng.step()
    assert admitted() == ["p0", "p1", "p2"]  # fcfs: arrival order
    _switch_while_stepping(eng, "priority")
    while len(admitted()) < 6:
        eng.step()
    # Remaining p3..p8 have priorities 1,9,2,7,4,6: lowest value first.
    assert admitted()[3:] == ["p3", "p5", "p7"]
    _switch_while_stepping(eng, "fcfs")
    eng.run_until_done()
    assert admitted()[6:] == ["p4", "p6", "p8"]  # back to arrival order
    assert sorted(eng.finished) == [f"p{i}" for i in range(9)]  # each exactly once
    assert len(admitted()) == 9
    del eng.scheduler.schedule
    assert _post(eng, "/v1/restore", {}).json()["after"]["policy"] == "priority"


def test_without_chunked_prefill_max_model_len_is_the_floor(
    priority_engine: InProcessEngine,
) -> None:
    r = _post(priority_engine, "/v1/knobs", {"max_num_batched_tokens": 128})
    assert r.status_code == 422 and r.json()["bound"] == 256
    assert "chunked prefill is off" in r.json()["error"]
    r = _post(priority_engine, "/v1/knobs", {"scale_max_num_batched_tokens": 0.25, "clamp": True})
    assert r.status_code == 200 and r.json()["after"]["max_num_batched_tokens"] == 256
    priority_engine.add("long", 250, max_tokens=2)  # a max_model_len prompt still fits
    assert "long" in priority_engine.run_until_done()
    _post(priority_engine, "/v1/restore", {}).raise_for_status()
