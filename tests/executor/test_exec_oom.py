"""`runbook exec oom-pressure` on a real CPU engine under real KV pressure.

The workload (the fixtures below): 256 KV blocks of 32 tokens, max_num_seqs 32, 64
requests of 300 prompt + 300 output tokens. The test steps the engine itself
(paced, so the CLI's wall-clock waits see the workload still in flight) while
`runbook exec` runs in a subprocess, then reads the journal, the engine's
knobs and the preemption counter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from exec_harness import cli, cli_background, cli_json
from vllm_runbook.rules.durations import parse_duration
from vllm_runbook.runbooks.store import Journal

from tests.catalogs import acting_catalog
from tests.engines import InProcessEngine, free_port

pytestmark = pytest.mark.engine

STARTUP = {
    "max_num_batched_tokens": 512,
    "max_num_seqs": 32,
    "policy": "fcfs",
    "autopilot": False,
    "autopilot_target": 0.9,
}
WINDOW_S = 10
STEP_PACE_S = 0.02  # ≈1,200 steps per workload → ≈30 s: room for the CLI's waits


@pytest.fixture(scope="module")
def oom_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    # A 10 s preemption window: preemptions_per_minute reacts within a test.
    saved = os.environ.get("VLLM_RUNBOOK_WINDOW_SECONDS")
    os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = str(WINDOW_S)
    try:
        eng = InProcessEngine.start(
            tiny_model, max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks_override=256
        )
    finally:
        if saved is None:
            os.environ.pop("VLLM_RUNBOOK_WINDOW_SECONDS", None)
        else:
            os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = saved
    yield eng
    eng.close()


def url_of(engine: InProcessEngine) -> str:
    return str(engine.collector.server.url)


def knobs(engine: InProcessEngine) -> dict[str, Any]:
    """What the agent reports, checked against the scheduler itself."""
    state = httpx.get(url_of(engine) + "/v1/state", timeout=10).json()["knobs"]
    s = engine.scheduler
    assert state == {
        "max_num_batched_tokens": s.max_num_scheduled_tokens,
        "max_num_seqs": s.max_num_active_reqs,
        "policy": s.policy.value,
        "autopilot": engine.collector.autopilot.enabled,
        "autopilot_target": engine.collector.autopilot.target,
    }
    return dict(state)


class Workload:
    """64 × (300 + 300) tokens; records preemptions per scheduler step."""

    def __init__(self, engine: InProcessEngine, tag: str, offset: int) -> None:
        self.engine = engine
        self.collector = engine.collector
        self.first_step = self.collector.stats.steps
        self.start_preemptions = self.collector.stats.preemptions
        # (scheduler step, cumulative preemptions of this workload) after each step.
        self.trace: list[tuple[int, int]] = []
        for i in range(64):
            engine.add(f"{tag}-{i}", 300, max_tokens=300, offset=offset + 7 * i)

    @property
    def preemptions(self) -> int:
        return int(self.collector.stats.preemptions - self.start_preemptions)

    def step(self, pace: float = 0.0) -> bool:
        if not self.engine.engine.has_unfinished_requests():
            return False
        self.engine.step()
        self.trace.append((self.collector.stats.steps, self.preemptions))
        if pace:
            time.sleep(pace)
        return True

    def run_while(self, proc: Any, pace: float = STEP_PACE_S) -> None:
        """Step (paced) while a CLI subprocess runs; idle-wait when done."""
        while proc.poll() is None:
            if not self.step(pace):
                time.sleep(0.01)

    def finish(self) -> None:
        while self.step():
            pass

    def preemptions_from(self, step: int) -> int:
        """Preemptions of this workload at scheduler steps ≥ `step`."""
        before = [p for s, p in self.trace if s < step]
        return self.preemptions - (before[-1] if before else 0)

    def relative(self, step: int) -> int:
        return step - self.first_step


def test_oom_pressure_halves_the_budget_caps_seqs_and_preemptions_fall(
    oom_engine: InProcessEngine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eng, url = oom_engine, url_of(oom_engine)
    assert knobs(eng) == STARTUP

    # Baseline: the same workload, nothing changed.
    baseline = Workload(eng, "base", 0)
    baseline.finish()
    assert baseline.preemptions > 0, "the workload must really produce KV pressure"

    run = Workload(eng, "oom", 100_000)
    while run.preemptions == 0:
        assert run.step(STEP_PACE_S)
    pressure_step = run.relative(eng.collector.stats.steps)

    # Dry run first: shows before → would-be, changes nothing on the engine.
    proc = cli_background(
        "exec", "oom-pressure", "--engine", url, "--dry-run", "--json", "--db", db_url
    )
    run.run_while(proc)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    dry = json.loads(out)["execution"]
    assert (dry["status"], dry["dry_run"]) == ("succeeded", True)
    planned = {s["action"]: s for s in dry["steps"]}
    assert planned["scale_max_num_batched_tokens"]["status"] == "planned"
    assert planned["scale_max_num_batched_tokens"]["before"] == {"max_num_batched_tokens": 512}
    assert planned["scale_max_num_batched_tokens"]["after"] == {"max_num_batched_tokens": 256}
    assert knobs(eng) == STARTUP  # verified on the engine: nothing changed

    proc = cli_background(
        "exec",
        "oom-pressure",
        "--engine",
        url,
        "--yes",
        "--json",
        "--db",
        db_url,
        "--condition-seconds",
        "1",
        "--verify-seconds",
        "90",
        "--poll-seconds",
        "0.25",
    )
    run.run_while(proc)
    out, err = proc.communicate()
    assert proc.returncode == 0, (out, err)
    execution = json.loads(out)["execution"]
    run.finish()

    assert execution["status"] == "succeeded"
    checks = execution["checks"]
    assert checks["preemption_rate"]["value"] > 0
    assert checks["kv_usage"]["value"] > 0.9
    halve, cap, hand_over = execution["steps"]
    assert (halve["action"], halve["status"]) == ("scale_max_num_batched_tokens", "applied")
    assert (halve["before"], halve["after"]) == (
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 256},
    )
    assert (cap["action"], cap["status"]) == ("set_max_num_seqs", "applied"), cap
    assert cap["params"]["observed"] > 0  # the condition was really evaluated
    capacity = cap["params"]["kv_capacity_seqs"]
    assert cap["params"]["target"] == capacity // 2  # headroom 0.5
    assert (cap["before"], cap["after"]) == ({"max_num_seqs": 32}, {"max_num_seqs": capacity // 2})
    assert halve["applied_at_step"] < cap["applied_at_step"]
    # Then max_num_seqs is handed over to the autopilot, from where the cap left it.
    assert (hand_over["action"], hand_over["status"]) == ("set_autopilot", "applied")
    assert (hand_over["before"]["autopilot"], hand_over["after"]["autopilot"]) == (False, True)
    # Where max_num_seqs was at the hand-over is journaled: a revert puts it back there.
    assert hand_over["before"]["max_num_seqs"] == capacity // 2
    assert hand_over["params"]["max_num_seqs_at_hand_over"] == capacity // 2
    assert cap["applied_at_step"] < hand_over["applied_at_step"]
    verification = execution["verification"]
    assert verification["outcome"] == "improved"
    assert verification["after"] < verification["before"]
    # Where the autopilot had it when the verification judged, journaled.
    settled = verification["autopilot"]["max_num_seqs"]
    assert 1 <= settled <= 32 and verification["autopilot"]["target"] == 0.9
    held = knobs(eng)["max_num_seqs"]
    assert knobs(eng) == {
        **STARTUP,
        "max_num_batched_tokens": 256,
        "max_num_seqs": held,
        "autopilot": True,
    }

    # Preemptions from the step the cap took effect, against the baseline
    # run from the same point of the workload.
    capped_at = cap["applied_at_step"]
    same_point = baseline.first_step + run.relative(capped_at)
    base_after, run_after = baseline.preemptions_from(same_point), run.preemptions_from(capped_at)
    with capsys.disabled():
        print(
            f"\n[oom-pressure] first preemption at workload step {pressure_step}; "
            f"budget 512→256 from step {run.relative(halve['applied_at_step'])}, "
            f"max_num_seqs 32→{capacity // 2} (kv_capacity {capacity}) from step "
            f"{run.relative(capped_at)}, autopilot from step "
            f"{run.relative(hand_over['applied_at_step'])}: max_num_seqs {settled} when "
            f"judged, {held} at the end\n"
            f"[oom-pressure] preemptions/min ({WINDOW_S} s window) {verification['before']:g} → "
            f"{verification['after']:g}; preemptions in the whole workload: baseline "
            f"{baseline.preemptions}, with the runbook {run.preemptions}; after the cap: "
            f"baseline {base_after}, with the runbook {run_after}"
        )
    assert run_after < base_after
    assert run.preemptions < baseline.preemptions

    # The human report: checks and before → after.
    shown = cli("history", str(execution["id"]), "--db", db_url)
    assert shown.returncode == 0, shown.stderr
    assert "max_num_batched_tokens: 512 → 256" in shown.stdout
    assert f"max_num_seqs: 32 → {capacity // 2}" in shown.stdout
    assert "preemption_rate" in shown.stdout

    # A second run inside the cooldown is refused with the time left.
    started = datetime.fromisoformat(execution["started_at"]).timestamp()
    asked = time.time()
    refused = cli("exec", "oom-pressure", "--engine", url, "--yes", "--db", db_url)
    answered = time.time()
    assert refused.returncode == 2, refused.stderr
    match = re.search(r"cooldown: .*; (\w+) left of 600 s", refused.stderr)
    assert match, refused.stderr
    # 600 s from the run's start, as seen while the CLI ran (rounded up to 1 s).
    left = parse_duration(match[1])
    assert 600 - (answered - started) <= left <= 600 - (asked - started) + 1
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert knobs(eng)["max_num_seqs"] == held  # refused: nothing touched

    # Revert: the startup values come back; the journal says so.
    code, reverted, err = cli_json("revert", str(execution["id"]), "--db", db_url)
    assert code == 0, err
    revert = reverted["execution"]
    assert (revert["status"], revert["reverts_id"]) == ("succeeded", execution["id"])
    (restore,) = revert["steps"]
    assert restore["before"] == {
        "max_num_batched_tokens": 256,
        "max_num_seqs": held,
        "autopilot": True,
    }
    assert restore["after"] == {
        "max_num_batched_tokens": 512,
        "max_num_seqs": 32,
        "autopilot": False,
    }
    assert knobs(eng) == STARTUP
    store = Journal(db_url)
    original = store.get_execution(execution["id"])
    assert original.status == "reverted"
    assert [s.status for s in original.steps] == ["reverted", "reverted", "reverted"]
    store.close()
    again = cli("revert", str(execution["id"]), "--db", db_url)
    assert again.returncode == 2 and "already reverted" in again.stderr


def test_sigkill_while_verifying_then_history_and_revert(
    oom_engine: InProcessEngine, db_url: str, tmp_path: Path
) -> None:
    """The run is killed while it verifies: history says interrupted, the revert
    works. On the idle engine the shipped oom-pressure is refused ("nothing to
    improve"), so it runs from a catalog whose oom-pressure acts there."""
    eng, url = oom_engine, url_of(oom_engine)
    catalog = ("--catalog", str(acting_catalog(tmp_path)))
    assert knobs(eng) == STARTUP
    time.sleep(WINDOW_S + 0.5)  # the idle engine's preemption window empties: no step 2
    proc = cli_background(
        "exec",
        "oom-pressure",
        "--engine",
        url,
        "--yes",
        "--db",
        db_url,
        "--condition-seconds",
        "0",
        "--verify-seconds",
        "300",
        "--poll-seconds",
        "0.2",
        *catalog,
    )
    store = Journal(db_url)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "never reached verifying"
            records = store.list_executions()
            if records and records[0].status == "verifying":
                break
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        execution_id = records[0].id
        assert knobs(eng)["max_num_batched_tokens"] == 256  # the change is live

        code, history, err = cli_json("history", "--db", db_url)
        assert code == 0, err
        (shown,) = history["executions"]
        assert (shown["id"], shown["status"], shown["display_status"]) == (
            execution_id,
            "verifying",
            "interrupted",
        )
        halve, skipped, hand_over = shown["steps"]
        assert (halve["status"], halve["before"], halve["after"]) == (
            "applied",
            {"max_num_batched_tokens": 512},
            {"max_num_batched_tokens": 256},
        )
        assert skipped["status"] == "skipped" and skipped["params"]["observed"] == 0
        assert (hand_over["action"], hand_over["status"]) == ("set_autopilot", "applied")

        # The dead run's engine lock does not block the revert.
        reverted = cli("revert", str(execution_id), "--db", db_url, *catalog)
        assert reverted.returncode == 0, reverted.stderr
        assert knobs(eng) == STARTUP
        original = store.get_execution(execution_id)
        assert (original.status, original.error) == ("reverted", "interrupted")
        assert [s.status for s in original.steps] == ["reverted", "skipped", "reverted"]
    finally:
        if proc.poll() is None:
            proc.kill()
        store.close()


def test_a_failing_second_step_rolls_the_first_back(
    oom_engine: InProcessEngine, db_url: str, tmp_path: Path
) -> None:
    eng, url = oom_engine, url_of(oom_engine)
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "two-steps.yaml").write_text(
        "name: two-steps\n"
        "description: step 2 goes below the budget floor\n"
        "steps:\n"
        "  - action: set_max_num_seqs\n"
        "    params: {value: 16}\n"
        "  - action: scale_max_num_batched_tokens\n"
        "    params: {factor: 0.01, clamp: false}\n"
    )
    code, out, err = cli_json(
        "exec", "two-steps", "--engine", url, "--yes", "--db", db_url, "--catalog", str(catalog)
    )
    assert code == 1, err
    execution = out["execution"]
    assert execution["status"] == "rolled_back"
    first, second = execution["steps"]
    assert (first["status"], first["before"], first["after"]) == (
        "reverted",
        {"max_num_seqs": 32},
        {"max_num_seqs": 16},
    )
    assert second["status"] == "failed"
    assert "below the minimum 16" in second["error"]
    assert "rolled back" in err and err.count("\n") == 1
    assert knobs(eng) == STARTUP  # nothing half-applied


def test_engine_down_is_one_line_and_a_failed_execution(db_url: str) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    result = cli("exec", "oom-pressure", "--engine", down, "--yes", "--db", db_url)
    assert result.returncode == 3
    assert result.stderr.startswith("runbook: error: engine http://127.0.0.1:")
    assert "unreachable" in result.stderr and result.stderr.count("\n") == 1
    store = Journal(db_url)
    (record,) = store.list_executions()
    store.close()
    assert (record.status, record.steps) == ("failed", ())
    assert record.error is not None and "unreachable" in record.error


def test_broken_runbook_yaml_names_file_and_line(tmp_path: Path, db_url: str) -> None:
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "broken.yaml").write_text(
        "name: broken\ndescription: x\nsteps:\n  - action: halve\n    params: {}\n"
    )
    result = cli(
        "exec",
        "broken",
        "--engine",
        "http://127.0.0.1:9",
        "--db",
        db_url,
        "--catalog",
        str(catalog),
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 2, result.stderr  # the heading, then one line per problem
    assert re.match(
        r"runbook: error: invalid runbook catalog:\n\S*broken\.yaml:4: runbook broken: "
        r"unknown action 'halve'\n$",
        result.stderr,
    ), result.stderr


def test_a_fix_that_works_is_not_rolled_back_by_a_reading_from_before_it(
    oom_engine: InProcessEngine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The storm of issue 12: exec starts early in a preemption storm, the
    storm goes on while the condition waits, the cap stops it. The verification
    reads preemptions only from the step the cap took effect at; a trailing
    window at that moment still holds the storm before the cap."""
    eng, url = oom_engine, url_of(oom_engine)
    assert knobs(eng) == STARTUP
    time.sleep(WINDOW_S + 0.5)  # the preemption window holds only this storm
    storm = Workload(eng, "storm", 200_000)
    while storm.preemptions < 3:  # early in the storm
        assert storm.step(STEP_PACE_S)
    proc = cli_background(
        "exec",
        "oom-pressure",
        "--engine",
        url,
        "--yes",
        "--json",
        "--db",
        db_url,
        "--condition-seconds",
        "2",
        "--verify-seconds",
        "90",
        "--poll-seconds",
        "0.25",
    )
    storm.run_while(proc)
    out, err = proc.communicate()
    storm.finish()
    execution = json.loads(out)["execution"]
    halve, cap, hand_over = execution["steps"]
    assert (cap["action"], cap["status"]) == ("set_max_num_seqs", "applied"), cap
    assert (hand_over["action"], hand_over["status"]) == ("set_autopilot", "applied")
    capped = cap["after"]["max_num_seqs"]
    v = execution["verification"]
    m = v["measurement"]
    cumulative = dict(storm.trace)
    applied, effective = cap["applied_at_step"], m["effective_step"]
    last_step = effective - 1 + m["steps"]
    # The storm went on between the halving and the cap, and while the running
    # requests above the cap drained: what a trailing window still holds.
    between = cumulative[applied - 1] - cumulative[halve["applied_at_step"] - 1]
    draining = cumulative[effective - 1] - cumulative[applied - 1]
    with capsys.disabled():
        print(
            f"\n[storm] budget 512→256 at step {halve['applied_at_step']}, max_num_seqs "
            f"32→{capped} at step {applied}, in effect (running ≤ cap) from step {effective}; "
            f"preemptions between the two changes {between}, while draining {draining}\n"
            f"[storm] preemptions/min before {v['before']:g} (trailing {WINDOW_S} s window at "
            f"the checks) → after {v['after']:g} ({m['preemptions']} in {m['seconds']:.1f} s "
            f"from step {effective}); the trailing window at the end read "
            f"{v.get('trailing_window_after')}; outcome {v['outcome']}; status "
            f"{execution['status']}\n[storm] guards: "
            + "; ".join(
                f"{g} {r['before']} → {r['after']} ({r['outcome']})" for g, r in v["guards"].items()
            )
        )
    # Measured from the step the hand-over (right after the cap) took effect
    # at, never before it.
    assert applied < hand_over["applied_at_step"]
    assert v["from_step"] == m["from_step"] == hand_over["applied_at_step"] <= effective
    exact = cumulative[last_step] - cumulative[effective - 1]
    assert m["preemptions"] == exact
    assert v["after"] == pytest.approx(exact * 60.0 / m["seconds"])
    assert v["outcome"] == "improved", (v, err)
    assert v["after"] <= 0.5 * v["before"]
    assert (proc.returncode, execution["status"]) == (0, "succeeded"), err
    final = knobs(eng)
    assert final == {**final, "max_num_batched_tokens": 256, "autopilot": True}
    assert 1 <= final["max_num_seqs"] <= 32
    code, _, err = cli_json("revert", str(execution["id"]), "--db", db_url)
    assert code == 0, err
    assert knobs(eng) == STARTUP


class _Hook:
    """A notification receiver on loopback: every JSON body it got."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict[str, Any]] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_advisory_mode_a_storm_is_advised_notified_and_no_knob_changes(
    oom_engine: InProcessEngine,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`mode: advisory` in the service's configuration: the storm's alert becomes
    an advised execution (checks, the would-be changes computed from the engine's
    knobs, the decision), a notification, and no call of the agent's control
    endpoint; the knobs read back unchanged. Its resolution is journaled and
    `runbook report` sets the advice beside it."""
    import threading
    from datetime import UTC

    from vllm_runbook.runbooks.engine.client import EngineClient
    from vllm_runbook.runbooks.engine.operations import engine_registry
    from vllm_runbook.runbooks.model.catalogs import load_deployment
    from vllm_runbook.runbooks.operate.cli import main
    from vllm_runbook.runbooks.run.executor import Executor
    from vllm_runbook.runbooks.service.alertmanager import WebhookPayload
    from vllm_runbook.runbooks.service.notify import Notifier
    from vllm_runbook.runbooks.service.webhooks import Router, ingest
    from vllm_runbook.runbooks.service.worker import Worker

    eng, url = oom_engine, url_of(oom_engine)
    assert knobs(eng) == STARTUP
    control_calls: list[Any] = []
    submit = eng.collector.control.submit
    monkeypatch.setattr(
        eng.collector.control, "submit", lambda *a, **k: control_calls.append(a) or submit(*a, **k)
    )
    hook = _Hook()
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        f"database: {db_url}\n"
        "mode: advisory\n"
        "engines:\n"
        f"  - {{name: cpu-0, agent: '{url}', labels: {{instance: 'cpu-0:8000'}}}}\n"
        "automation: {oom-pressure: auto}\n"
        f"notifications:\n  receivers:\n    - {{name: ops, type: webhook, url: '{hook.url}'}}\n"
    )
    registry = engine_registry()
    deployment = load_deployment(cfg, None, registry)
    config, runbooks = deployment.config, deployment.runbooks
    assert "oom-pressure" in config.advisory(runbooks)
    router = Router(
        engines=config.engines,
        automation=config.automation,
        alert_runbooks=deployment.alert_runbooks,
        known_runbooks=frozenset(runbooks),
        advisory=config.advisory(runbooks),
    )
    store = Journal(db_url)
    executor = Executor(store, runbooks, registry, alert_for_seconds=deployment.alert_for_seconds)
    worker = Worker(store, executor)
    notifier = Notifier.from_config(store, config.notifications)
    starts_at = datetime.now(UTC).isoformat()

    def deliver(status: str) -> Any:
        labels = {"alertname": "VllmOOMPressure", "instance": "cpu-0:8000"}
        alert = {"status": status, "labels": labels, "startsAt": starts_at, "fingerprint": "f1"}
        raw = {"version": "4", "groupKey": "g", "status": status, "receiver": "r"}
        raw["alerts"] = [alert]
        return ingest(store, router, WebhookPayload.model_validate(raw), raw)

    try:
        storm = Workload(eng, "advised", 200_000)
        while storm.preemptions == 0:
            assert storm.step(STEP_PACE_S)
        [created] = deliver("firing").executions
        assert (created["mode"], created["runbook"]) == ("advisory", "oom-pressure")
        ran = threading.Thread(target=worker.tick)
        ran.start()
        while ran.is_alive():  # the storm goes on while the service decides
            storm.step(STEP_PACE_S)
        ran.join()
        advised = store.get_execution(created["id"])
        assert (advised.status, advised.dry_run, advised.display_status) == (
            "succeeded",
            True,
            "advised",
        )
        assert advised.reason == "advisory: would act"
        assert advised.checks is not None and advised.checks["preemption_rate"]["value"] > 0
        halve, cap, hand_over = advised.steps
        assert [s.status for s in advised.steps] == ["planned"] * 3
        assert (halve.before, halve.after) == (
            {"max_num_batched_tokens": 512},
            {"max_num_batched_tokens": 256},
        )
        capacity = cap.params["kv_capacity_seqs"]
        assert (cap.before, cap.after) == ({"max_num_seqs": 32}, {"max_num_seqs": capacity // 2})
        assert cap.params["when"] == "preemptions_per_minute > 0 after 30 s"
        assert hand_over.after == {"autopilot": True, "max_num_seqs": 32}
        assert control_calls == []  # not even a dry run reached the control endpoint
        eng.engine.abort_request([f"advised-{i}" for i in range(64)])
        assert not eng.engine.has_unfinished_requests()
        assert knobs(eng) == STARTUP  # read back through the agent: unchanged
        # What was computed from /v1/state is what the agent answers to the same dry run.
        agent = EngineClient(url)
        for step in (halve, cap):
            request = {"max_num_seqs": capacity // 2} if step is cap else {}
            if step is halve:
                request = {"scale_max_num_batched_tokens": 0.5, "clamp": True}
            answer = agent.set_knobs(dry_run=True, **request)
            assert answer.would_be is not None
            assert {k: getattr(answer.would_be, k) for k in step.after} == step.after

        # The notification: one "advised" event, what it would do and why.
        notifier.poll()
        for receiver in notifier.receivers:
            notifier.send_queued(receiver)
        [body] = hook.bodies
        assert (body["event"], body["execution_id"]) == ("advised", advised.id)
        assert "advisory mode: nothing changed" in body["text"].splitlines()[0]
        assert "Reason: advisory: would act" in body["text"]
        assert (
            "scale_max_num_batched_tokens planned: max_num_batched_tokens: 512 → 256"
            in (body["text"])
        )

        # The finding resolves by itself: journaled; nothing held, nothing reverted.
        [resolution] = deliver("resolved").resolved
        worker.resolved.put(resolution)  # as the app hands it over
        worker.tick()
        resolved = store.get_execution(advised.id)
        assert resolved.hold_since is not None and resolved.display_status == "advised"
        assert store.holding_executions() == []
        assert [e.reverts_id for e in store.list_executions()] == [None]
        assert knobs(eng) == STARTUP

        assert main(["history", "--db", db_url]) == 0
        history = capsys.readouterr().out
        assert "advised" in history and "advisory: would act" in history
        assert "(dry run)" not in history
        main(["report", str(advised.id), "--db", db_url, "-o", str(tmp_path / "r.png")])
        report = capsys.readouterr().out
        assert "advisory mode: would act" in report
        assert "would have: scale_max_num_batched_tokens: max_num_batched_tokens 512 → 256" in (
            report
        )
        assert "the finding resolved by itself at" in report
    finally:
        hook.close()
        notifier.stop()
        store.close()
