"""The warm-up at engine start (collector/warmup.py) on a fake engine core.

The fake steps like vLLM's engine core on requests that fit the budget: the
first step prefills every prompt and samples one token each, every later step
decodes one token per request, a request leaves the scheduler when it has its
output tokens, and one more step (scheduling nothing) reports the finished
ones. So 3 requests of 10 prompt + 4 output tokens take exactly 5 steps and
3 x 10 + 3 x 3 = 39 scheduled tokens (the real engine's numbers are in
tests/engine/test_warmup_engine.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.exporter import StatsExporter
from vllm_runbook.collector.settings import CollectorSettings
from vllm_runbook.collector.warmup import (
    NO_HOOK,
    REQUEST_ID_PREFIX,
    Outcome,
    WarmupProgress,
    WarmupSettings,
    install_start_hook,
    run_warmup,
    warm_up,
    warmup_prompt,
)

LABELS = ("m", "0")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRequest:
    prompt: list[int]
    output_tokens: int
    generated: int = 0


@dataclass
class FakeScheduler:
    requests: dict[str, FakeRequest] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)  # reported at the next step
    connector: Any = None
    prefix_cache_resets: int = 0
    runbook_collector: Any = None

    def has_requests(self) -> bool:
        return bool(self.requests or self.finished)

    def get_kv_connector(self) -> Any:
        return self.connector

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True


class FakeEngine:
    """Steps like vLLM's EngineCore (see the module docstring)."""

    def __init__(
        self,
        max_num_seqs: int = 3,
        max_model_len: int = 1024,
        clock: Clock | None = None,
        fail_at_step: int | None = None,
        runner_type: str = "generate",
    ) -> None:
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            model_config=SimpleNamespace(
                max_model_len=max_model_len, runner_type=runner_type, is_encoder_decoder=False
            ),
        )
        self.scheduler = FakeScheduler()
        self.counters = SimpleNamespace(steps=0, scheduled_tokens=0)
        self.batch_queue = None
        self.clock = clock
        self.fail_at_step = fail_at_step
        self.seen: list[tuple[int, int]] = []  # (done, steps) of the progress at each step
        self.progress: WarmupProgress | None = None
        self.post_steps: list[bool] = []
        self.aborted: list[str] = []

    def preprocess_add_request(self, request: Any) -> tuple[Any, int]:
        return request, 0

    def add_request(self, request: Any, wave: int = 0) -> None:
        rid, prompt, output_tokens = request
        self.scheduler.requests[rid] = FakeRequest(prompt, output_tokens)

    def step_fn(self) -> tuple[dict[int, Any], bool]:
        if self.progress is not None:
            self.seen.append((self.progress.done, self.progress.steps))
        if self.fail_at_step == self.counters.steps + 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        self.counters.steps += 1
        self.scheduler.finished.clear()
        scheduled = bool(self.scheduler.requests)
        for rid, r in list(self.scheduler.requests.items()):
            self.counters.scheduled_tokens += 1 if r.generated else len(r.prompt)
            r.generated += 1
            if r.generated == r.output_tokens:
                del self.scheduler.requests[rid]
                self.scheduler.finished.append(rid)
        if self.clock is not None:
            self.clock.now += 1.0
        return {}, scheduled

    def post_step(self, executed: bool) -> None:
        self.post_steps.append(executed)

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids
        for rid in ids:
            del self.scheduler.requests[rid]
            self.scheduler.finished.append(rid)


def plain_request(rid: str, prompt: list[int], output_tokens: int) -> tuple[str, list[int], int]:
    return rid, prompt, output_tokens


def warm(
    engine: FakeEngine, settings: WarmupSettings, clock: Clock | None = None
) -> WarmupProgress:
    progress = engine.progress = WarmupProgress(Outcome.PENDING, clock=clock or Clock())
    kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
    run_warmup(engine, settings, progress, engine.counters, plain_request, **kwargs)
    return progress


def exported(progress: WarmupProgress) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(StatsExporter(progress.samples, LABELS))
    labels = {"model_name": "m", "engine": "0"}
    return {
        spec.name.removeprefix(M.PREFIX): registry.get_sample_value(spec.name, labels)
        for spec in (
            M.WARMUP_REQUESTS_PLANNED,
            M.WARMUP_REQUESTS_DONE,
            M.WARMUP_STEPS,
            M.WARMUP_TOKENS,
            M.WARMUP_SECONDS,
            M.WARMUP_DONE,
        )
    }


ON = WarmupSettings(enabled=True, prompt_tokens=10, output_tokens=4)


# -- settings --------------------------------------------------------------------


def test_off_by_default_and_read_from_the_environment() -> None:
    assert WarmupSettings.from_env({}) == WarmupSettings()
    assert WarmupSettings() == WarmupSettings(False, None, 256, 16, 60.0)
    assert CollectorSettings.from_env({}).warmup.enabled is False
    env = {
        "VLLM_RUNBOOK_WARMUP": "on",
        "VLLM_RUNBOOK_WARMUP_REQUESTS": "8",
        "VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS": "64",
        "VLLM_RUNBOOK_WARMUP_OUTPUT_TOKENS": "4",
        "VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS": "30",
    }
    assert CollectorSettings.from_env(env).warmup == WarmupSettings(True, 8, 64, 4, 30.0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VLLM_RUNBOOK_WARMUP": "maybe"}, "VLLM_RUNBOOK_WARMUP must be on or off, got 'maybe'"),
        (
            {"VLLM_RUNBOOK_WARMUP": "on", "VLLM_RUNBOOK_WARMUP_REQUESTS": "0"},
            "VLLM_RUNBOOK_WARMUP_REQUESTS must be at least 1, got 0",
        ),
        (
            {"VLLM_RUNBOOK_WARMUP": "on", "VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS": "many"},
            "VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS must be a number, got 'many'",
        ),
        (
            {"VLLM_RUNBOOK_WARMUP": "on", "VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS": "nan"},
            "VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS must be above 0, got nan",
        ),
    ],
)
def test_a_bad_value_leaves_the_warm_up_off_in_one_line(
    env: dict[str, str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(") + "$"):
        WarmupSettings.from_env(env)
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.collector"):
        assert CollectorSettings.from_env(env).warmup == WarmupSettings()
    assert [r.getMessage() for r in caplog.records] == [
        f"vllm-runbook: warm-up at start left off: {message}"
    ]


# -- the run ---------------------------------------------------------------------


def test_runs_every_request_to_its_end_with_exact_progress() -> None:
    engine = FakeEngine(max_num_seqs=3)
    progress = warm(engine, ON)
    assert progress.outcome == Outcome.DONE and progress.complete
    assert exported(progress) == {
        "warmup_requests_planned": 3.0,  # the engine's max_num_seqs
        "warmup_requests_done": 3.0,
        "warmup_steps": 5.0,  # prefill, three decodes, the step that reports them finished
        "warmup_tokens": 39.0,  # 3 x 10 prompt + 3 x 3 decode
        "warmup_seconds": 0.0,  # the fake clock did not move
        "warmup_done": 1.0,
    }
    # Watched step by step: (requests done, steps) before each step.
    assert engine.seen == [(0, 0), (0, 1), (0, 2), (0, 3), (3, 4)]
    assert engine.post_steps == [True, True, True, True, False]
    assert not engine.scheduler.has_requests() and engine.aborted == []
    assert engine.scheduler.prefix_cache_resets == 1  # starts as it would without


def test_prompts_are_distinct_and_fit_max_model_len() -> None:
    engine = FakeEngine(max_num_seqs=2, max_model_len=12)
    added: list[tuple[str, list[int], int]] = []

    def record(rid: str, prompt: list[int], output_tokens: int) -> tuple[str, list[int], int]:
        added.append((rid, prompt, output_tokens))
        return rid, prompt, output_tokens

    progress = WarmupProgress(Outcome.PENDING)
    run_warmup(engine, WarmupSettings(True, requests=5), progress, engine.counters, record)
    # 5 requested (not max_num_seqs); prompts of 12 - 16 -> at least 1 token.
    assert [(rid, len(p), out) for rid, p, out in added] == [
        (f"{REQUEST_ID_PREFIX}{i}", 1, 16) for i in range(5)
    ]
    assert [p for _, p, _ in added] == [warmup_prompt(i, 1) for i in range(5)]
    assert (progress.planned, progress.done, progress.steps, progress.tokens) == (5, 5, 17, 80)
    longer = [warmup_prompt(i, 64) for i in range(1000)]
    assert len({tuple(p[:2]) for p in longer}) == 1000


def test_cut_short_by_its_timeout_the_engine_starts_empty(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    engine = FakeEngine(max_num_seqs=3, clock=clock)
    settings = WarmupSettings(True, prompt_tokens=10, output_tokens=100, timeout_seconds=2.5)
    with caplog.at_level(logging.INFO, logger="vllm_runbook.collector"):
        progress = warm(engine, settings, clock)
    assert progress.outcome == Outcome.CUT_SHORT and progress.why == "2.5 s passed"
    assert exported(progress) == {
        "warmup_requests_planned": 3.0,
        "warmup_requests_done": 0.0,
        # At 0, 1 and 2 s; at 3 s the deadline had passed: the requests were
        # aborted, and one more step reported them.
        "warmup_steps": 4.0,
        "warmup_tokens": 36.0,  # 3 x 10 + 2 x 3
        "warmup_seconds": 4.0,
        "warmup_done": 0.0,
    }
    assert engine.aborted == [f"{REQUEST_ID_PREFIX}{i}" for i in range(3)]
    assert not engine.scheduler.has_requests()  # the abort reported: the engine starts empty
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "vllm-runbook: warm-up cut short after 2.5 s: 0 of 3 requests done; "
        "the engine starts without the rest"
    ]


def test_an_error_in_a_step_ends_the_warm_up_not_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine(max_num_seqs=2, fail_at_step=2)
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.collector"):
        progress = warm(engine, ON)  # does not raise
    assert progress.outcome == Outcome.FAILED
    assert progress.why == "RuntimeError: CUDA error: an illegal memory access"
    assert (progress.planned, progress.done, progress.steps, progress.tokens) == (2, 0, 1, 20)
    assert exported(progress)["warmup_done"] == 0.0
    # Aborted: no request runs on (the engine's next step reports them finished).
    assert engine.scheduler.requests == {}
    [record] = caplog.records
    assert record.getMessage() == (
        "vllm-runbook: warm-up failed after 0 of 2 requests; the engine starts without it"
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda e: setattr(e.vllm_config.model_config, "runner_type", "pooling"), "a pooling"),
        (lambda e: setattr(e.scheduler, "connector", object()), "a KV connector"),
        (lambda e: setattr(e, "__class__", type("DPEngineCoreProc", (FakeEngine,), {})), "data-"),
        (lambda e: delattr(e, "vllm_config"), "the engine is not one the warm-up knows"),
    ],
)
def test_skipped_in_one_line_where_stepping_the_engine_alone_is_wrong(
    change: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine()
    change(engine)
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.collector"):
        progress = warm(engine, ON)
    assert progress.outcome == Outcome.SKIPPED and progress.why is not None
    assert progress.why.startswith(why)
    assert exported(progress) == dict.fromkeys(exported(WarmupProgress()), 0.0)
    assert engine.counters.steps == 0 and engine.scheduler.requests == {}
    [record] = caplog.records
    assert record.getMessage().startswith("vllm-runbook: warm-up at start skipped: " + why)


def test_at_start_off_is_zeros_and_without_the_hook_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    off = WarmupProgress.at_start(WarmupSettings(), hooked=True)
    assert off.outcome == Outcome.OFF
    assert set(exported(off).values()) == {0.0}
    assert WarmupProgress.at_start(ON, hooked=True).outcome == Outcome.PENDING
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.collector"):
        unhooked = WarmupProgress.at_start(ON, hooked=False)
    assert (unhooked.outcome, unhooked.why) == (Outcome.SKIPPED, NO_HOOK)
    assert [r.getMessage() for r in caplog.records] == [
        f"vllm-runbook: warm-up at start skipped: {NO_HOOK}"
    ]


def test_seconds_count_while_it_runs() -> None:
    clock = Clock()
    progress = WarmupProgress(Outcome.PENDING, clock=clock)
    progress.start(4)
    clock.now = 1.5
    assert exported(progress)["warmup_seconds"] == 1.5
    progress.end(Outcome.DONE)
    clock.now = 10.0
    assert exported(progress)["warmup_seconds"] == 1.5


# -- the start-up hook -------------------------------------------------------------


def collector_for(engine: FakeEngine, outcome: Outcome = Outcome.PENDING) -> Any:
    collector = SimpleNamespace(
        enabled=True,
        settings=SimpleNamespace(warmup=ON),
        warmup=WarmupProgress(outcome),
        stats=engine.counters,
    )
    engine.scheduler.runbook_collector = collector
    return collector


def test_the_hook_warms_up_once_at_the_end_of_init_or_at_the_first_socket_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm_runbook.collector.warmup as warmup

    monkeypatch.setattr(warmup, "_installed", False)
    monkeypatch.setattr(warmup, "vllm_request", plain_request)

    class Core(FakeEngine):
        def __init__(self, outcome: Outcome) -> None:
            super().__init__(max_num_seqs=2)
            self.collector = collector_for(self, outcome)

    class CoreProc(Core):
        def process_input_sockets(self) -> str:
            return "sockets"

    assert not warmup.start_hook_installed()
    install_start_hook(Core, CoreProc)
    install_start_hook(Core, CoreProc)  # idempotent: wrapped once
    assert warmup.start_hook_installed()
    core = Core(Outcome.PENDING)  # in-process or forked: at the end of __init__
    assert (core.collector.warmup.outcome, core.collector.warmup.done) == (Outcome.DONE, 2)
    steps = core.counters.steps
    warm_up(core)  # once only
    assert core.counters.steps == steps

    # A spawned process: its __init__ ran unwrapped (the plugin loaded inside it),
    # so the warm-up is still pending when EngineCoreProc.__init__ looks up its
    # input thread's target, in the main thread, before READY.
    proc = CoreProc(Outcome.OFF)
    proc.collector.warmup = WarmupProgress(Outcome.PENDING)
    assert proc.process_input_sockets() == "sockets"
    assert (proc.collector.warmup.outcome, proc.collector.warmup.done) == (Outcome.DONE, 2)
    assert proc.process_input_sockets() == "sockets"  # once only
    assert proc.counters.steps == 5


def test_the_hook_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="vllm_runbook.collector"):
        warm_up(SimpleNamespace())  # no scheduler: nothing to warm up, said once
        warm_up(SimpleNamespace(scheduler=SimpleNamespace()))  # not hooked: silent
    assert [r.getMessage() for r in caplog.records] == [
        "vllm-runbook: warm-up not run; the engine starts without it"
    ]


def test_runbook_status_says_how_far_the_warm_up_got() -> None:
    from vllm_runbook.collector.agent_api import Stats
    from vllm_runbook.runbooks.operate.cli.engines import format_warmup

    done = Stats.model_construct(
        warmup_requests_planned=8,
        warmup_requests_done=8,
        warmup_steps=5,
        warmup_tokens=536,
        warmup_seconds=1.234,
        warmup_done=1.0,
    )
    assert format_warmup(done) == (
        "  warm-up at start: done: 8/8 requests, 5 steps, 536 tokens in 1.23 s"
    )
    cut = done.model_copy(update={"warmup_requests_done": 3, "warmup_done": 0.0})
    assert format_warmup(cut) == (
        "  warm-up at start: not finished (the engine started cold): 3/8 requests, "
        "5 steps, 536 tokens in 1.23 s"
    )
    assert format_warmup(Stats.model_construct(warmup_requests_planned=0)) == (
        "  warm-up at start: none (VLLM_RUNBOOK_WARMUP off, or skipped: see the engine log)"
    )


def test_a_warm_up_still_pending_at_the_first_step_is_said_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A vLLM whose engine core the hook does not recognise builds the engine
    without running it: the collector notices at the first step, once."""
    from vllm_runbook.collector.engine_collector import EngineCollector
    from vllm_runbook.collector.warmup import NOT_RUN

    def ignore(*args: Any) -> None:
        return None

    def step(*args: Any) -> None:
        parts.stats.steps += 1

    parts = SimpleNamespace(
        stats=SimpleNamespace(on_schedule=step, steps=0, scheduled_at=0.0),
        requests=SimpleNamespace(on_schedule=ignore, never_scheduled=()),
        changes=SimpleNamespace(settling=None),
        warmup=WarmupProgress(Outcome.PENDING),
        _stepped=False,
        next_sample_at=0.0,
        sample=ignore,
    )
    output = SimpleNamespace(scheduled_new_reqs=[])
    with caplog.at_level(logging.WARNING, logger="vllm_runbook.collector"):
        for _ in range(3):
            EngineCollector.on_schedule(parts, None, output, 0.0, 0, 0.0)  # type: ignore[arg-type]
    assert (parts.warmup.outcome, parts.warmup.why) == (Outcome.SKIPPED, NOT_RUN)
    assert [r.getMessage() for r in caplog.records] == [
        f"vllm-runbook: warm-up at start skipped: {NOT_RUN}"
    ]
