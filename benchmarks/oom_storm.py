"""The preemption storm of issue 12, end to end on a served CPU engine.

A fresh machine's on-call engineer runs the shipped oom-pressure runbook,
with its shipped timings, against an engine in a preemption storm:

    python benchmarks/oom_storm.py [--rounds 3]

Each round is a fresh engine and a fresh journal; the last lines give each
figure's median and spread (lowest-highest round) and the load average at
the start and the end, the conditions the figures were measured in.

The engine is vLLM's OpenAI server with the plugin: the tiny random-weight
model, 256 KV blocks of 32 tokens, a token budget of 512 and max_num_seqs 32,
under 64 closed-loop clients sending 300-600-token prompts for 300 tokens
each. Once the agent has counted a preemption, `runbook exec oom-pressure
--engine URL --yes --json` runs with a journal directory that does not exist
yet (first use creates and migrates it). The script prints what the
verification and each guard read before and after the change, and beside it
the fix's cost from a source independent of the plugin: generated tokens per
second from vLLM's own counter (the API server's /metrics), over the storm
before exec and over the period the verification measured. (vLLM's own
preemption counter is not comparable: it counts a preemption when the
preempted request next produces output, so it lags the scheduler by the
requeued request's wait.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids
from vllm_runbook.runbooks.demo.servers import api_server_command, free_port, logged_process

HEADER = "| what | before | after | outcome |\n|---|---|---|---|"

CLIENTS, PROMPT_MIN, PROMPT_MAX, OUTPUT_TOKENS = 64, 300, 600, 300
RUNBOOK = [sys.executable, "-m", "vllm_runbook.runbooks.operate.cli"]
COLLECTOR_WINDOW_S = 60.0  # the collector's default window (VLLM_RUNBOOK_WINDOW_SECONDS)
KV_BLOCKS, BLOCK_SIZE, BUDGET, MAX_NUM_SEQS, MAX_MODEL_LEN = 256, 32, 512, 32, 1024


def engine_command(model: Path, port: int) -> list[str]:
    return api_server_command(
        model,
        port,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        num_gpu_blocks_override=KV_BLOCKS,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
    )


class ClosedLoop:
    """`CLIENTS` clients, each sending its next request when the last one is done."""

    def __init__(self, api: str) -> None:
        self.api, self.done, self.started = api, 0, 0.0
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.started = time.time()
        self.thread.start()
        for i in range(CLIENTS):
            asyncio.run_coroutine_threadsafe(self._client(i), self.loop)

    async def _client(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=600) as http:
            n = 0
            while True:
                n += 1
                body = {
                    "model": "tiny-llama",
                    "prompt": prompt_token_ids(
                        rng.randint(PROMPT_MIN, PROMPT_MAX), offset=seed * 100_003 + n * 7919
                    ),
                    "max_tokens": OUTPUT_TOKENS,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                for attempt in range(3):
                    try:
                        response = await http.post(self.api + "/v1/completions", json=body)
                        response.raise_for_status()
                        self.done += 1
                        break
                    except httpx.TransportError as exc:
                        # Typically a keep-alive connection the server closed as it
                        # was reused: a completion can simply be sent again.
                        if attempt == 2:
                            self.errors.append(f"{type(exc).__name__}: {exc}")
                    except httpx.HTTPError as exc:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                        await asyncio.sleep(0.5)
                        break

    def stop(self) -> None:
        def cancel() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(0.5, self.loop.stop)

        self.loop.call_soon_threadsafe(cancel)
        self.thread.join(5)


def series(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named series (any labels) in a Prometheus text exposition."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


class Recorder:
    """Samples vLLM's own generated-token counter (the API server's /metrics: a
    source independent of the plugin) about once a second, each sample stamped
    with the moment its answer arrived."""

    NAMES = ("vllm:generation_tokens_total",)

    def __init__(self, api: str) -> None:
        self.url = api + "/metrics"
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                values = series(self.url, self.NAMES)
                self.samples.append((time.time(), values))
            except OSError:
                pass
            if self.stopping.wait(1.0):
                return

    def at(self, name: str, t: float) -> float:
        """The counter at time `t`, interpolated between the samples around it
        (the recorder starts before the load, so earlier means the first sample)."""
        points = [(ts, v[name]) for ts, v in self.samples]
        if t <= points[0][0]:
            return points[0][1]
        for (t0, v0), (t1, v1) in itertools.pairwise(points):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return points[-1][1]

    def rate(self, name: str, start: float, end: float) -> float:
        """The counter's increase per second over [start, end], the window's full
        length (as the collector's windowed rates are)."""
        return (self.at(name, end) - self.at(name, start)) / (end - start)

    def longest_gap(self) -> float:
        times = [ts for ts, _ in self.samples]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def wait_for_preemption(agent: str, deadline_s: float) -> float:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if series(agent + "/metrics", ("vllm_runbook_preemptions_total",)).popitem()[1] > 0:
            return time.time()
        time.sleep(0.5)
    raise SystemExit(f"no preemption within {deadline_s:g} s: the storm did not start")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--storm-seconds", type=float, default=10, help="storm before exec (default 10)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="storms, each on a fresh engine (default 3)"
    )
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    figures = []
    for r in range(args.rounds):
        print(f"## round {r + 1} of {args.rounds} (load average {os.getloadavg()[0]:.1f})")
        row = storm(args.storm_seconds)
        if row is None:
            return 1
        figures.append(row)
        print()
    summarize(figures, load_start)
    return 0


def summarize(figures: list[dict[str, float]], load_start: float) -> None:
    """Median and spread (lowest-highest round) of each figure over the rounds."""
    print(
        f"over {len(figures)} rounds (load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs): median (lowest-highest)"
    )
    for key, label in (
        ("verify_before", "verification before"),
        ("verify_after", "verification after"),
        ("tok_s_before", "vLLM generated tokens/s before"),
        ("tok_s_after", "vLLM generated tokens/s after"),
        ("exec_seconds", "runbook exec seconds"),
    ):
        values = [f[key] for f in figures if f.get(key) is not None]
        if values:
            print(
                f"- {label}: {statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"
            )
    improved = sum(1 for f in figures if f.get("improved"))
    print(f"- verified improved in {improved} of {len(figures)} rounds")


def storm(storm_seconds: float) -> dict[str, Any] | None:
    """One storm on a fresh engine, the runbook run into it; its figures (None: exec failed)."""
    with tempfile.TemporaryDirectory(prefix="oom-storm-") as tmp:
        work = Path(tmp)
        model = create_tiny_model(work / "tiny-llama")
        port, agent_port = free_port(), free_port()
        env = {
            **os.environ,
            "VLLM_RUNBOOK_PORT": str(agent_port),
            "VLLM_RUNBOOK_RUNTIME_DIR": str(work / "run"),
        }
        api, agent = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{agent_port}"
        with logged_process(
            engine_command(model, port), work / "engine.log", api + "/health", 300, env=env
        ):
            load, recorder = ClosedLoop(api), Recorder(api)
            recorder.thread.start()
            load.start()
            first = wait_for_preemption(agent, 180)
            time.sleep(storm_seconds)
            # A fresh machine: no journal yet, the default location under XDG_DATA_HOME.
            cli_env = {k: v for k, v in env.items() if k != "RUNBOOK_DB_URL"}
            cli_env["XDG_DATA_HOME"] = str(work / "fresh-data-home")
            started = time.time()
            proc = subprocess.run(
                [*RUNBOOK, "exec", "oom-pressure", "--engine", agent, "--yes", "--json"],
                env=cli_env,
                capture_output=True,
                text=True,
            )
            ended = time.time()
            recorder.stopping.set()
            recorder.thread.join(35)
            load.stop()
        if not proc.stdout.strip():
            print(f"runbook exec exited {proc.returncode}: {proc.stderr.strip()}")
            return None
        return report(
            json.loads(proc.stdout)["execution"], proc, recorder, first, started, ended, load
        )


def report(
    execution: dict[str, Any],
    proc: subprocess.CompletedProcess[str],
    recorder: Recorder,
    first: float,
    started: float,
    ended: float,
    load: ClosedLoop,
) -> dict[str, Any]:
    v = execution["verification"]
    m = v.get("measurement") or {}
    print(
        f"runbook exec oom-pressure: exit {proc.returncode}, status {execution['status']}, "
        f"{ended - started:.0f} s; first preemption {started - first:.0f} s before exec"
    )
    for step in execution["steps"]:
        note = (step.get("params") or {}).get("note")
        print(
            f"- {step['action']}: {step['status']}"
            + (f" ({note})" if note else "")
            + (
                f", {step['before']} -> {step['after']} at step {step['applied_at_step']}"
                if step.get("before")
                else ""
            )
        )
    print()
    print(HEADER)
    print(
        f"| verification: {v['signal']} ({v.get('needed')}) | {fmt(v.get('before'))} | "
        f"{fmt(v.get('after'))} | {v.get('outcome')} |"
    )
    for guard, row in (v.get("guards") or {}).items():
        print(f"| guard: {guard} | {fmt(row['before'])} | {fmt(row['after'])} | {row['outcome']} |")
    # The same windows, counted independently from the engine's /metrics.
    # Before: the storm up to exec's checks (at most the collector's window);
    # after: the period the verification measured, from the step the last
    # change took effect at.
    after_start = float(m.get("from_time") or ended)
    name = Recorder.NAMES[0]
    before = recorder.rate(name, max(started - COLLECTOR_WINDOW_S, load.started), started)
    after = recorder.rate(name, after_start, after_start + float(m.get("seconds") or 0))
    print(f"| vLLM /metrics: generated tokens per second | {before:.4g} | {after:.4g} | - |")
    print(
        f"\nafter measured {m.get('seconds', 0):.1f} s from step {m.get('effective_step')}; "
        f"{load.done} requests completed, {len(load.errors)} failed; vLLM's /metrics sampled "
        f"{len(recorder.samples)} times (longest gap {recorder.longest_gap():.1f} s)"
        + (f" (first: {load.errors[0]})" if load.errors else "")
    )
    return {
        "verify_before": v.get("before"),
        "verify_after": v.get("after"),
        "tok_s_before": before,
        "tok_s_after": after,
        "exec_seconds": ended - started,
        "improved": v.get("outcome") == "improved",
    }


if __name__ == "__main__":
    sys.exit(main())
