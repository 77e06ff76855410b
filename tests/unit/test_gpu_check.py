"""The GPU check's parsers and checks, on text recorded the way vLLM and the
agent write it (vLLM's own CUDAGraphLogging; a prometheus_client registry).
The run itself needs a CUDA machine: benchmarks/gpu_check.sh."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


G = _load()
CAPTURE = [1, 2, 4, 8, 16, 24, 32]


def vllm_log(stats: list[tuple[int, int, str]]) -> str:
    """What `vllm serve --cudagraph-metrics` logs, made by vLLM's own class."""
    from vllm.compilation.cuda_graph import CUDAGraphLogging, CUDAGraphStat
    from vllm.config.compilation import CUDAGraphMode

    logging = CUDAGraphLogging(CUDAGraphMode.FULL_AND_PIECEWISE, CAPTURE)
    for unpadded, padded, mode in stats:
        logging.observe(CUDAGraphStat(unpadded, padded, padded - unpadded, mode))
    lines: list[str] = []
    logging.log(lambda text: lines.append(f"(APIServer pid=1) INFO 12-01 loggers.py:343] {text}"))
    return "INFO noise | 1 | 2 |\n" + "\n".join(lines)


def exposition(padded: int, unpadded: int, steps: int, scheduled: int, **gpu: float) -> str:
    r = CollectorRegistry()
    labels = {"model_name": "m", "engine": "0"}
    for name, value in (
        ("padded_tokens", padded),
        ("unpadded_tokens", unpadded),
        ("steps", steps),
        ("scheduled_tokens", scheduled),
    ):
        Counter(f"vllm_runbook_{name}", name, list(labels), registry=r).labels(**labels).inc(value)
    sched = Histogram("vllm_runbook_schedule_seconds", "timed", list(labels), registry=r)
    for _ in range(steps):
        sched.labels(**labels).observe(0.001)
    Gauge("vllm_runbook_nvml_up", "up", list(labels), registry=r).labels(**labels).set(
        1 if gpu else 0
    )
    if gpu:
        g = [*labels, "gpu"]
        used = Gauge("vllm_runbook_gpu_memory_used_bytes", "used", g, registry=r)
        total = Gauge("vllm_runbook_gpu_memory_total_bytes", "total", g, registry=r)
        util = Gauge("vllm_runbook_gpu_utilization_ratio", "util", g, registry=r)
        dram = Gauge("vllm_runbook_gpu_dram_utilization_ratio", "dram", g, registry=r)
        peak = Gauge("vllm_runbook_gpu_memory_used_peak_bytes", "peak", g, registry=r)
        used.labels(**labels, gpu="0").set(gpu["used"])
        total.labels(**labels, gpu="0").set(gpu["total"])
        util.labels(**labels, gpu="0").set(gpu["util"])
        dram.labels(**labels, gpu="0").set(gpu.get("dram", 0.5))
        peak.labels(**labels, gpu="0").set(gpu.get("peak", gpu["used"]))
    return generate_latest(r).decode()


def test_vllm_tables_are_read_back_exactly() -> None:
    log = G.parse_cudagraph_log(
        vllm_log([(3, 4, "FULL"), (3, 4, "FULL"), (13, 16, "FULL"), (100, 100, "NONE")])
    )
    assert log.capture_sizes == CAPTURE
    assert sorted(log.rows) == [
        (3, 4, 1, "FULL", 2),
        (13, 16, 3, "FULL", 1),
        (100, 100, 0, "NONE", 1),
    ]
    assert (log.unpadded, log.padded) == (3 * 2 + 13 + 100, 4 * 2 + 16 + 100)


def test_padding_checks_pass_on_agreement_and_fail_on_any_difference() -> None:
    log = G.parse_cudagraph_log(vllm_log([(3, 4, "FULL"), (13, 16, "FULL"), (100, 100, "NONE")]))
    before = G.parse_exposition(exposition(0, 0, 0, 0))
    agree = G.parse_exposition(exposition(120, 116, 3, 116))
    assert all(c.ok for c in G.check_padding(before, agree, log))
    off_by_one = G.parse_exposition(exposition(121, 116, 3, 116))
    [_, counters, _] = G.check_padding(before, off_by_one, log)
    assert not counters.ok and "121/116" in counters.detail
    # A row that the prediction gets wrong (vLLM padded 13 to 24, not 16).
    odd = G.parse_cudagraph_log(vllm_log([(13, 24, "FULL")]))
    [_, _, prediction] = G.check_padding(before, before, odd)
    assert not prediction.ok and "(13, 24, 'FULL')" in prediction.detail
    # No table at all (no --cudagraph-metrics, or nothing padded) is a failure, not a pass.
    assert not G.check_padding(before, before, G.parse_cudagraph_log(""))[0].ok


def test_async_checks() -> None:
    expected = sum(p + m - 1 for p, m in G.WORKLOAD)
    before = G.parse_exposition(exposition(0, 0, 5, 40))
    after = G.parse_exposition(exposition(0, 0, 105, 40 + expected))
    state = {"engine": {"scheduler_class": "RunbookAsyncScheduler"}, "collector_up": True}
    assert all(c.ok for c in G.check_async(state, before, after))
    sync = {"engine": {"scheduler_class": "RunbookScheduler"}, "collector_up": True}
    assert [c.ok for c in G.check_async(sync, before, after)] == [False, True, True, True]
    short = G.parse_exposition(exposition(0, 0, 105, 39 + expected))
    assert [c.ok for c in G.check_async(state, before, short)] == [True, True, True, False]


def test_nvml_checks() -> None:
    smi = G.parse_nvidia_smi("0, 20480, 143771\n")
    assert smi == {"0": (20480 * 2**20, 143771 * 2**20)}
    gib = 2**30
    good = G.parse_exposition(
        exposition(0, 0, 0, 0, used=20.5 * gib, total=143771 * 2**20, util=0.4)
    )
    assert all(c.ok for c in G.check_nvml(good, smi))
    far = G.parse_exposition(exposition(0, 0, 0, 0, used=40 * gib, total=143771 * 2**20, util=0.4))
    assert [c.ok for c in G.check_nvml(far, smi)] == [True, True, False, True, True]
    # A peak below the memory in use, or a DRAM share out of [0, 1], is a bug.
    low_peak = exposition(0, 0, 0, 0, used=20.5 * gib, total=143771 * 2**20, util=0.4, peak=gib)
    assert [c.ok for c in G.check_nvml(G.parse_exposition(low_peak), smi)][-1] is False
    dram = exposition(0, 0, 0, 0, used=20.5 * gib, total=143771 * 2**20, util=0.4, dram=78.0)
    assert [c.ok for c in G.check_nvml(G.parse_exposition(dram), smi)][-1] is False
    none = G.parse_exposition(exposition(0, 0, 0, 0))
    assert not any(c.ok for c in G.check_nvml(none, smi))


def hardware_exposition(**gpus: tuple[str, str, str, str, str]) -> str:
    """gpu_hardware_info as the collector exports it, one series per GPU (gpu0=...)."""
    from vllm_runbook.collector import metrics as M

    r = CollectorRegistry()
    info = M.build_gauge(M.GPU_HARDWARE_INFO, r)
    for gpu, values in gpus.items():
        info.labels("m", "0", gpu.removeprefix("gpu"), *values).set(1)
    return generate_latest(r).decode()


def state_hardware(**gpus: tuple[str, str, str, str, str]) -> dict[str, object]:
    """/v1/state's gpus block for the same GPUs."""
    return {
        "gpus": {
            "hardware": {
                gpu.removeprefix("gpu"): {
                    k: (int(v) if v.isdigit() else v or None)
                    for k, v in zip(G.HARDWARE_LABELS, values, strict=True)
                }
                for gpu, values in gpus.items()
            }
        }
    }


def test_hardware_checks() -> None:
    from vllm_runbook.collector import metrics as M

    assert G.HARDWARE_LABELS == M.GPU_HARDWARE_LABELS  # the script repeats the names
    smi = G.parse_nvidia_smi_hardware("0, 9.0, 5, 16\n")
    assert smi == {"0": ("9.0", 5, 16)}
    h200 = ("9.0", "1", "5", "5", "16")  # an idle link at gen 1
    after = G.parse_exposition(hardware_exposition(gpu0=h200))
    checks = G.check_hardware(after, state_hardware(gpu0=h200), smi, {"0"})
    assert [c.ok for c in checks] == [True, True], checks
    assert (
        checks[0].detail == "gpu 0: cc 9.0, PCIe 1/5/5 x16 (smi: cc 9.0, gen max 5, width max 16)"
    )
    # A wrong maximum, a wrong compute capability, a missing series: each fails.
    for wrong in (("9.0", "1", "4", "5", "16"), ("8.0", "1", "5", "5", "16")):
        after = G.parse_exposition(hardware_exposition(gpu0=wrong))
        assert not G.check_hardware(after, state_hardware(gpu0=wrong), smi, {"0"})[0].ok
    empty = G.parse_exposition(hardware_exposition())
    assert [c.ok for c in G.check_hardware(empty, {"gpus": {}}, smi, {"0"})] == [False, False]
    # /v1/state disagreeing with the series fails the second check.
    after = G.parse_exposition(hardware_exposition(gpu0=h200))
    other = state_hardware(gpu0=("9.0", "1", "5", "5", "8"))
    assert [c.ok for c in G.check_hardware(after, other, smi, {"0"})] == [True, False]
    # An old nvidia-smi without the query: the series alone, and said so.
    alone = G.check_hardware(after, state_hardware(gpu0=h200), {}, {"0"})
    assert alone[0].ok and alone[0].detail.endswith("the series checked alone")


def test_summary_counts_failures() -> None:
    text = G.summary([G.Check("a", True, "x"), G.Check("bb", False, "y")])
    assert text.splitlines() == ["PASS  a   x", "FAIL  bb  y", "1 passed, 1 failed"]


def test_shell_script_plan_runs_without_a_gpu() -> None:
    script = ROOT / "benchmarks" / "gpu_check.sh"
    out = subprocess.run(
        ["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "pip install" in out.stdout and "gpu_check.py" in out.stdout


@pytest.mark.parametrize("bad", ["--frobnicate"])
def test_shell_script_refuses_unknown_options(bad: str) -> None:
    script = ROOT / "benchmarks" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script), bad], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
