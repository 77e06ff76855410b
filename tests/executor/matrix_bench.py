"""The matrix tests' bench: one scenario's engine, agent, journal and executor.

The executor runs in a thread of the test's process (the shipped catalog)
while the test's thread steps the engine; each scenario starts and ends with
the engine at its startup knobs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import httpx
from vllm_runbook.runbooks.engine.client import EngineClient
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.hold import Holds, hold_on_resolve
from vllm_runbook.runbooks.store import Journal

from tests.engines import InProcessEngine

STARTUP = {
    "max_num_batched_tokens": 512,
    "max_num_seqs": 32,
    "policy": "priority",
    "autopilot": False,
    "autopilot_target": 0.9,
}
PACE_S = 0.01


def start_engine(model: Path, window_s: float) -> InProcessEngine:
    """The matrix's engine (startup: STARTUP's knobs, 256 KV blocks of 32), its collector
    window `window_s` seconds."""
    saved = os.environ.get("VLLM_RUNBOOK_WINDOW_SECONDS")
    os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = str(window_s)
    try:
        return InProcessEngine.start(
            model,
            scheduling_policy=STARTUP["policy"],
            max_num_seqs=STARTUP["max_num_seqs"],
            max_num_batched_tokens=STARTUP["max_num_batched_tokens"],
            num_gpu_blocks_override=256,
        )
    finally:
        if saved is None:
            os.environ.pop("VLLM_RUNBOOK_WINDOW_SECONDS", None)
        else:
            os.environ["VLLM_RUNBOOK_WINDOW_SECONDS"] = saved


class Bench:
    """One scenario: the engine, its agent, a fresh journal, and the executor.

    A scenario that fails before its `finish` leaves its requests in the shared
    engine: the next scenario's traffic would carry them (a closed loop tops up
    to its count, so it would serve the last scenario's capped stragglers and
    read their latency as its own baseline). The modules' autouse fixture calls
    `finish_unfinished` after every test."""

    unfinished: ClassVar[list[Bench]] = []

    def __init__(self, engine: InProcessEngine, db_url: str, tag: str) -> None:
        self.engine, self.tag = engine, tag
        self.url = str(engine.collector.server.url)
        self.client = EngineClient(self.url)
        self.store = Journal(db_url)
        self.executor = Executor(self.store, poll_seconds=0.2)
        self.starts = datetime.now(UTC)
        self.sent = 0
        self.held = 0  # the execution `resolve` put on hold
        assert self.knobs() == STARTUP, "the previous scenario left the engine changed"
        Bench.unfinished.append(self)

    def knobs(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/v1/state", timeout=10).json()["knobs"])

    def add(self, prompt: int, max_tokens: int, priority: int = 0) -> str:
        rid = f"{self.tag}-{self.sent}"
        self.engine.add(
            rid, prompt, max_tokens=max_tokens, offset=97 * self.sent, priority=priority
        )
        self.sent += 1
        return rid

    def step(self) -> None:
        if self.engine.engine.has_unfinished_requests():
            self.engine.step()
        time.sleep(PACE_S)

    def while_running(
        self, call: Callable[[], ExecutionResult | None], drive: Callable[[], None]
    ) -> Any:
        """`call` in a thread while `drive` steps the engine here."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = call()
            except BaseException as e:  # re-raised below, in the test's thread
                box["error"] = e

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive():
            drive()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def execute(
        self, runbook: str, drive: Callable[[], None] | None = None, **kw: Any
    ) -> ExecutionResult:
        """As the service runs it for a firing alert (one episode per scenario)."""
        result: ExecutionResult = self.while_running(
            lambda: self.executor.execute(
                runbook,
                self.url,
                trigger="alert",
                who="alertmanager:matrix",
                alert_fingerprint=f"fp-{self.tag}",
                alert_starts_at=self.starts,
                approved=True,
                **kw,
            ),
            drive or self.step,
        )
        return result

    def resolve(self, runbook: str, drive: Callable[[], None] | None = None) -> Any:
        """The alert resolved: the service's hold (no hold time here) and, when
        the runbook's cause conditions hold now, its revert (stepwise stages
        without waits); None while the cause holds (`judge` again later)."""
        held = hold_on_resolve(
            self.executor, runbook, self.url, f"fp-{self.tag}", self.starts, hold_seconds=0
        )
        assert held is not None and held.display_status == "holding"
        self.held = held.id
        return self.judge(drive)

    def judge(self, drive: Callable[[], None] | None = None) -> Any:
        """The worker's pass over the held execution: its revert, or None."""
        holds = Holds(self.executor, hold_seconds=0, healthy_period_seconds=0)
        return self.while_running(
            lambda: holds.judge(self.store.get_execution(self.held)), drive or self.step
        )

    def abort_all(self) -> None:
        """End this scenario's requests now (draining long ones costs minutes)."""
        self.engine.engine.abort_request([f"{self.tag}-{i}" for i in range(self.sent)])
        self.engine.run_until_done()

    def finish(self) -> None:
        """Abort what is left, put every knob back (whatever the scenario left), close
        the journal."""
        if self in Bench.unfinished:
            Bench.unfinished.remove(self)
        self.abort_all()
        if self.knobs() != STARTUP:
            self.client.restore()
            self.engine.add(f"{self.tag}-restore", 8, max_tokens=1)  # a step applies it
            self.engine.run_until_done()
        assert self.knobs() == STARTUP
        self.store.close()

    @classmethod
    def finish_unfinished(cls) -> None:
        """`finish` every scenario a failed test left (the engine idle at its startup
        knobs for the next one)."""
        while cls.unfinished:
            cls.unfinished[-1].finish()
