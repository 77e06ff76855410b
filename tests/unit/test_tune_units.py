"""`runbook tune`'s walk on a fake engine whose measurements follow its knobs:
the points chosen, the judgement, the step back, the restore, the flags."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from vllm_runbook.collector.agent_api import AgentState, EngineConfig, Workload
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.tune import (
    Point,
    TuneLimits,
    Tuner,
    TuneStopped,
    Window,
    beats,
    judge_point,
    ladder,
    midpoints,
    policy_candidate,
    restart_flags,
)

from tests.fake_agent import STARTUP, agent_state
from tests.rules.test_rules_config_checks import GPU_CONFIG, lengths

FCFS = {**STARTUP, "policy": "fcfs"}


class FakeEngine:
    """Knobs that move like the agent's; each window what `model(knobs)` says."""

    def __init__(
        self,
        model: Callable[[Mapping[str, Any]], Window],
        *,
        spread: float | None = 1.5,
        interrupt_at: int | None = None,
    ) -> None:
        self.model = model
        self.knobs: dict[str, Any] = dict(FCFS)
        self.applied: list[tuple[str, dict[str, Any]]] = []
        self.measured = 0
        self.spread = spread
        self.interrupt_at = interrupt_at
        self.step = 100

    def state(self) -> AgentState:
        workload = Workload(
            window_seconds=60,
            requests_arrived=100,
            prompt_tokens=lengths(100, 200, 300, 400),
            output_tokens=lengths(50, 100, 150, 200),
            prompt_length_spread_ratio=self.spread,
            long_prompt_ratio=0.0,
        )
        return agent_state(self.knobs, step=self.step).model_copy(
            update={"config": EngineConfig(**GPU_CONFIG), "workload": workload}
        )

    def apply(self, phase: str, knobs: Mapping[str, Any]) -> int:
        self.applied.append((phase, dict(knobs)))
        self.knobs.update(knobs)
        if "max_num_seqs" in knobs and "autopilot" not in knobs:
            self.knobs["autopilot"] = False
        self.step += 10
        return self.step

    def restore_startup(self) -> int:
        return self.apply("restore", {k: STARTUP[k] for k in ("max_num_batched_tokens",)})

    def measure(self, from_step: int | None, seconds: float) -> Window:
        self.measured += 1
        if self.measured == self.interrupt_at:
            raise KeyboardInterrupt
        return self.model(self.knobs)


def window(throughput: float, preemptions: int = 0, e2e: float = 0.5, **kw: Any) -> Window:
    return Window(2.0, throughput, 100, preemptions, e2e_p99=e2e, queue_p99=0.01, **kw)


SEQS_TPUT = {32: 1200, 24: 1150, 16: 1000, 12: 900, 8: 700, 4: 400}
BUDGET_TPUT = {256: 1100, 384: 1050, 192: 1000, 128: 800, 64: 500}


def kv_bound(k: Mapping[str, Any]) -> Window:
    """32 and 24 sequences preempt (10 % and 1 %); a budget cut helps down to 256."""
    seqs, budget = k["max_num_seqs"], k["max_num_batched_tokens"]
    tput = SEQS_TPUT[seqs] if budget == 512 else BUDGET_TPUT[budget]
    return window(tput, {32: 10, 24: 1}.get(seqs, 0))


def phases(report: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    return [
        (p["phase"], p["knobs"]["max_num_seqs"], p["knobs"]["max_num_batched_tokens"])
        for p in report["points"]
    ]


def test_ladder_and_midpoints() -> None:
    assert ladder(32, 1) == [32, 16, 8, 4]
    assert ladder(512, 200) == [512, 256, 200]
    assert ladder(64, 64) == [64]
    assert midpoints(16, [32, 16, 8]) == [24, 12]
    assert midpoints(16, [17, 16, 15]) == []
    assert midpoints(32, [32, 16]) == [24]


def test_a_point_is_judged_on_the_sla_and_the_oom_rate() -> None:
    limits = TuneLimits(sla_e2e_p99=1.0)
    assert judge_point(window(1000), limits) == ([], False)
    assert judge_point(window(1000, e2e=1.5), limits) == (["P99 end-to-end 1.5 s > SLA 1 s"], True)
    # 0.1 % is over the limit (under 0.1 % is the goal): 1 preemption in 100 requests fails.
    assert judge_point(window(1000, preemptions=1), limits) == (
        ["OOM rate 1 % (1 preemptions / 100 finished) >= 0.1 %"],
        False,
    )
    empty = Window(2.0, 0.0, 0, 0)
    assert judge_point(empty, limits) == (
        ["no request finished in the window: nothing to judge"],
        False,
    )
    ttft = TuneLimits(sla_ttft_p99=0.2)
    assert judge_point(window(1000), ttft) == (["P99 TTFT not measured"], False)
    drained = Window(0.0, None, 0, 0, not_in_effect="still draining")
    assert judge_point(drained, limits) == (["not in effect: still draining"], False)


def test_the_walk_keeps_the_fastest_point_that_meets_both_and_steps_back() -> None:
    engine = FakeEngine(kv_bound)
    report = Tuner(engine, TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert phases(report) == [
        ("baseline", 32, 512),  # 10 % OOM rate: not kept, and the walk goes on lower
        ("max_num_seqs", 16, 512),
        ("max_num_seqs", 8, 512),  # 30 % below the best: lower only loses
        ("max_num_seqs", 24, 512),  # the midpoints: 1 % preempts
        ("max_num_seqs", 12, 512),
        ("max_num_batched_tokens", 16, 256),
        ("max_num_batched_tokens", 16, 128),
        ("max_num_batched_tokens", 16, 384),
        ("max_num_batched_tokens", 16, 192),
    ]
    assert engine.applied == [
        ("max_num_seqs", {"max_num_seqs": 16}),
        ("max_num_seqs", {"max_num_seqs": 8}),
        ("max_num_seqs", {"max_num_seqs": 24}),
        ("step back", {"max_num_seqs": 16}),
        ("max_num_seqs", {"max_num_seqs": 12}),
        ("keep max_num_seqs", {"max_num_seqs": 16}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 256}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 128}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 384}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 192}),
        ("keep max_num_batched_tokens", {"max_num_batched_tokens": 256}),
    ]
    assert report["kept"] == {
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "policy": "fcfs",
        "autopilot": False,
    }
    assert report["kept_point"] == 5
    assert report["ended_with"] == {
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "policy": "fcfs",
    }
    assert report["outcome"] == (
        "kept max_num_batched_tokens 256, max_num_seqs 16, policy fcfs (1100 tokens/s)"
    )
    assert report["events"] == [
        "step back to max_num_batched_tokens 512, max_num_seqs 16, policy fcfs: "
        "OOM rate 1 % (1 preemptions / 100 finished) >= 0.1 %"
    ]
    assert report["policy"]["why"] == "spread 1.5:1: fcfs kept"
    assert report["breaches"] == 0 and report["sla_broken_seconds"] == 0


def test_a_tie_within_the_noise_goes_to_the_less_restrictive_setting() -> None:
    """benchmarks/tune.py's long workload, round 3: 8 and 12 sequences measured
    7,024 and 7,018 tokens/s; the tie keeps 12 (the sweep's best). A point 2 %
    or more faster still wins over a less restrictive one."""
    tput = {32: 6000, 16: 6500, 8: 7024, 4: 5000, 24: 6900, 12: 7018, 6: 6000}

    def seqs_only(k: Mapping[str, Any]) -> Window:
        seqs, budget = k["max_num_seqs"], k["max_num_batched_tokens"]
        return window(tput[seqs] if budget == 512 else 6000, 10 if seqs == 32 else 0)

    report = Tuner(FakeEngine(seqs_only), TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert [p[1] for p in phases(report) if p[0] == "max_num_seqs"] == [16, 8, 4, 12, 6]
    assert report["kept"]["max_num_seqs"] == 12

    tput[8] = 7200  # 2.6 % faster than 12: not a tie
    report = Tuner(FakeEngine(seqs_only), TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert report["kept"]["max_num_seqs"] == 8


def test_ties_do_not_chain_below_the_fastest_point() -> None:
    """12 sequences ties 8 (1 % slower, less restrictive) and is kept; 16 is a
    tie of 12 but 2.9 % below the fastest (8): not kept."""

    def point(seqs: int, tput: float) -> Point:
        knobs = {"max_num_seqs": seqs, "max_num_batched_tokens": 512, "policy": "fcfs"}
        return Point("max_num_seqs", knobs, window(tput), [], False)

    eight, twelve, sixteen = point(8, 1000), point(12, 990), point(16, 971)
    assert beats(twelve, eight, fastest=1000)
    assert not beats(sixteen, twelve, fastest=1000)
    assert beats(sixteen, twelve, fastest=990)  # were 12 the fastest, 16 ties it
    assert beats(point(4, 1021), twelve, fastest=1021)  # faster beyond a tie


def test_a_breach_steps_back_at_once_and_the_sla_time_is_counted() -> None:
    def model(k: Mapping[str, Any]) -> Window:
        seqs, budget = k["max_num_seqs"], k["max_num_batched_tokens"]
        if seqs == 16:
            return window(600, 30, e2e=3.0, breach="30 preemptions per 100 finished requests")
        if budget != 512:
            return window({256: 850, 384: 950}[budget])
        return window(1000)

    engine = FakeEngine(model)
    report = Tuner(engine, TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert engine.applied == [
        ("max_num_seqs", {"max_num_seqs": 16}),
        ("step back", {"max_num_seqs": 32}),
        ("max_num_seqs", {"max_num_seqs": 24}),
        ("keep max_num_seqs", {"max_num_seqs": 32}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 256}),
        ("max_num_batched_tokens", {"max_num_batched_tokens": 384}),
        ("keep max_num_batched_tokens", {"max_num_batched_tokens": 512}),
    ]
    breached = report["points"][1]
    assert breached["failures"] == [
        "circuit breaker: 30 preemptions per 100 finished requests",
        "OOM rate 30 % (30 preemptions / 100 finished) >= 0.1 %",
        "P99 end-to-end 3 s > SLA 1 s",
    ]
    assert report["kept_point"] == 0 and report["kept"]["max_num_seqs"] == 32
    assert report["breaches"] == 1
    assert report["sla_broken_seconds"] == 2.0  # the one point over the SLA, 2 s


def test_an_interrupt_restores_what_tune_changed_and_says_so() -> None:
    engine = FakeEngine(kv_bound, interrupt_at=3)  # during the second point (seqs 8)
    with pytest.raises(TuneStopped) as stopped:
        Tuner(engine, TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert stopped.value.code == ExitCode.INTERRUPTED
    assert str(stopped.value) == "interrupted: restored max_num_seqs 32"
    assert engine.applied[-1] == ("restore", {"max_num_seqs": 32})
    assert engine.knobs["max_num_seqs"] == 32
    assert stopped.value.report["outcome"] == "interrupted: restored max_num_seqs 32"
    assert [p["phase"] for p in stopped.value.report["points"]] == ["baseline", "max_num_seqs"]


def test_a_dry_run_measures_and_recommends_without_a_change() -> None:
    engine = FakeEngine(kv_bound, spread=6.0)
    slow = {**FCFS}

    def waits(k: Mapping[str, Any]) -> Window:
        return Window(2.0, 1000, 100, 0, e2e_p99=1.0, queue_p99=0.5)

    engine.model = waits
    report = Tuner(engine, TuneLimits(sla_e2e_p99=2.0), window_seconds=2, dry_run=True).run()
    assert engine.applied == []
    assert engine.knobs == slow
    assert report["planned"] == {
        "max_num_seqs": [32, 16, 8, 4],
        "max_num_batched_tokens": [512, 256, 128, 64],
    }
    assert report["policy"]["tried"] == "tiered"
    assert report["policy"]["kept"] == "not tried (dry run): a real run measures tiered"
    assert report["outcome"] == "dry run: measured and recommended, nothing changed"


def test_the_policy_follows_the_spread_and_the_waiting_times() -> None:
    engine = FakeEngine(kv_bound, spread=6.0)
    waited = Window(2.0, 1000, 100, 0, e2e_p99=1.0, queue_p99=0.5)
    quick = Window(2.0, 1000, 100, 0, e2e_p99=1.0, queue_p99=0.01)
    assert policy_candidate(engine.state(), waited) == (
        "tiered",
        "spread 6.0:1 >= 4:1, queue P99 0.5 s",
    )
    assert policy_candidate(engine.state(), quick) == (
        None,
        "spread 6.0:1 but requests hardly wait (queue P99 0.01 s, under 10 % of the "
        "end-to-end P99): fcfs kept",
    )
    engine.knobs["policy"] = "tiered"
    engine.spread = 2.0
    assert policy_candidate(engine.state(), waited) == (
        "fcfs",
        "spread 2.0:1 < 4:1: tiered has little to sort",
    )


def test_the_restart_flags_carry_the_kept_values_and_the_checks_advice() -> None:
    state = FakeEngine(kv_bound).state()
    config = EngineConfig(
        **{**GPU_CONFIG, "gpu_memory_utilization": 0.95, "enable_chunked_prefill": False}
    )
    assert state.workload is not None
    workload = state.workload.model_copy(update={"long_prompt_ratio": 0.02})
    state = state.model_copy(update={"config": config, "workload": workload})
    kept = {"max_num_batched_tokens": 256, "max_num_seqs": 16, "policy": "tiered"}
    flags = restart_flags(state, kept)
    assert flags["command"] == (
        "VLLM_RUNBOOK_POLICY=tiered vllm serve MODEL --max-num-batched-tokens 256 "
        "--max-num-seqs 16 --block-size 8 --enable-chunked-prefill --gpu-memory-utilization 0.85"
    )
    assert [n.split(":")[0] for n in flags["notes"]] == [
        "block size",
        "chunked prefill",
        "memory utilisation",
    ]
    # vLLM 0.34's extensible KV cache sizes itself: no utilisation flag, no note.
    extensible = config.model_copy(
        update={"gpu_memory_utilization": 1.0, "extensible_kv_cache": True}
    )
    flags = restart_flags(state.model_copy(update={"config": extensible}), kept)
    assert "--gpu-memory-utilization" not in flags["command"]
    assert "memory utilisation" not in [n.split(":")[0] for n in flags["notes"]]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--sla-p99", "-1"), "argument --sla-p99: must be > 0 seconds, got -1"),
        (("--window", "0"), "argument --window: must be > 0 seconds, got 0"),
        (("--max-points", "x"), "argument --max-points: 'x' is not an integer"),
        (
            ("--sla-ttft-p99", "1"),
            "--sla-ttft-p99 needs --vllm URL: TTFT comes from vLLM's /metrics",
        ),
        (("--dry-run", "--restore"), "--restore has nothing to restore in a --dry-run"),
        (("--vllm", "ftp://x"), "--vllm: not an HTTP URL: 'ftp://x'"),
        (("--speed", "1"), "unrecognized arguments: --speed 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_engine_is_asked(
    args: tuple[str, ...], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_runbook.runbooks.operate.cli import main

    # Port 9 (discard): nothing is asked of it, every refusal comes first.
    code = main(["tune", "--engine", "http://127.0.0.1:9", *args])
    assert (code, capsys.readouterr().err) == (ExitCode.USAGE, f"runbook: error: {error}\n")


def test_an_engine_that_does_not_answer_is_exit_3_and_nothing_is_journaled(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from vllm_runbook.runbooks.operate.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "runbook.db"
    code = main(["tune", "--engine", f"127.0.0.1:{port}", "--db", f"sqlite:///{db}"])
    err = capsys.readouterr().err
    assert code == ExitCode.ENGINE and err.count("\n") == 1, err
    assert err.startswith(f"runbook: error: engine http://127.0.0.1:{port} unreachable: ")
    assert not db.exists()


def test_a_lost_engine_ends_the_tune_saying_what_could_not_be_restored() -> None:
    from vllm_runbook.runbooks.engine.client import EngineUnreachable

    class Lost(FakeEngine):
        lost = False

        def _gone(self) -> None:
            if self.lost:
                raise EngineUnreachable("engine http://127.0.0.1:9 unreachable: refused")

        def state(self) -> AgentState:
            self._gone()
            return super().state()

        def apply(self, phase: str, knobs: Mapping[str, Any]) -> int:
            self._gone()
            return super().apply(phase, knobs)

        def measure(self, from_step: int | None, seconds: float) -> Window:
            if self.measured == 2:  # during the second point (seqs 8)
                self.lost = True
            self._gone()
            return super().measure(from_step, seconds)

    engine = Lost(kv_bound)
    with pytest.raises(TuneStopped) as stopped:
        Tuner(engine, TuneLimits(sla_e2e_p99=1.0), window_seconds=2).run()
    assert stopped.value.code == ExitCode.ENGINE
    assert str(stopped.value) == (
        "engine lost (engine http://127.0.0.1:9 unreachable: refused): could not restore "
        "max_num_seqs 32 (engine http://127.0.0.1:9 unreachable: refused): "
        "`runbook revert` the execution when the engine is back"
    )
    assert "restart" not in stopped.value.report  # nothing read from a lost engine
    assert engine.knobs["max_num_seqs"] == 8  # as it was left: the journal can revert it


def test_tune_is_refused_by_the_blast_radius_like_a_runbook(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_runbook.runbooks.operate.cli import main
    from vllm_runbook.runbooks.store import Journal, ensure_schema
    from vllm_runbook.runbooks.store.models import ExecutionStatus

    from tests.fake_agent import AgentHTTP

    db = ensure_schema(f"sqlite:///{tmp_path / 'runbook.db'}")
    journal = Journal(db)
    other, _ = journal.create_execution(
        "oom-pressure", "http://10.0.0.2:9360", trigger="cli", who="someone"
    )
    journal.transition(other.id, ExecutionStatus.RUNNING)  # another engine under remediation
    agent = AgentHTTP()
    try:
        code = main(["tune", "--engine", agent.url, "--token", "t", "--db", db, "--window", "1"])
    finally:
        agent.close()
    assert (code, capsys.readouterr().err) == (
        ExitCode.USAGE,
        "runbook: error: blast radius: 1 other engine(s) under remediation "
        "(at most 1 at once for tune)\n",
    )
    assert agent.agent.writes == []  # refused before any change
    tune = journal.list_executions()[0]
    assert (tune.runbook, tune.status) == ("tune", "refused")
    journal.close()


def test_step_2_is_the_reports_sweep_and_the_restart_flags_follow_it() -> None:
    """The running requests' what-if fragmentation: 16 is at 18 %, 8 at 6 %: the sweep
    from 16 down stops at 8, in the report and in the flags. Long contexts sweep from
    the reports' 64, which costs about 5 % of memory utilisation."""
    state = FakeEngine(kv_bound).state()
    what_if = {"8": 0.06, "16": 0.18, "32": 0.31, "64": 0.55, "128": 0.77}
    stats = state.stats.model_copy(
        update={"requests_running": 12, "block_fragmentation_at_block_size": what_if}
    )
    state = state.model_copy(update={"stats": stats})
    kept = {"max_num_batched_tokens": 256, "max_num_seqs": 16, "policy": "fcfs"}
    flags = restart_flags(state, kept)
    assert "--block-size 8 " in flags["command"]
    assert flags["notes"][0] == (
        "block size: the reports' sweep from 16 down, the first size with fragmentation < 15% "
        "and GPU utilisation > 90% (16: 18%, 8: 6%): 8 (its GPU utilisation is "
        "measured after the restart)"
    )
    assert state.workload is not None
    long = state.model_copy(
        update={
            "workload": state.workload.model_copy(
                update={"prompt_tokens": lengths(20_000, 30_000, 33_000, 34_000)}
            ),
            "stats": stats.model_copy(
                update={"block_fragmentation_at_block_size": {"16": 0.001, "64": 0.02}}
            ),
        }
    )
    flags = restart_flags(long, kept)
    assert "--block-size 64 " in flags["command"]
    assert flags["command"].endswith("--gpu-memory-utilization 0.8")
    assert flags["notes"][0].endswith(
        "(64: 2%): 64 (its GPU utilisation is measured after the restart); block size 64 "
        "costs about 5% more memory (the reports): keep it as headroom, "
        "--gpu-memory-utilization 0.8"
    )
