"""The warm-up at engine start: requests through the engine before it takes
traffic, and their progress as metrics.

The field reports (seeds/001, case 4 预热不足): nothing warmed, an engine's
first ten minutes run at 60 % of its steady throughput; the fix is warm-up
requests injected at start (`llm.generate(["warmup"] * batch_size)`) and a
watch on their progress. With VLLM_RUNBOOK_WARMUP=on:

- when: once vLLM built the engine core (model loaded, KV cache allocated,
  the hooked scheduler and its agent up) and before the core tells the
  frontend it is ready (`install_start_hook`, called by the plugin). vLLM's
  API server listens, and its /health answers, only after that handshake, so
  a readiness probe or a router sends nothing to an engine still warming (as
  with vLLM's own compilation and graph capture);
- what: `requests` prompts (default: the engine's max_num_seqs, the reports'
  batch_size) of `prompt_tokens` token ids that differ from their first
  token (no cached block is shared, the prefill really runs), each
  generating `output_tokens` tokens with ignore_eos, all added at once: the
  full batch through prefill and decode. The engine is stepped until every
  one finished; their outputs are dropped (the frontend never hears of them);
- bounded: after `timeout_seconds` the requests left are aborted and the engine
  starts as it is, so readiness comes at most that much later; the prefix
  cache is emptied after it (the engine starts as it would without);
- fail open: an error ends the warm-up (one log line) and the engine starts;
- progress: the `vllm_runbook_warmup_*` gauges on the agent's /metrics,
  updated every step (the agent listens before the warm-up begins).

Skipped, with one log line, where stepping the engine alone would be wrong:
pooling and encoder-decoder models, data-parallel ranks that step together
(a MoE model's DPEngineCoreProc), a KV connector (disaggregated serving: its
peers are not up), and an engine core built without the hook (`--scheduler-cls`
with plugins off, or a vLLM whose engine core the hook does not recognise:
noticed at the first step): the `warmup` runbook covers those engines.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Protocol

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.autopilot import parse_switch
from vllm_runbook.collector.exporter import Sample

logger = logging.getLogger("vllm_runbook.collector")

REQUEST_ID_PREFIX: Final = "vllm-runbook-warmup-"
# Steps allowed for in-flight batches to land after the requests left were aborted.
DRAIN_STEPS: Final = 16

# Token ids every vocabulary has (the tiny test model has 512; 0-2 are special there).
_FIRST_ID, _ID_SPAN = 3, 500
PROMPTS: Final = _ID_SPAN * _ID_SPAN  # distinct prompt heads


def warmup_prompt(index: int, length: int) -> list[int]:
    """Prompt `index`: `length` token ids whose first two spell `index` (below
    250,000), so no two prompts share a cached block."""
    head = [index % _ID_SPAN, (index // _ID_SPAN) % _ID_SPAN]
    ids = head + [(index * 7919 + j * 104_729 + j * j) % _ID_SPAN for j in range(2, length)]
    return [_FIRST_ID + t for t in ids[:length]]


# -- configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class WarmupSettings:
    """VLLM_RUNBOOK_WARMUP and its _REQUESTS, _PROMPT_TOKENS, _OUTPUT_TOKENS,
    _TIMEOUT_SECONDS. Off by default: an observability plugin does not change
    what an engine does, nor when it is ready, unless asked to."""

    enabled: bool = False
    requests: int | None = None  # None: the engine's max_num_seqs
    prompt_tokens: int = 256  # shortened to fit max_model_len
    output_tokens: int = 16
    timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.requests is not None and self.requests < 1:
            raise ValueError(
                f"VLLM_RUNBOOK_WARMUP_REQUESTS must be at least 1, got {self.requests}"
            )
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(
                    f"VLLM_RUNBOOK_WARMUP_{name.upper()} must be at least 1, got {value}"
                )
        if not self.timeout_seconds > 0:  # also rejects NaN
            raise ValueError(
                f"VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS must be above 0, got {self.timeout_seconds}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WarmupSettings:
        """ValueError for a value that is not understood."""
        switch = env.get("VLLM_RUNBOOK_WARMUP", "off")
        try:
            enabled = parse_switch(switch)
        except ValueError:
            raise ValueError(f"VLLM_RUNBOOK_WARMUP must be on or off, got {switch!r}") from None
        requests = env.get("VLLM_RUNBOOK_WARMUP_REQUESTS", "").strip()
        return cls(
            enabled=enabled,
            requests=_number(int, "REQUESTS", requests) if requests else None,
            prompt_tokens=_number(
                int, "PROMPT_TOKENS", env.get("VLLM_RUNBOOK_WARMUP_PROMPT_TOKENS")
            ),
            output_tokens=_number(
                int, "OUTPUT_TOKENS", env.get("VLLM_RUNBOOK_WARMUP_OUTPUT_TOKENS")
            ),
            timeout_seconds=_number(
                float, "TIMEOUT_SECONDS", env.get("VLLM_RUNBOOK_WARMUP_TIMEOUT_SECONDS")
            ),
        )


def _number(kind: Callable[[str], Any], name: str, text: str | None) -> Any:
    if text is None or not text.strip():
        return getattr(WarmupSettings, name.lower())
    try:
        return kind(text.strip())
    except ValueError:
        raise ValueError(f"VLLM_RUNBOOK_WARMUP_{name} must be a number, got {text!r}") from None


# -- progress ------------------------------------------------------------------------


class Outcome(StrEnum):
    OFF = "off"
    PENDING = "pending"  # on, waiting for the start-up hook
    RUNNING = "running"
    DONE = "done"
    CUT_SHORT = "cut short"  # the timeout passed: the requests left were aborted
    FAILED = "failed"
    SKIPPED = "skipped"


NO_HOOK: Final = "the plugin's start-up hook is not installed (--scheduler-cls with plugins off?)"
NOT_RUN: Final = "the start-up hook did not run before the engine's first step"


class WarmupProgress:
    """The warm-up's plain numbers: the engine thread writes them, the scrape
    reads them (`samples`). Zeros while off or skipped."""

    def __init__(
        self, outcome: Outcome = Outcome.OFF, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.outcome = outcome
        self.why: str | None = None  # why skipped, failed or cut short
        self.planned = 0  # requests
        self.done = 0  # requests finished
        self.steps = 0  # scheduler steps the warm-up ran (schedule() calls)
        self.tokens = 0  # tokens those steps scheduled (prefill and decode)
        self._clock = clock
        self._started: float | None = None
        self._seconds = 0.0

    @classmethod
    def at_start(cls, settings: WarmupSettings, hooked: bool) -> WarmupProgress:
        """The progress of an engine whose collector starts now; `hooked`: the
        start-up hook is installed (start_hook_installed())."""
        if not settings.enabled:
            return cls(Outcome.OFF)
        progress = cls(Outcome.PENDING)
        if not hooked:
            progress.skip(NO_HOOK)
        return progress

    @property
    def seconds(self) -> float:
        """Wall time of the warm-up: so far while it runs, in total after."""
        if self.outcome == Outcome.RUNNING and self._started is not None:
            return self._clock() - self._started
        return self._seconds

    @property
    def complete(self) -> bool:
        """Every planned request finished."""
        return self.outcome == Outcome.DONE

    def start(self, planned: int) -> None:
        self.outcome, self.planned = Outcome.RUNNING, planned
        self._started = self._clock()

    def update(self, done: int, steps: int, tokens: int) -> None:
        self.done, self.steps, self.tokens = done, steps, tokens

    def end(self, outcome: Outcome, why: str | None = None) -> None:
        self._seconds = self.seconds
        self.outcome, self.why = outcome, why

    def skip(self, why: str) -> None:
        self.outcome, self.why = Outcome.SKIPPED, why
        logger.warning("vllm-runbook: warm-up at start skipped: %s", why)

    def samples(self) -> list[Sample]:
        return [
            Sample(M.WARMUP_REQUESTS_PLANNED, float(self.planned)),
            Sample(M.WARMUP_REQUESTS_DONE, float(self.done)),
            Sample(M.WARMUP_STEPS, float(self.steps)),
            Sample(M.WARMUP_TOKENS, float(self.tokens)),
            Sample(M.WARMUP_SECONDS, self.seconds),
            Sample(M.WARMUP_DONE, 1.0 if self.complete else 0.0),
        ]


# -- the run ---------------------------------------------------------------------


class StepCounters(Protocol):
    """What the warm-up reads of the collector's step statistics (step_stats.py)."""

    @property
    def steps(self) -> int: ...

    @property
    def scheduled_tokens(self) -> int: ...


def vllm_request(request_id: str, prompt: list[int], output_tokens: int) -> Any:
    """A vLLM EngineCoreRequest, built with the fields this vLLM declares."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(
        max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True, temperature=0.0
    )
    fields = EngineCoreRequest.__struct_fields__
    # The fields without a default that a plain text request leaves empty
    # (multimodal features, LoRA, cache salt, DP rank, ...) are None.
    required = fields[: len(fields) - len(EngineCoreRequest.__struct_defaults__)]
    values: dict[str, Any] = dict.fromkeys(required)
    values.update(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=time.time(),
    )
    return EngineCoreRequest(**values)


def why_not(engine: Any) -> str | None:
    """Why this engine core cannot be warmed up by stepping it alone (None: it can)."""
    config = engine.vllm_config
    if getattr(engine, "is_pooling_model", False) or (
        getattr(config.model_config, "runner_type", "generate") != "generate"
    ):
        return "a pooling model generates no tokens"
    if getattr(config.model_config, "is_encoder_decoder", False):
        return "an encoder-decoder model needs encoder inputs"
    if any(c.__name__ == "DPEngineCoreProc" for c in type(engine).__mro__):
        return "data-parallel ranks of this model step together"
    if engine.scheduler.get_kv_connector() is not None:
        return "a KV connector's peers are not up at start"
    return None


def run_warmup(
    engine: Any,
    settings: WarmupSettings,
    progress: WarmupProgress,
    counters: StepCounters,
    new_request: Callable[[str, list[int], int], Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Warm `engine` (vLLM's EngineCore, just built) up; see the module
    docstring. `new_request(id, prompt, output_tokens)` builds what the engine
    adds (default: `vllm_request`). Never raises."""
    new_request = new_request or vllm_request
    try:
        reason = why_not(engine)
        if reason is not None:
            progress.skip(reason)
            return
        config = engine.vllm_config
        count = settings.requests or int(config.scheduler_config.max_num_seqs)
        output_tokens = settings.output_tokens
        max_model_len = int(config.model_config.max_model_len)
        prompt_tokens = max(1, min(settings.prompt_tokens, max_model_len - output_tokens))
    except Exception as exc:
        progress.skip(f"the engine is not one the warm-up knows: {type(exc).__name__}: {exc}")
        return
    scheduler = engine.scheduler
    ids = [f"{REQUEST_ID_PREFIX}{i}" for i in range(count)]
    steps_before, tokens_before = counters.steps, counters.scheduled_tokens
    deadline = clock() + settings.timeout_seconds
    logger.info(
        "vllm-runbook: warming up: %d requests of %d prompt + %d output tokens (at most %g s)",
        count,
        prompt_tokens,
        output_tokens,
        settings.timeout_seconds,
    )
    progress.start(count)

    added: list[str] = []

    def measure(finished: bool = True) -> None:
        """`finished`: count the requests gone from the scheduler as done (not
        after an abort, which removes them too)."""
        progress.update(
            done=sum(1 for rid in added if rid not in scheduler.requests)
            if finished
            else progress.done,
            steps=counters.steps - steps_before,
            tokens=counters.scheduled_tokens - tokens_before,
        )

    step = getattr(engine, "step_fn", None) or engine.step
    post_step = getattr(engine, "post_step", None) or (lambda executed: None)
    try:
        for i, rid in enumerate(ids):
            request = new_request(rid, warmup_prompt(i, prompt_tokens), output_tokens)
            engine.add_request(*engine.preprocess_add_request(request))
            added.append(rid)
        while True:
            measure()
            if not scheduler.has_requests() and not getattr(engine, "batch_queue", None):
                break
            if clock() >= deadline:
                _abort(engine, added, step, post_step)
                measure(finished=False)
                progress.end(Outcome.CUT_SHORT, f"{settings.timeout_seconds:g} s passed")
                logger.warning(
                    "vllm-runbook: warm-up cut short after %g s: %d of %d requests done; "
                    "the engine starts without the rest",
                    settings.timeout_seconds,
                    progress.done,
                    count,
                )
                return
            _, executed = step()
            post_step(executed)
    except Exception as exc:
        _abort(engine, added, step, post_step)
        measure(finished=False)
        progress.end(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
        logger.error(
            "vllm-runbook: warm-up failed after %d of %d requests; the engine starts without it",
            progress.done,
            count,
            exc_info=exc,
        )
        return
    progress.end(Outcome.DONE)
    try:  # the engine starts with the prefix cache it would have without the warm-up
        scheduler.reset_prefix_cache()
    except Exception:
        logger.debug("vllm-runbook: prefix cache not reset after the warm-up", exc_info=True)
    logger.info(
        "vllm-runbook: warm-up done: %d requests, %d steps, %d tokens in %.2f s",
        progress.done,
        progress.steps,
        progress.tokens,
        progress.seconds,
    )


def _abort(
    engine: Any, ids: list[str], step: Callable[[], Any], post_step: Callable[[bool], Any]
) -> None:
    """Abort the warm-up's requests still in the engine and let in-flight batches
    land, so the engine starts empty. Best effort: never raises."""
    try:
        scheduler = engine.scheduler
        left = [rid for rid in ids if rid in scheduler.requests]
        if left:
            engine.abort_requests(left)
        for _ in range(DRAIN_STEPS):
            if not scheduler.has_requests() and not getattr(engine, "batch_queue", None):
                return
            _, executed = step()
            post_step(executed)
    except Exception:
        logger.debug("vllm-runbook: draining the warm-up failed", exc_info=True)


# -- the start-up hook ---------------------------------------------------------------

_installed = False


def start_hook_installed() -> bool:
    """True where the start-up hook is installed in this process: an engine
    core built now will run its collector's warm-up before it reports ready."""
    return _installed


def warm_up(engine: Any) -> None:
    """The hook's call once the engine core is built: the warm-up of the
    engine's collector, where one waits. Never raises."""
    try:
        collector = getattr(engine.scheduler, "runbook_collector", None)
        if (
            collector is None
            or not collector.enabled
            or collector.warmup.outcome != Outcome.PENDING
        ):
            return
        run_warmup(engine, collector.settings.warmup, collector.warmup, collector.stats)
    except Exception:
        logger.exception("vllm-runbook: warm-up not run; the engine starts without it")


class _WarmUpFirst:
    """`EngineCoreProc.process_input_sockets`, which `EngineCoreProc.__init__`
    looks up once in the main thread after the engine core is built, before
    it starts its input thread and sends READY: the start-up hook of a spawned
    EngineCore process, whose plugin loads inside `EngineCore.__init__`, too
    late for that call to be wrapped."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        if engine is not None:
            warm_up(engine)  # once: the warm-up runs only while pending
        return self.function.__get__(engine, owner)


def install_start_hook(engine_core: type, engine_core_proc: type) -> None:
    """Warm engines up once built: at the end of `engine_core.__init__` (vLLM's
    EngineCore; in-process and forked engines) and, for a spawned process, at
    `engine_core_proc`'s (EngineCoreProc) first look at `process_input_sockets`.
    Idempotent; the warm-up runs once per engine whichever comes first."""
    global _installed
    original = engine_core.__dict__["__init__"]
    if not getattr(original, "vllm_runbook_warmup", False):

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            warm_up(self)

        __init__.vllm_runbook_warmup = True  # type: ignore[attr-defined]
        engine_core.__init__ = __init__  # type: ignore[misc]
    sockets = engine_core_proc.__dict__.get("process_input_sockets")
    if sockets is not None and not isinstance(sockets, _WarmUpFirst):
        engine_core_proc.process_input_sockets = _WarmUpFirst(sockets)  # type: ignore[attr-defined]
    _installed = True
