"""`runbook check`'s hardware line, exact texts: the engine's GPUs as the collector
reads them from (a fake) NVML, through /v1/state, against the field reports'
hardware limits (Turing's INT8 tensor cores, PCIe 3.0's 15.75 GB/s)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import AgentState, EngineConfig, Gpus
from vllm_runbook.collector.nvml import NvmlPoller
from vllm_runbook.rules.checklist import CheckResult
from vllm_runbook.rules.config_checks import run_config_checks
from vllm_runbook.rules.hardware_check import check_hardware

from tests.fake_agent import agent_state
from tests.rules.test_rules_config_checks import GPU_CONFIG
from tests.unit.test_collector_units import FakeNvml

PAST = (
    "past the reports' hardware limits (Turing's too few INT8 tensor cores, PCIe 3.0's 15.75 GB/s)"
)
IDLE = "1.0 at the first poll (an idle link slows down)"


@pytest.fixture(autouse=True)
def _every_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def polled(nvml: FakeNvml | None, platform: str = "cuda") -> AgentState:
    """/v1/state of an engine whose collector polled `nvml` once (None: no driver)."""
    registry = CollectorRegistry()
    gauges = {s.name: M.build_gauge(s, registry) for s in M.NVML_METRICS}
    poller = NvmlPoller(nvml, gauges, ("m", "0"))
    poller.init()
    config = {**GPU_CONFIG, "platform": platform}
    if platform == "cpu":
        config |= {"device_name": None, "sm_count": None, "device_reason": "CPU engine: no GPU"}
    return agent_state().model_copy(
        update={"gpus": Gpus(**poller.snapshot()), "config": EngineConfig(**config)}
    )


def line(state: AgentState) -> tuple[str, str, str]:
    r: CheckResult = check_hardware(state)
    assert (r.name, r.limit) == ("hardware", "cc > 7.5, PCIe > 3.0")
    return r.status, r.shown, r.note


def test_ampere_on_pcie_4_passes() -> None:
    state = polled(FakeNvml())  # two A100s on PCIe 4.0 x16, idle links at gen 1
    assert line(state) == ("pass", "8.0 Ampere, PCIe 4.0 x16", f"{PAST}; {IDLE}")
    assert check_hardware(state).value == 8.0
    assert {r.name: r.status for r in run_config_checks(state)}["hardware"] == "pass"


def test_turing_warns_with_what_the_reports_say_it_costs() -> None:
    nvml = FakeNvml()
    nvml.capability = {0: (7, 5), 1: (7, 5)}
    state = polled(nvml)
    assert line(state) == (
        "warn",
        "7.5 Turing, PCIe 4.0 x16",
        "compute capability 7.5 (Turing): the reports' hardware limit, too few INT8 tensor cores",
    )
    assert check_hardware(state).value == 7.5


def test_older_than_turing_warns_and_names_the_gpu() -> None:
    nvml = FakeNvml()
    nvml.capability[1] = (7, 0)  # a V100 beside an A100
    assert line(polled(nvml)) == (
        "warn",
        "gpu0 8.0 Ampere, PCIe 4.0 x16; gpu1 7.0 Volta, PCIe 4.0 x16",
        "gpu1: compute capability 7.0 (Volta), older than Turing (7.5): the reports' hardware "
        "limit, too few INT8 tensor cores",
    )


def test_pcie_3_warns_with_the_reports_bandwidth_and_a_slot_slower_than_the_card() -> None:
    nvml = FakeNvml()
    nvml.pcie_generation_max[1] = 3  # a PCIe 4.0 card in a 3.0 slot
    assert line(polled(nvml)) == (
        "warn",
        "gpu0 8.0 Ampere, PCIe 4.0 x16; gpu1 8.0 Ampere, PCIe 3.0 x16",
        "gpu1: PCIe 3.0 x16: the reports' hardware limit, PCIe 3.0's DMA bandwidth only "
        f"15.75 GB/s; the GPU supports PCIe 4.0, its slot (or the system) holds it to 3.0; {IDLE}",
    )
    # A 3.0 card in a 3.0 slot, running at 3.0: the limit alone.
    nvml = FakeNvml()
    nvml.pcie_generation = nvml.pcie_generation_max = nvml.pcie_generation_gpu_max = {0: 3, 1: 3}
    assert line(polled(nvml)) == (
        "warn",
        "8.0 Ampere, PCIe 3.0 x16",
        "PCIe 3.0 x16: the reports' hardware limit, PCIe 3.0's DMA bandwidth only 15.75 GB/s",
    )


def test_a_failing_nvml_call_leaves_the_line_n_a_with_why() -> None:
    nvml = FakeNvml()
    nvml.not_supported = {"nvmlDeviceGetCudaComputeCapability"}
    state = polled(nvml)
    assert state.gpus.nvml_up  # the poll went on: memory and utilisation are there
    assert line(state) == (
        "n/a",
        "cc n/a, PCIe 4.0 x16",
        "no compute capability (NVML: Not Supported)",
    )
    assert check_hardware(state).value is None
    # No maximum, and an idle link at gen 1: not judged on the idle generation.
    nvml = FakeNvml()
    nvml.not_supported = {"nvmlDeviceGetMaxPcieLinkGeneration"}
    assert line(polled(nvml)) == (
        "n/a",
        "8.0 Ampere, PCIe n/a",
        "no PCIe link maximum (NVML: Not Supported); 1.0 at the first poll, which an idle "
        "link lowers",
    )
    # A warning still warns beside a field NVML did not give, which it names.
    nvml.capability = {0: (7, 5), 1: (7, 5)}
    status, _, note = line(polled(nvml))
    assert status == "warn"
    assert note.endswith(
        "; no PCIe link maximum (NVML: Not Supported); 1.0 at the first poll, which an idle "
        "link lowers"
    )


def test_on_the_cpu_and_without_a_gpu_the_line_is_n_a_with_why() -> None:
    assert line(polled(FakeNvml(), platform="cpu")) == (
        "n/a",
        "n/a",
        "CPU engine: no GPU, no compute capability or PCIe link to judge",
    )
    assert line(polled(None)) == (
        "n/a",
        "n/a",
        "no NVIDIA GPU on the engine's machine (nvml_up 0): no compute capability or PCIe "
        "link to read",
    )
    older = polled(FakeNvml())
    older = older.model_copy(update={"gpus": older.gpus.model_copy(update={"hardware": {}})})
    assert line(older) == (
        "n/a",
        "n/a",
        "the agent reports no GPU hardware (an agent older than this check)",
    )
