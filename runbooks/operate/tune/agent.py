"""The tuner's engine on a live agent (`AgentEngine`: every change journaled
before the engine is touched) and the report's text."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_runbook.collector.agent_api import AgentState, SettledSince
from vllm_runbook.rules.checklist import parse_exposition
from vllm_runbook.rules.promfuncs import bucket_quantile
from vllm_runbook.runbooks.engine.client import (
    Agent,
    EngineClientError,
    EngineUnreachable,
)
from vllm_runbook.runbooks.operate.tune.points import (
    TTFT,
    TUNED_KNOBS,
    Window,
    breach_of,
)


class Journaling(Protocol):
    def add_step(self, *args: Any, **kwargs: Any) -> Any: ...

    def finish_step(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass
class AgentEngine:
    """The tuner's engine: the agent's `/v1/state` and knobs; each change
    journaled (its before-values committed) before the engine is touched."""

    client: Agent
    api_url: str | None = None
    journal: Journaling | None = None
    execution_id: int | None = None
    renew: Callable[[], None] | None = None
    poll_seconds: float = 0.5
    # A change not in effect (max_num_seqs draining) after this long is judged as such.
    settle_seconds: float = 60.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def state(self) -> AgentState:
        return self.client.state()

    def apply(self, phase: str, knobs: Mapping[str, Any]) -> int:
        from vllm_runbook.runbooks.store.models import STEP_APPLIED, STEP_FAILED

        before = {k: getattr(self.client.state().knobs, k) for k in knobs}
        row = None
        if self.journal is not None and self.execution_id is not None:
            self._renew()
            row = self.journal.add_step(self.execution_id, f"tune:{phase}", {}, before=before)
        try:
            result = self.client.set_knobs(**knobs)
        except EngineClientError as error:
            if row is not None:
                self.journal.finish_step(row.id, STEP_FAILED, error=str(error))  # type: ignore[union-attr]
            raise
        if row is not None:
            self.journal.finish_step(  # type: ignore[union-attr]
                row.id,
                STEP_APPLIED,
                after={k: getattr(result.after, k) for k in knobs},
                applied_at_step=result.effective_from_step,
            )
        return result.effective_from_step

    def restore_startup(self) -> int:
        state = self.client.state()
        back = {k: getattr(state.startup, k) for k in (*TUNED_KNOBS, "autopilot")}
        changes = {k: v for k, v in back.items() if getattr(state.knobs, k) != v}
        if not changes:
            return state.engine.step
        return self.apply("restore", changes)

    def _ttft(self, state: AgentState) -> dict[float, float] | None:
        if self.api_url is None:
            return None
        import httpx

        try:
            text = httpx.get(self.api_url + "/metrics", timeout=self.client.timeout).text
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"vLLM server {self.api_url} unreachable: {exc}") from None
        samples = parse_exposition(text, model_name=state.engine.model_name)
        buckets: dict[float, float] = {}
        for labels, value in samples.get(TTFT + "_bucket", []):
            if labels.get("engine", state.engine.engine) == state.engine.engine:
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        return buckets

    def _renew(self) -> None:
        """Keep the engine's lock; a lapsed one stops the tune (and restores)."""
        if self.renew is None:
            return
        try:
            self.renew()
        except Exception as error:  # the guardrails' Abort: the lease lapsed
            raise EngineClientError(str(error)) from None

    def _wait(self) -> None:
        self._renew()
        self.sleep(self.poll_seconds)

    def measure(self, from_step: int | None, seconds: float) -> Window:
        if from_step is None:
            return self._baseline(seconds)
        start = self.clock()
        state = self.client.state(since_step=from_step)
        while not isinstance(state.since, SettledSince):
            if self.clock() - start > self.settle_seconds:
                why = "the agent kept no mark" if state.since is None else "still draining"
                return Window(0.0, None, 0, 0, from_step=from_step, not_in_effect=why)
            self._wait()
            state = self.client.state(since_step=from_step)
        ttft0 = self._ttft(state)
        peak = 0.0
        while True:
            since = state.since
            assert isinstance(since, SettledSince)
            peak = max(peak, state.stats.kv_cache_usage)
            errors = since.finished_by_reason.get("error", 0)
            breach = breach_of(since.seconds, since.preemptions, since.requests_finished, errors)
            if breach is not None or since.seconds >= seconds:
                break
            self._wait()
            state = self.client.state(since_step=from_step)
        return Window(
            seconds=since.seconds,
            throughput=since.scheduled_tokens_per_second,
            finished=since.requests_finished,
            preemptions=since.preemptions,
            errors=errors,
            e2e_p99=since.engine_e2e_latency_p99,
            queue_p99=since.engine_queue_time_p99,
            ttft_p99=_p99_delta(ttft0, self._ttft(state)),
            kv_usage_peak=peak,
            from_step=from_step,
            breach=breach,
        )

    def _baseline(self, seconds: float) -> Window:
        """No change to measure from: counter deltas over the window; the P99s
        over the agent's trailing window at its end (no change in it either)."""
        first = self.client.state()
        ttft0 = self._ttft(first)
        start = self.clock()
        peak = first.stats.kv_cache_usage
        while self.clock() - start < seconds:
            self._wait()
            peak = max(peak, self.client.state().stats.kv_cache_usage)
        last = self.client.state()
        elapsed = self.clock() - start
        s0, s1 = first.stats, last.stats
        finished0 = sum(s0.requests_finished_by_reason_total.values())
        finished1 = sum(s1.requests_finished_by_reason_total.values())
        errors = s1.requests_finished_by_reason_total.get(
            "error", 0
        ) - s0.requests_finished_by_reason_total.get("error", 0)
        return Window(
            seconds=elapsed,
            throughput=(s1.scheduled_tokens_total - s0.scheduled_tokens_total) / elapsed
            if elapsed > 0
            else None,
            finished=finished1 - finished0,
            preemptions=s1.preemptions_total - s0.preemptions_total,
            errors=errors,
            e2e_p99=s1.engine_e2e_latency_p99,
            queue_p99=s1.engine_queue_time_p99,
            ttft_p99=_p99_delta(ttft0, self._ttft(last)),
            kv_usage_peak=max(peak, s1.kv_cache_usage),
        )


def _p99_delta(
    before: Mapping[float, float] | None, after: Mapping[float, float] | None
) -> float | None:
    """P99 of a histogram's observations between two scrapes (bucket bound)."""
    if before is None or after is None:
        return None
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    if delta.get(math.inf, 0.0) <= 0:
        return None
    return float(bucket_quantile(0.99, sorted(delta.items())))


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: every point, the setting kept, the restart flags."""
    from vllm_runbook.runbooks.run.render import format_table

    def ms(value: Any) -> str:
        return "-" if value is None else f"{1000 * value:.0f}"

    rows = []
    for i, p in enumerate(report.get("points", [])):
        k = p["knobs"]
        oom = p.get("oom_rate")
        mark = "*" if i == report.get("kept_point") else ""
        rows.append(
            (
                f"{i}{mark}",
                p["phase"],
                k["max_num_batched_tokens"],
                k["max_num_seqs"],
                k["policy"],
                f"{p['seconds']:.1f}",
                "-" if p["throughput"] is None else f"{p['throughput']:.0f}",
                ms(p["e2e_p99"]),
                ms(p["ttft_p99"]),
                p["finished"],
                p["preemptions"],
                "-" if oom is None else f"{100 * oom:.2g}",
                "yes" if p["meets"] else "; ".join(p["failures"]),
            )
        )
    headers = (
        "#", "phase", "budget", "seqs", "policy", "s", "tok/s", "e2e p99 ms",
        "ttft p99 ms", "done", "preempt", "oom %", "meets",
    )  # fmt: skip
    lines = [
        f"runbook tune {report.get('engine', '')}: {report['limits']['text']}, "
        f"{report['window_seconds']:g} s per point" + (" (dry run)" if report["dry_run"] else ""),
        "",
        format_table(rows, headers).rstrip("\n"),
        "",
    ]
    block = report.get("block_size")
    if block:
        lines.append(f"block size: {block['shown']} ({block['status']}) {block['note']}".rstrip())
        if block.get("sweep"):
            lines.append(f"block size sweep: {block['sweep']}")
    policy = report.get("policy")
    if policy:
        lines.append(f"policy: {policy['why']}" + (f"; {policy['kept']}" if policy["kept"] else ""))
    if report.get("planned"):
        planned = "; ".join(f"{k} {v}" for k, v in report["planned"].items())
        lines.append(f"a real run walks: {planned}")
    for event in report.get("events", []):
        lines.append(f"- {event}")
    lines.append(f"outcome: {report['outcome']}")
    lines.append(
        f"SLA broken {report['sla_broken_seconds']:.0f} s of {report['tune_seconds']:.0f} s "
        f"({100 * report['sla_broken_share']:.0f} %), breaker trips {report['breaches']}"
    )
    restart = report.get("restart")
    if restart:
        lines.append(f"at the next restart: {restart['command']}")
        lines += [f"  {note}" for note in restart["notes"]]
    return "\n".join(lines) + "\n"
