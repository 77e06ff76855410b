"""`make demo`: a tiny vLLM engine with the plugin, under a workload, live.

What it does (and nothing more): creates a random-weight tiny Llama locally,
starts vLLM's OpenAI server on the CPU with the collector plugin and a small
KV cache, drives steady traffic and then a burst of long prompts that fills
the KV cache, prints the collector's live signals every second, and shows
the control plane: it halves max_num_batched_tokens and caps max_num_seqs
on the running engine, then restores them. Exits non-zero when the signals
did not show what the workload must produce (traffic, KV pressure,
preemptions, the knob change and its restore).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from runbooks.client import EngineClient

DEMO_DIR = Path(os.environ.get("RUNBOOK_DEMO_DIR", ".demo"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served_engine(model: Path, log: Path) -> Iterator[tuple[str, str]]:
    api_port, agent_port = _free_port(), _free_port()
    env = {**os.environ, "VLLM_RUNBOOK_PORT": str(agent_port), "VLLM_RUNBOOK_HOST": "127.0.0.1"}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(api_port),
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--num-gpu-blocks-override",
        "256",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.2",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    api, agent = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{agent_port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(api + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError(f"vLLM did not become healthy in 300 s; see {log}")
        yield api, agent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


class Traffic:
    """Concurrent completion requests from worker threads."""

    def __init__(self, api: str, model: str) -> None:
        self.api, self.model = api, model
        self.sent = self.done = self.failed = 0
        self._lock = threading.Lock()

    def burst(self, n: int, prompt_tokens: int, max_tokens: int, concurrency: int) -> None:
        from collector.tiny_model import prompt_token_ids

        def worker(ids: list[int]) -> None:
            with httpx.Client(timeout=300) as client:
                for i in ids:
                    body = {
                        "model": self.model,
                        "prompt": prompt_token_ids(prompt_tokens, 31 * i),
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "temperature": 0,
                    }
                    with self._lock:
                        self.sent += 1
                    try:
                        client.post(self.api + "/v1/completions", json=body).raise_for_status()
                        with self._lock:
                            self.done += 1
                    except httpx.HTTPError:
                        with self._lock:
                            self.failed += 1

        threads = [
            threading.Thread(target=worker, args=(list(range(k, n, concurrency)),))
            for k in range(concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _line(phase: str, state: dict[str, Any], traffic: Traffic, t0: float) -> str:
    s, k = state["stats"], state["knobs"]
    hit = "n/a" if s["kv_hit_ratio"] is None else f"{100 * s['kv_hit_ratio']:.0f}%"
    return (
        f"{time.monotonic() - t0:5.0f}s {phase:<10} done {traffic.done:4d}  hit {hit:>4}  "
        f"frag {100 * s['block_fragmentation_ratio']:4.1f}%  "
        f"KV {100 * s['kv_cache_usage_ratio']:3.0f}%  "
        f"run {s['num_requests_running']:3.0f} wait {s['num_requests_waiting']:3.0f}  "
        f"preempt {s['preemptions_total']:4.0f}  budget {k['max_num_batched_tokens']:4d}  "
        f"seqs {k['max_num_seqs']:3d}  {k['policy']}"
    )


def run(duration_scale: float = 1.0) -> int:
    from collector.tiny_model import create_tiny_model

    DEMO_DIR.mkdir(exist_ok=True)
    model = create_tiny_model(DEMO_DIR / "tiny-llama")
    log = DEMO_DIR / "vllm.log"
    print(f"demo: starting vLLM (CPU, tiny random model, 256 KV blocks of 32) — log in {log}")
    with served_engine(model, log) as (api, agent):
        client = EngineClient(agent)
        model_id = httpx.get(api + "/v1/models").json()["data"][0]["id"]
        traffic = Traffic(api, model_id)
        t0 = time.monotonic()
        phase = ["steady"]
        stop = threading.Event()
        peak = {"kv": 0.0}

        def monitor() -> None:
            while not stop.wait(1.0):
                with contextlib.suppress(Exception):
                    state = client.state()
                    peak["kv"] = max(peak["kv"], state["stats"]["kv_cache_usage_ratio"])
                    print(_line(phase[0], state, traffic, t0), flush=True)

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        traffic.burst(int(48 * duration_scale), 64, 32, concurrency=8)
        phase[0] = "long-burst"
        # 48 sequences of 300 + 300 tokens want 48 x 19 blocks; 255 exist.
        traffic.burst(int(48 * duration_scale), 300, 300, concurrency=48)
        pressure = client.state()["stats"]
        phase[0] = "control"
        print(
            "\ndemo: the runbook action on the live engine (what `runbook exec oom-pressure` does):"
        )
        changed = client.set_knobs(scale_max_num_batched_tokens=0.5, max_num_seqs=8)
        for c in changed["changes"]:
            print(
                f"  {c['knob']}: {c['before']} → {c['after']} "
                f"(from step {changed['effective_from_step']})"
            )
        before_preempt = client.state()["stats"]["preemptions_total"]
        traffic.burst(int(48 * duration_scale), 300, 300, concurrency=48)
        after_preempt = client.state()["stats"]["preemptions_total"] - before_preempt
        restored = client.restore()
        print(
            "  restored: "
            + ", ".join(f"{c['knob']} {c['before']} → {c['after']}" for c in restored["changes"])
        )
        stop.set()
        watcher.join()
        final = client.state()

    print("\nsummary")
    print(f"  requests completed        {traffic.done} (failed {traffic.failed})")
    print(f"  peak KV cache usage       {100 * peak['kv']:.0f}%")
    print(f"  preemptions, long burst   {pressure['preemptions_total']:.0f} (32 sequences allowed)")
    print(f"  preemptions, same burst   {after_preempt:.0f} (budget halved, 8 sequences allowed)")
    print(f"  knobs after restore       {final['knobs']}")
    problems = []
    if traffic.failed or traffic.done == 0:
        problems.append("requests failed")
    if pressure["preemptions_total"] == 0:
        problems.append("the long burst produced no preemption")
    if after_preempt >= pressure["preemptions_total"]:
        problems.append("capping max_num_seqs did not reduce preemptions")
    if final["knobs"] != final["startup"]:
        problems.append("restore did not bring the startup values back")
    if problems:
        print("demo: FAILED: " + "; ".join(problems))
        return 1
    print("demo: ok")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_RUNBOOK_RUNTIME_DIR", tempfile.mkdtemp(prefix="runbook-demo-"))
    sys.exit(run(args.scale))


if __name__ == "__main__":
    main()
