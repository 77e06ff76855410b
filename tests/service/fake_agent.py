"""An engine agent in memory for the service tests: knobs with the agent's bounds
(ceilings at the startup values, the budget floored by max_num_seqs) and stats
that answer the knobs the way a KV-bound engine does: preemptions go on while
max_num_seqs is at its startup value and stop once it is lowered."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from vllm_runbook.runbooks.client import CommandRefused

URL = "http://127.0.0.1:9"  # the inventory's agent (nothing listens there)
STARTUP = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "policy": "fcfs"}
PRESSURE = {
    "kv_blocks_used": 255,
    "kv_blocks_free": 0,
    "num_requests_running": 24,
    "num_requests_waiting": 40,
    "kv_cache_usage_ratio": 1.0,
}


class Clock:
    """Fake monotonic time: sleeping advances it (no test waits for real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeAgent:
    def __init__(self) -> None:
        self.url = URL
        self.knobs = dict(STARTUP)
        self.step = 100
        self.writes: list[dict[str, Any]] = []

    def state(self, since_step: int | None = None) -> dict[str, Any]:
        preempting = self.knobs["max_num_seqs"] == STARTUP["max_num_seqs"]
        rate = 60.0 if preempting else 0.0
        since = None
        if since_step is not None:  # what was measured from the change's step on
            since = {"from_step": since_step, "from_time": 0.0, "preemptions_per_minute": rate}
        return {
            "knobs": dict(self.knobs),
            "startup": dict(STARTUP),
            "stats": {**PRESSURE, "preemptions_per_minute": rate},
            "engine": {"started_at": 0.0},
            "since": since,
        }

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> Any:
        before = dict(self.knobs)
        target = dict(before)
        if "scale_max_num_batched_tokens" in values:
            factor = values.pop("scale_max_num_batched_tokens")
            values["max_num_batched_tokens"] = int(before["max_num_batched_tokens"] * factor)
        target.update(values)
        for knob, low in (("max_num_seqs", 1), ("max_num_batched_tokens", target["max_num_seqs"])):
            if not low <= target[knob] <= STARTUP[knob]:
                if not clamp:
                    raise CommandRefused(f"{knob}={target[knob]} is out of bounds")
                target[knob] = min(max(target[knob], low), STARTUP[knob])
        self.step += 1
        if not dry_run:
            self.knobs = target
            self.writes.append(values)
        return {
            "before": before,
            "after": before if dry_run else target,
            "would_be": target,
            "effective_from_step": self.step,
            "clamped": [],
            "dry_run": dry_run,
        }

    def restore(self, dry_run: bool = False) -> Any:
        return self.set_knobs(dry_run=dry_run, **STARTUP)


class AgentHTTP:
    """A FakeAgent behind the agent's HTTP API on loopback (GET /v1/state,
    POST /v1/knobs, POST /v1/restore), for `runbook serve` in a subprocess.
    The state carries what the engine client checks of an agent's answer."""

    def __init__(self, agent: FakeAgent | None = None) -> None:
        self.agent = agent or FakeAgent()
        fake = self.agent
        lock = threading.Lock()

        def state(since_step: int | None) -> dict[str, Any]:
            answer = fake.state(since_step)
            answer["engine"] = {
                "model_name": "m",
                "engine": "0",
                "step": fake.step,
                "vllm_version": "fake",
                "started_at": 0.0,
            }
            answer["collector_up"] = True
            answer["bounds"] = {
                "max_num_batched_tokens": {
                    "min": fake.knobs["max_num_seqs"],
                    "max": STARTUP["max_num_batched_tokens"],
                },
                "max_num_seqs": {"min": 1, "max": STARTUP["max_num_seqs"]},
            }
            return answer

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path != "/v1/state":
                    return self._answer(404, {"error": "not found"})
                since = parse_qs(parts.query).get("since_step")
                with lock:
                    self._answer(200, state(int(since[0]) if since else None))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                try:
                    with lock:
                        if self.path == "/v1/restore":
                            result = fake.restore(dry_run=bool(body.get("dry_run")))
                        elif self.path == "/v1/knobs":
                            result = fake.set_knobs(**body)
                        else:
                            return self._answer(404, {"error": "not found"})
                except CommandRefused as exc:
                    return self._answer(400, {"error": str(exc)})
                before, after = result["before"], result["after"]
                result["changes"] = [
                    {"knob": k, "before": before[k], "after": after[k]}
                    for k in after
                    if before.get(k) != after[k]
                ]
                self._answer(200, result)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
