"""GPU memory and utilisation per GPU from NVML (pynvml, from nvidia-ml-py).

Every poll (VLLM_RUNBOOK_NVML_INTERVAL, default 1 s, the field reports'
`nvidia-smi -l 1`) reads, per GPU, the memory in use and in total and
nvmlDeviceGetUtilizationRates: compute (`.gpu`) and memory-controller
(`.memory`, the DRAM busy share) utilisation. The highest memory in use over
the window's polls is a gauge of its own, so a peak shorter than the
Prometheus scrape interval is still seen (benchmarks/collector_overhead.py
--nvml measures what a poll costs the engine's process).

At the first poll of each GPU it also reads, once, what does not change while
the engine runs: the CUDA compute capability and the PCIe link (generation now,
the most the link reaches with this GPU and system, the most the GPU supports,
its width), exported as one `vllm_runbook_gpu_hardware_info` series per GPU and
in /v1/state's `gpus.hardware`, where `runbook check`'s hardware line reads
them. Each of those calls may fail on some devices (MIG, virtual GPUs, old
drivers): the field is then missing, with NVML's error, and the poll goes on.

Where there is no NVIDIA driver the poller sets `vllm_runbook_nvml_up 0` and
exports no GPU series: absence is not an error. The NVML module is passed in,
so tests use a fake.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from vllm_runbook.collector import metrics as M

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_INTERVAL = 1.0  # seconds between polls (VLLM_RUNBOOK_NVML_INTERVAL)


def load_pynvml() -> ModuleType | None:
    try:
        import pynvml

        return pynvml
    except Exception:  # not installed, or a broken install: no GPU series
        return None


def visible_gpu_indices(device_count: int, env: str | None) -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES)."""
    if env is None or env.strip() == "":
        return list(range(device_count)) if env is None else []
    indices = []
    for item in env.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < device_count:
            indices.append(int(item))
        # UUIDs/MIG names: NVML can resolve them, done in NvmlPoller.
    return indices


def _compute_capability(nvml: Any, handle: Any) -> str:
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return f"{int(major)}.{int(minor)}"


# The NVML call behind each hardware field (metrics.GPU_HARDWARE_LABELS, in order).
_HARDWARE_READS: dict[str, Callable[[Any, Any], str | int]] = {
    "compute_capability": _compute_capability,
    "pcie_link_generation": lambda nvml, h: int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
    "pcie_link_generation_max": lambda nvml, h: int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
    "pcie_link_generation_gpu_max": lambda nvml, h: int(
        nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)
    ),
    "pcie_link_width": lambda nvml, h: int(nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
}


def read_gpu_hardware(nvml: Any, handle: Any) -> dict[str, Any]:
    """One GPU's hardware fields (agent_api.GpuHardware), each read on its own: a call
    that fails leaves its field None and says why in `unread`; nothing raises."""
    fields: dict[str, Any] = {}
    unread: dict[str, str] = {}
    for label, read in _HARDWARE_READS.items():
        try:
            fields[label] = read(nvml, handle)
        except Exception as exc:  # not supported on this device, or no such call
            fields[label] = None
            unread[label] = str(exc) or type(exc).__name__
    return {**fields, "unread": unread}


@dataclass
class _GpuSeries:
    """One GPU's labelled gauges, looked up once (a poll only sets them: a label
    lookup costs several times a set), and the memory in use at the window's polls."""

    used: Gauge
    total: Gauge
    utilization: Gauge
    dram_utilization: Gauge
    used_peak: Gauge
    # (poll time, used) of the window's polls that no later poll matched or exceeded:
    # decreasing, so the first is the window's highest (a sliding-window maximum).
    polls: deque[tuple[float, float]] = field(default_factory=deque)

    def peak(self, now: float, used: float, window_seconds: float) -> float:
        """The highest memory in use over the window's polls, this one included."""
        polls = self.polls
        while polls and polls[-1][1] <= used:
            polls.pop()
        polls.append((now, used))
        while polls[0][0] < now - window_seconds:
            polls.popleft()
        return polls[0][1]


class NvmlPoller:
    """Polls NVML on a daemon thread every `interval` seconds into gauges
    (`gauges`: metrics.NVML_METRICS by name)."""

    def __init__(
        self,
        nvml: Any,
        gauges: Mapping[str, Gauge],
        base_labels: tuple[str, str],
        interval: float = DEFAULT_INTERVAL,
        window_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = nvml
        self.up = gauges[M.NVML_UP.name]
        self.memory_used = gauges[M.GPU_MEMORY_USED.name]
        self.memory_total = gauges[M.GPU_MEMORY_TOTAL.name]
        self.utilization = gauges[M.GPU_UTILIZATION.name]
        self.dram_utilization = gauges[M.GPU_DRAM_UTILIZATION.name]
        self.memory_used_peak = gauges[M.GPU_MEMORY_USED_PEAK.name]
        self.hardware_info = gauges[M.GPU_HARDWARE_INFO.name]
        self.base_labels = base_labels
        self.interval = interval
        self.window_seconds = window_seconds
        self.clock = clock
        self._gpus: dict[str, _GpuSeries] = {}  # by gpu index
        self.handles: list[tuple[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self.is_up = False
        # gpu index -> memory used/total bytes and utilisation at the latest poll.
        self.latest: dict[str, dict[str, float]] = {}
        # gpu index -> its hardware fields, read once at its first poll.
        self.hardware: dict[str, dict[str, Any]] = {}

    @classmethod
    def create(
        cls,
        nvml: Any,
        registry: CollectorRegistry,
        base_labels: tuple[str, str],
        interval: float = DEFAULT_INTERVAL,
        window_seconds: float = 60.0,
    ) -> NvmlPoller:
        """A poller whose gauges (metrics.NVML_METRICS) live in `registry`."""
        gauges = {spec.name: M.build_gauge(spec, registry) for spec in M.NVML_METRICS}
        return cls(nvml, gauges, base_labels, interval, window_seconds)

    def snapshot(self) -> dict[str, Any]:
        """For /v1/state: whether NVML answered, and the per-GPU values."""
        return {
            "nvml_up": self.is_up,
            "per_gpu": dict(self.latest),
            "hardware": dict(self.hardware),
        }

    def init(self) -> bool:
        """Initialise NVML; False (and nvml_up 0) when there is no driver."""
        up = self.up.labels(*self.base_labels)
        if self.nvml is None:
            up.set(0)
            return False
        try:
            self.nvml.nvmlInit()
            count = self.nvml.nvmlDeviceGetCount()
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            handles = []
            for index in visible_gpu_indices(count, env):
                handles.append((str(index), self.nvml.nvmlDeviceGetHandleByIndex(index)))
            if env and not handles:  # UUIDs or MIG names
                for ident in env.split(","):
                    h = self.nvml.nvmlDeviceGetHandleByUUID(ident.strip())
                    handles.append((str(self.nvml.nvmlDeviceGetIndex(h)), h))
            self.handles = handles
        except Exception as exc:
            logger.info("vllm-runbook: NVML unavailable (%s); no GPU metrics", exc)
            up.set(0)
            return False
        return self.poll()

    def poll(self) -> bool:
        up = self.up.labels(*self.base_labels)
        try:
            latest = {}
            now = self.clock()
            for gpu, handle in self.handles:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                util = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                series = self._gpus.get(gpu) or self._gpus.setdefault(
                    gpu, self._series(gpu, handle)
                )
                series.used.set(mem.used)
                series.total.set(mem.total)
                series.utilization.set(util.gpu / 100.0)
                series.dram_utilization.set(util.memory / 100.0)
                series.used_peak.set(series.peak(now, float(mem.used), self.window_seconds))
                latest[gpu] = {
                    "memory_used_bytes": float(mem.used),
                    "memory_total_bytes": float(mem.total),
                    "utilization_ratio": util.gpu / 100.0,
                }
            self.latest = latest
        except Exception as exc:
            if not self._warned:
                logger.warning("vllm-runbook: NVML poll failed (%s); nvml_up=0", exc)
                self._warned = True
            up.set(0)
            self.is_up = False
            return False
        up.set(1)
        self.is_up = bool(self.handles)
        return True

    def _series(self, gpu: str, handle: Any) -> _GpuSeries:
        """The GPU's gauges, at its first poll; its hardware is read then, once."""
        labels = (*self.base_labels, gpu)
        hardware = read_gpu_hardware(self.nvml, handle)
        for label, why in hardware["unread"].items():
            logger.info("vllm-runbook: NVML gave no %s for GPU %s (%s)", label, gpu, why)
        values = tuple(
            "" if hardware[k] is None else str(hardware[k]) for k in M.GPU_HARDWARE_LABELS
        )
        self.hardware_info.labels(*labels, *values).set(1)
        self.hardware[gpu] = hardware
        return _GpuSeries(
            self.memory_used.labels(*labels),
            self.memory_total.labels(*labels),
            self.utilization.labels(*labels),
            self.dram_utilization.labels(*labels),
            self.memory_used_peak.labels(*labels),
        )

    def start(self) -> None:
        if self._thread is None and self.init():
            self._thread = threading.Thread(target=self._run, name="vllm-runbook-nvml", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self._stop.set()

    def device(self) -> tuple[str | None, int | None, str | None]:
        """(name, SM count, why missing) of this engine's first GPU (after init)."""
        if self.nvml is None:
            return None, None, "no NVIDIA driver (pynvml not importable)"
        if not self.handles:
            return None, None, "NVML sees no GPU for this process"
        return gpu_device(self.nvml, self.handles[0][1])


# CUDA cores per SM by compute capability (NVIDIA's CUDA C Programming Guide,
# "Arithmetic Instructions"): NVML reports cores, not SMs.
_CORES_PER_SM = {(6, 0): 64, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64}
_CORES_PER_SM_BY_MAJOR = {6: 128, 8: 128, 9: 128, 10: 128, 12: 128}


def gpu_device(nvml: Any, handle: Any) -> tuple[str | None, int | None, str | None]:
    """(device name, SM count, why a part is missing) of one NVML device."""
    try:
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:
        return None, None, f"NVML gave no device name ({exc})"
    try:
        cores = int(nvml.nvmlDeviceGetNumGpuCores(handle))
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception as exc:
        return name, None, f"NVML gave no core count ({exc})"
    per_sm = _CORES_PER_SM.get((major, minor), _CORES_PER_SM_BY_MAJOR.get(major))
    if per_sm is None:
        return name, None, f"cores per SM unknown for compute capability {major}.{minor}"
    return name, cores // per_sm, None
