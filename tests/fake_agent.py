"""An engine agent in memory, for the tests that need its answers but no engine.

It speaks the agent's own models (vllm_runbook.collector.agent_api), so a test
cannot rely on an answer the real agent would not give: `state()` is a whole
AgentState, `set_knobs()` validates its command like the client does and
answers a ChangeResult. Knobs keep the agent's bounds (ceilings at the startup
values, the budget floored by max_num_seqs); the statistics are scripted
(`stats`: one set per `state()` call, the last one repeating) or follow the
knobs (`FakeAgent.kv_bound()`: preemptions go on while max_num_seqs is at its
startup value and stop once it is lowered, as on a KV-bound engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from vllm_runbook.collector.agent_api import (
    AgentState,
    AutopilotChanges,
    AutopilotState,
    Bound,
    Bounds,
    ChangeResult,
    Clamped,
    EngineInfo,
    Episode,
    Gpus,
    KnobChange,
    Knobs,
    KnobsCommand,
    ParallelConfig,
    ScheduleHistogram,
    SettledSince,
    Stats,
    Tiers,
    TierSettings,
    command_error,
)
from vllm_runbook.collector.metrics import SCHEDULE_SECONDS
from vllm_runbook.runbooks.engine.client import Agent, CommandRefused, EngineUnreachable

URL = "http://127.0.0.1:9"  # the inventory's agent (nothing listens there)
STARTUP: dict[str, Any] = {
    "max_num_batched_tokens": 512,
    "max_num_seqs": 32,
    "policy": "priority",
    "autopilot": False,
    "autopilot_target": 0.9,
}
# A KV cache full of 24 running requests, 40 waiting, one preemption a second.
PRESSURE: dict[str, Any] = {
    "kv_blocks_used": 255,
    "kv_blocks_free": 0,
    "requests_running": 24,
    "requests_waiting": 40,
    "preemptions_per_minute": 60.0,
    "kv_cache_usage": 1.0,
    "oldest_waiting": 30.0,
}
# What the scripted stats stand for after a change (`since` of /v1/state?since_step=N).
SINCE_KEYS = ("preemptions_per_minute", "engine_e2e_latency_p99", "error_rate", "kv_hit_ratio")


def stats(**values: Any) -> Stats:
    """A whole Stats: an idle engine's values, with `values` over them."""
    idle: dict[str, Any] = dict.fromkeys(Stats.model_fields, 0)
    idle.update(
        kv_hit_ratio=None,
        error_rate=None,
        engine_e2e_latency_p99=None,
        engine_queue_time_p99=None,
        finished_by_reason={},
        requests_finished_by_reason_total={},
        block_fragmentation_at_block_size={},
        prompt_length_spread_ratio=None,
        long_prompt_ratio=None,
        stall_reason=None,
        collector_up=1.0,
        window_seconds=60.0,
        max_num_batched_tokens=STARTUP["max_num_batched_tokens"],
        max_num_seqs=STARTUP["max_num_seqs"],
        startup_max_num_batched_tokens=STARTUP["max_num_batched_tokens"],
        startup_max_num_seqs=STARTUP["max_num_seqs"],
        autopilot_kv_target_ratio=STARTUP["autopilot_target"],
    )
    return Stats(**{**idle, **values})


def agent_state(
    knobs: Mapping[str, Any] = STARTUP,
    stats_values: Mapping[str, Any] | None = None,
    since: SettledSince | None = None,
    step: int = 100,
    model_name: str = "tiny-llama",
) -> AgentState:
    """A whole /v1/state answer of an engine at `step` with these knobs and stats."""
    return AgentState(
        engine=EngineInfo(
            model_name=model_name,
            engine="0",
            pid=1,
            started_at=0.0,
            step=step,
            vllm_version="0.32.0",
            scheduler_class="RunbookScheduler",
            parallel=ParallelConfig(
                tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
            ),
        ),
        collector_up=True,
        knobs=Knobs(**knobs),
        startup=Knobs(**STARTUP),
        bounds=_bounds(knobs["max_num_seqs"]),
        autopilot=AutopilotState(
            enabled=knobs["autopilot"],
            target=knobs["autopilot_target"],
            high=min(1.0, knobs["autopilot_target"] + 0.05),
            limit=knobs["max_num_seqs"] if knobs["autopilot"] else None,
            epoch_steps=64,
            epoch_peak_kv_usage=0.0,
            changes=AutopilotChanges(up=0, down=0),
            last_change=None,
            error=None,
            ceiling=min(STARTUP["max_num_seqs"], knobs["max_num_batched_tokens"]),
        ),
        stats=stats(**(stats_values or {})),
        gpus=Gpus(nvml_up=False, per_gpu={}),
        schedule_histogram=ScheduleHistogram(
            bounds=list(SCHEDULE_SECONDS.buckets),
            cumulative=[0] * (len(SCHEDULE_SECONDS.buckets) + 1),
        ),
        since=since,
        tiers=Tiers(
            config=TierSettings(
                boundaries=[256, 1024],
                limits={"hot": 9, "warm": 18, "cold": 5},
                shares={"hot": 0.4, "warm": 0.45, "cold": 0.15},
                aging_seconds=30.0,
            ),
            now=None,
        ),
        queues=None,
    )


def _bounds(max_num_seqs: int) -> Bounds:
    above = "raising above the startup value is unsafe"
    return Bounds(
        max_num_batched_tokens=Bound(
            min=max_num_seqs,
            max=STARTUP["max_num_batched_tokens"],
            min_reason="every admitted sequence must be able to decode in one step",
            max_reason=above,
        ),
        max_num_seqs=Bound(
            min=1, max=STARTUP["max_num_seqs"], min_reason="at least 1 sequence", max_reason=above
        ),
    )


def kv_bound(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """Preemptions go on while max_num_seqs is at its startup value, stop once lowered."""
    preempting = knobs["max_num_seqs"] == STARTUP["max_num_seqs"]
    return {**PRESSURE, "preemptions_per_minute": 60.0 if preempting else 0.0}


class Clock:
    """Fake monotonic time: sleeping advances it (no test waits for real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


StatsScript = Sequence[Mapping[str, Any]] | Callable[[Mapping[str, Any]], Mapping[str, Any]]


class FakeAgent:
    """An `Agent` (runbooks/engine/client.py): the agent's three calls (EngineClient's
    `state`, `set_knobs`, `restore`), its `url` and `timeout`."""

    def __init__(self, stats: StatsScript | None = None, url: str = URL) -> None:
        self.url = url
        self.timeout = 5.0
        self.knobs: dict[str, Any] = dict(STARTUP)
        self.step = 100
        self.script: StatsScript = [PRESSURE] if stats is None else stats
        self.down = False
        self.writes: list[dict[str, Any]] = []
        self.since_steps: list[int | None] = []
        # The answer's `episode` (None: an agent older than it), and the spans asked.
        self.episode: Episode | None = None
        self.episode_asks: list[float | None] = []

    @classmethod
    def kv_bound(cls) -> FakeAgent:
        return cls(kv_bound)

    @property
    def stats(self) -> list[dict[str, Any]]:
        """The scripted stats still to come (settable)."""
        assert not callable(self.script)
        return [dict(s) for s in self.script]

    @stats.setter
    def stats(self, script: Sequence[Mapping[str, Any]]) -> None:
        self.script = list(script)

    def _next_stats(self) -> dict[str, Any]:
        if callable(self.script):
            return dict(self.script(self.knobs))
        script = list(self.script)
        values = script.pop(0) if len(script) > 1 else script[0]
        self.script = script
        return dict(values)

    def _check_up(self) -> None:
        if self.down:
            raise EngineUnreachable(f"engine {self.url} unreachable: connection refused")

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        self._check_up()
        self.episode_asks.append(episode_seconds)
        values = self._next_stats()
        # `since_<field>` values script the SettledSince's counters (the breaker's tests).
        since_values = {k[6:]: values.pop(k) for k in list(values) if k.startswith("since_")}
        self.since_steps.append(since_step)
        since = None
        if since_step is not None:  # the scripted stats stand for what followed the change
            since = SettledSince(
                from_step=since_step,
                settled=True,
                effective_step=since_step,
                from_time=0.0,
                seconds=0.0,
                steps=0,
                preemptions=0,
                preemptions_per_minute=values.get("preemptions_per_minute"),
                scheduled_tokens=0,
                scheduled_tokens_per_second=None,
                kv_hit_ratio=values.get("kv_hit_ratio"),
                requests_finished=0,
                finished_by_reason={},
                error_rate=values.get("error_rate"),
                engine_e2e_latency_p99=values.get("engine_e2e_latency_p99"),
                engine_queue_time_p99=None,
            ).model_copy(update=since_values)
        state = agent_state(self.knobs, values, since, self.step)
        return state.model_copy(update={"episode": self.episode})

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> ChangeResult:
        self._check_up()
        try:
            command = KnobsCommand.model_validate(
                {**{k: v for k, v in values.items() if v is not None}, "clamp": clamp}
            )
        except ValidationError as exc:
            raise CommandRefused(command_error(exc)) from None
        return self._apply(command.values(), clamp, dry_run)

    def restore(self, dry_run: bool = False) -> ChangeResult:
        self._check_up()
        return self._apply(dict(STARTUP), False, dry_run)

    def _apply(self, values: dict[str, Any], clamp: bool, dry_run: bool) -> ChangeResult:
        before = dict(self.knobs)
        target = dict(before)
        if "scale_max_num_batched_tokens" in values:
            factor = values.pop("scale_max_num_batched_tokens")
            values["max_num_batched_tokens"] = int(before["max_num_batched_tokens"] * factor)
        target.update(values)
        clamped = []
        for knob, low in (("max_num_seqs", 1), ("max_num_batched_tokens", target["max_num_seqs"])):
            if not low <= target[knob] <= STARTUP[knob]:
                if not clamp:
                    raise CommandRefused(f"{knob}={target[knob]} is out of bounds")
                applied = min(max(target[knob], low), STARTUP[knob])
                clamped.append(Clamped(knob=knob, requested=target[knob], applied=applied))
                target[knob] = applied
        if not dry_run:  # a dry run takes no step, like the agent's
            self.step += 1
            self.knobs = target
            self.writes.append(values)
        return ChangeResult(
            dry_run=dry_run,
            changes=[
                KnobChange(knob=k, before=before[k], after=target[k])
                for k in STARTUP
                if before[k] != target[k]
            ],
            clamped=clamped,
            before=Knobs(**before),
            after=Knobs(**(before if dry_run else target)),
            would_be=Knobs(**target) if dry_run else None,
            effective_from_step=self.step,
        )


def as_agent(agent: FakeAgent) -> Agent:
    """The fake where the runbooks take an agent. Here mypy checks that a FakeAgent
    is an Agent (tests/unit/test_agent_protocol.py runs it on this file): a fake
    that drifts from the Protocol fails that test."""
    return agent


class AgentHTTP:
    """A FakeAgent behind the agent's HTTP API on loopback (GET /v1/state,
    POST /v1/knobs, POST /v1/restore), for `runbook serve` in a subprocess.
    Answers are the agent's models, serialized as the real agent does."""

    def __init__(self, agent: FakeAgent | None = None) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        self.agent = agent or FakeAgent()
        fake = self.agent
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                self._answer(status, json.dumps({"error": message}).encode())

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path != "/v1/state":
                    return self._error(404, "not found")
                since = parse_qs(parts.query).get("since_step")
                with lock:
                    state = fake.state(int(since[0]) if since else None)
                self._answer(200, state.model_dump_json().encode())

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
                            return self._error(404, "not found")
                except CommandRefused as exc:
                    return self._error(400, str(exc))
                self._answer(200, result.model_dump_json().encode())

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
