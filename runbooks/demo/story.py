"""The story: start the engine and the service, drive the five phases, stop
everything on the way out (also on Ctrl-C and SIGTERM)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_runbook.runbooks.demo.config import (
    BLOCK_SIZE,
    BURST_AFTER_FIX_S,
    BURST_MAX_S,
    COLLECTOR_WINDOW_S,
    EVALUATION_INTERVAL,
    HIGH,
    KV_BLOCKS,
    LOW,
    MAX_NUM_SEQS,
    RECOVERY_MAX_S,
    RECOVERY_MIN_S,
    SETTLE_MAX_S,
    STARVATION_AFTER_FIX_S,
    STARVATION_MAX_S,
    STARVATION_THRESHOLD_S,
    STEADY_S,
    STORY_DEADLINE_S,
    STREAM_HOLDING_S,
    STREAM_MAX_S,
    engine_command,
    write_config,
    write_runbooks,
)
from vllm_runbook.runbooks.demo.live import (
    Demo,
    EventFeed,
    Monitor,
    PhaseMeasure,
    StreamAfterFix,
    finished,
    runs_of,
)
from vllm_runbook.runbooks.demo.report import SignalLog, signals_path_for
from vllm_runbook.runbooks.demo.servers import (
    NotReady,
    ProcessExited,
    free_port,
    start_logged,
    stop_group,
    wait_http,
)
from vllm_runbook.runbooks.demo.summary import conclude
from vllm_runbook.runbooks.demo.traffic import (
    Backlog,
    Request,
    Traffic,
    long_request,
    steady_request,
    stream_request,
)
from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError
from vllm_runbook.runbooks.service.api import Execution
from vllm_runbook.runbooks.store.models import ExecutionStatus


class DemoFailed(Exception):
    """The demo could not set up (engine or service did not start)."""


@dataclass
class Process:
    """A server the demo started: its name for messages, the process, its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 20 s."""
        stop_group(self.proc, 20)


def spawn(name: str, cmd: list[str], env: dict[str, str], log: Path) -> Process:
    return Process(name, start_logged(cmd, log, env), log)


def wait_healthy(process: Process, url: str, deadline_s: float) -> None:
    try:
        wait_http(url, deadline_s, process.proc, interval=1.0)
    except ProcessExited as exc:
        raise DemoFailed(
            f"{process.name} exited with {exc.returncode}; see {process.log}"
        ) from None
    except NotReady:
        raise DemoFailed(
            f"{process.name} did not answer {url} in time; see {process.log}"
        ) from None


def _queued(client: EngineClient) -> bool:
    """Every slot the admission limit allows now busy, and a few more requests waiting."""
    try:
        state = client.state()
    except EngineClientError:
        return False
    stats, seqs = state.stats, state.knobs.max_num_seqs
    return stats.requests_running >= seqs and stats.requests_waiting >= 2


def _wait(demo: Demo, seconds: float, until: Callable[[], bool] | None = None) -> bool:
    """Sleep up to `seconds` (never past the story's deadline); True if `until` held."""
    end = time.monotonic() + min(seconds, max(0.0, demo.left()))
    while time.monotonic() < end:
        if until is not None and until():
            return True
        time.sleep(0.5)
    return until is not None and until()


def run(directory: Path, ci: bool) -> int:
    from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids

    t_start = time.monotonic()
    demo = Demo(directory, ci, t_start + STORY_DEADLINE_S)
    directory.mkdir(parents=True, exist_ok=True)
    db_path = (directory / "runbook.db").resolve()
    db_url = f"sqlite:///{db_path}"
    signals = signals_path_for(db_url)
    assert signals is not None
    for stale in (db_path, signals, directory / "demo-timeline.png"):
        stale.unlink(missing_ok=True)

    demo.say("creating the tiny local model (random weights, no download)")
    model = create_tiny_model(directory / "tiny-llama")
    api_port, agent_port, service_port = free_port(), free_port(), free_port()
    api, agent = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{agent_port}"
    service = f"http://127.0.0.1:{service_port}"
    runbooks_dir = write_runbooks(directory / "runbooks")
    config = write_config(directory / "runbook.yaml", db_url, agent, api)
    runtime = Path(tempfile.mkdtemp(prefix="runbook-demo-"))
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the EngineCore in its own process
        # No pinning of the model worker to a core: on a small machine shared
        # with other work the scheduler balances better than a fixed core.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_RUNBOOK_PORT": str(agent_port),
        "VLLM_RUNBOOK_HOST": "127.0.0.1",
        "VLLM_RUNBOOK_WINDOW_SECONDS": str(COLLECTOR_WINDOW_S),
        # The reports' warm-up at engine start, before /health answers (not the
        # runbook that warms a cold engine under traffic).
        "VLLM_RUNBOOK_WARMUP": "on",
        "VLLM_RUNBOOK_RUNTIME_DIR": str(runtime),  # the agent's token, found by the service
        "RUNBOOK_WEBHOOK_TOKEN": os.urandom(16).hex(),  # loopback webhook, unused here
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_RUNBOOK_TOKEN", None)
    os.environ["VLLM_RUNBOOK_RUNTIME_DIR"] = str(runtime)  # this process's EngineClient

    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, runtime, ignore_errors=True)
        demo.say(
            f"starting vLLM (CPU, {KV_BLOCKS} KV blocks of {BLOCK_SIZE}, max_num_seqs "
            f"{MAX_NUM_SEQS}, policy priority) and `runbook serve` (SQLite, rules every "
            f"{EVALUATION_INTERVAL}); logs in {directory}/"
        )
        engine = spawn("vLLM", engine_command(model, api_port), env, directory / "vllm.log")
        stack.callback(lambda: _stop(demo, engine))
        serve = spawn(
            "runbook serve",
            [
                sys.executable,
                "-m",
                "vllm_runbook.runbooks.operate.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(service_port),
                "--catalog",
                str(runbooks_dir),
            ],
            env,
            directory / "service.log",
        )
        stack.callback(lambda: _stop(demo, serve))
        wait_healthy(serve, service + "/healthz", 120)
        wait_healthy(engine, api + "/health", 240)
        client = EngineClient(agent)
        startup = client.state().startup.model_dump()
        demo.say(f"engine up after {time.monotonic() - t_start:.0f} s; startup knobs {startup}")

        log = SignalLog(signals)
        stack.callback(log.close)
        traffic = Traffic(api, "tiny-llama", log)
        stack.callback(traffic.close)
        feed = EventFeed(service, lambda line: demo.say(line, event=True))
        monitor = Monitor(demo, client, traffic, feed).start()
        stack.callback(monitor.close)
        feed.start()
        stack.callback(feed.close)
        low: list[Request] = []  # every low-priority request sent
        starved: list[Request] = []  # the batch that was starved (the last one)
        measured: dict[str, str] = {}  # alert -> what the phase measured when it did not fire

        def enter(name: str, what: str) -> None:
            traffic.phase = name
            log.write("phase", t=time.time(), name=name)
            demo.phase_banner(name, what)

        # 1. steady
        enter("steady", "4 clients, mixed lengths, a shared 128-token system prompt")
        steady = traffic.clients(4, steady_request)
        _wait(demo, STEADY_S)
        steady.stop()

        # 2. long burst until oom-pressure acted and its effect shows
        enter("long-burst", "16 clients, 500-750 token prompts: the KV cache overflows")
        burst = traffic.clients(16, long_request)
        burst_seen = PhaseMeasure(monitor)
        fixed_at: list[float] = []

        def oom_done() -> bool:
            burst_seen.update()
            runs = [e for e in runs_of(feed, "oom-pressure") if finished(e)]
            if runs and not fixed_at:
                fixed_at.append(time.monotonic())
            return bool(fixed_at) and time.monotonic() - fixed_at[0] >= BURST_AFTER_FIX_S

        if not _wait(demo, BURST_MAX_S, oom_done):
            measured["VllmOOMPressure"] = f"in {burst_seen.seconds():.0f} s of burst {burst_seen}"
        burst.stop()  # long requests still in flight are cancelled

        # 2b. steady traffic until oom-pressure's changes are restored: a revert
        # that meets the next phase's load half-way halts (its circuit breaker,
        # "preemptions got worse"), and the story would end with knobs not back.
        enter("settle", "4 steady clients; oom-pressure's finding resolves, the service restores")
        settle = traffic.clients(4, steady_request)

        def restored() -> bool:
            reverts = [e for e in feed.executions.values() if e.reverts_id is not None]
            return all(
                e.status == "reverted" or any(r.reverts_id == e.id and finished(r) for r in reverts)
                # latency-spike too: on a slow machine the burst's own queue
                # can make it act before the starvation phase
                for e in runs_of(feed, "oom-pressure") + runs_of(feed, "latency-spike")
            )

        if fixed_at and not _wait(demo, SETTLE_MAX_S, restored):
            demo.say(f"changes not restored after {SETTLE_MAX_S} s; going on")
        settle.stop()

        # 3. starvation until latency-spike acted and the starved requests got through
        enter(
            "starvation",
            "a high-priority backlog that never drains; 8 low-priority requests wait behind it",
        )
        # Open-loop high-priority arrivals: first as many as the admission
        # limit allows now (whatever the autopilot left it at) and a few more,
        # then the low ones, then a queue sized by the measured completion
        # rate. Under `priority` the low ones wait as long as any high one
        # does; in arrival order only the first few are ahead of them.
        backlog = Backlog(traffic, stream_request, monitor.queue, priority=HIGH)
        backlog.depth = 4
        # Only what happens in this phase counts: on a slow machine the burst's
        # own queue can make the starvation finding fire (and latency-spike run,
        # or be refused once it resolved) before this phase began.
        before = max(feed.executions, default=0)

        def spike_runs() -> list[Execution]:
            return [e for e in runs_of(feed, "latency-spike") if e.id > before]

        def filled() -> bool:
            backlog.tick()
            return _queued(client)

        _wait(demo, 30, filled)
        batches: list[list[Request]] = []

        def send_low() -> None:
            first = 1000 * len(batches)
            batches.append(
                [traffic.send(prompt_token_ids(64, first + 97 * i), 16, LOW) for i in range(8)]
            )
            low.extend(batches[-1])

        send_low()
        backlog.size_by_rate()
        served_at: list[float] = []

        def starved_served() -> bool:
            waiting = sum(1 for r in low if r.t1 is None)
            backlog.tick(lower_waiting=waiting)
            runs = [e for e in spike_runs() if finished(e)]
            policy = None if monitor.state is None else monitor.state.knobs.policy
            acted = bool(spike_runs()) or policy not in (None, "priority")
            if not acted and any(r.ok for r in batches[-1]):
                # The queue drained before the finding fired and the low ones
                # got in: they were not starved. Start their wait again.
                waited = max((r.t1 or time.time()) - r.t0 for r in batches[-1])
                demo.say(
                    f"the high-priority queue drained: low-priority requests admitted after "
                    f"{waited:.0f} s; 8 more sent"
                )
                send_low()
            last = batches[-1]
            if runs and all(r.t1 is not None for r in last) and not served_at:
                served_at.append(time.monotonic())
            return bool(served_at) and time.monotonic() - served_at[0] >= STARVATION_AFTER_FIX_S

        if not _wait(demo, STARVATION_MAX_S, starved_served):
            now = time.time()
            oldest = max(((r.t1 or now) - r.t0 for r in low), default=0.0)
            measured["VllmRequestStarvation"] = (
                f"the oldest low-priority request waited {oldest:.0f} s (threshold "
                f"{STARVATION_THRESHOLD_S} s) in {len(batches)} batch(es) of 8; the "
                f"high-priority queue kept {backlog.depth} deep "
                + (
                    f"held at least {backlog.min_waiting}"
                    if backlog.min_waiting
                    else "emptied at times"
                )
                + f" and was empty at {backlog.drained} readings"
            )

        # A run still in flight (the phase's bound came first) is seen to its end here,
        # not narrated into the next phase.
        def spike_finished() -> bool:
            backlog.tick()
            return all(finished(e) for e in spike_runs())

        _wait(demo, 60, spike_finished)
        starved = batches[-1]
        if backlog.min_waiting is not None:
            demo.say(backlog_said(backlog.min_waiting, backlog.depth, backlog.drained))

        # 3b. The high-priority stream outlasts the fix: the finding resolves (the
        # switch works), its cause does not, and the switch holds.
        fixed = [e for e in spike_runs() if e.status == ExecutionStatus.SUCCEEDED]
        stream = StreamAfterFix(monitor, feed, fixed[-1].id if fixed else None)
        if fixed:
            # Under FCFS the queue's head waits as long as the queue holds work:
            # 10 s of it keeps the cause (over 2 s) and lets the finding (45 s) resolve.
            backlog.shorten(10.0)
            demo.say(
                f"the high-priority stream goes on after the switch ({backlog.depth} kept "
                f"queued): #{fixed[-1].id} must hold FCFS while it lasts"
            )

            def seen_holding() -> bool:
                backlog.tick()
                held = stream.update()
                # Reverted by its hold: the engine's queue had drained (the cause gone).
                return held >= STREAM_HOLDING_S or (stream.reverted and held > 0)

            if not _wait(demo, STREAM_MAX_S, seen_holding):
                measured["not holding"] = stream.said(STREAM_MAX_S)
        backlog.stop()
        if fixed:
            demo.say(stream.said(STREAM_MAX_S))
            if stream.not_fcfs:
                measured["flipped"] = stream.said(STREAM_MAX_S)

        # 4. recovery until every change is reverted
        enter("recovery", "4 steady clients; the findings resolve, the service reverts")
        recovery = traffic.clients(4, steady_request)
        t_recovery = time.monotonic()

        def all_reverted() -> bool:
            runs = runs_of(feed, "oom-pressure") + runs_of(feed, "latency-spike")
            reverted = bool(runs) and all(e.status == ExecutionStatus.REVERTED for e in runs)
            return reverted and time.monotonic() - t_recovery >= RECOVERY_MIN_S

        _wait(demo, RECOVERY_MAX_S, all_reverted)
        recovery.stop()
        _wait(demo, 2)
        final = client.state()
        monitor.close()
        feed.close()
        traffic.close()
        story_s = time.monotonic() - t_start

    return conclude(demo, signals, feed, traffic, starved, low, final, story_s, measured)


def backlog_said(fewest: int, depth: int, empty_readings: int) -> str:
    """What the starvation phase measured of the high-priority queue while the
    low-priority requests waited (never "at least 0 waited")."""
    if fewest > 0:
        return (
            f"while low-priority requests waited, at least {fewest} high-priority ones "
            f"waited ahead of them at every reading (queue kept {depth} deep)"
        )
    return (
        f"while low-priority requests waited, the high-priority queue (kept {depth} deep) "
        f"was empty at {empty_readings} reading(s): they waited behind the running ones"
    )


def _stop(demo: Demo, process: Process) -> None:
    if process.alive():
        demo.say(f"stopping {process.name}")
    process.stop()
