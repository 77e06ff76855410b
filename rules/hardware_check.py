"""`runbook check`'s hardware line: the engine's GPUs against the field reports'
hardware limits (their "boundary conditions": a Turing GPU's INT8 tensor cores
are too few; PCIe 3.0's DMA bandwidth is only 15.75 GB/s).

It reads /v1/state's `gpus.hardware` (read from NVML once per GPU at the
collector's first poll): a compute capability of 7.5 (Turing) or lower warns, and
so does a PCIe link that reaches generation 3 at most with this GPU and system
(the note says when the GPU itself supports more: a slot slower than the card).
The generation is judged at the link's maximum, not at the first poll's, because
NVML lowers an idle link's generation to save power. A field NVML did not give
leaves the line n/a, with NVML's error; a CPU engine is n/a.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_runbook.collector.agent_api import AgentState, GpuHardware
from vllm_runbook.rules.checklist import CheckResult, Status

NAME, LIMIT = "hardware", "cc > 7.5, PCIe > 3.0"
TURING = (7, 5)
# The reports' figure for PCIe 3.0 (x16, per direction).
PCIE_3_GB_PER_S = 15.75
TURING_COST = "the reports' hardware limit, too few INT8 tensor cores"
PCIE_3_COST = f"the reports' hardware limit, PCIe 3.0's DMA bandwidth only {PCIE_3_GB_PER_S:g} GB/s"
# Architectures by compute capability major (minor where it differs).
_ARCHITECTURES = {5: "Maxwell", 6: "Pascal", 7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell"}
_ARCHITECTURES_BY_VERSION = {(7, 5): "Turing", (8, 9): "Ada", (12, 0): "Blackwell"}


def architecture(capability: tuple[int, int]) -> str | None:
    """NVIDIA's architecture name for a compute capability (None when not known here)."""
    return _ARCHITECTURES_BY_VERSION.get(capability, _ARCHITECTURES.get(capability[0]))


def _capability(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


@dataclass
class _Judged:
    """One GPU's verdict: what it shows, what warns, what could not be judged and why."""

    shown: str
    warnings: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    capability: float | None = None


def _judge_gpu(hw: GpuHardware) -> _Judged:
    judged = _Judged(shown="")
    cc_text = hw.compute_capability
    cc = None if cc_text is None else _capability(cc_text)
    if cc is None:
        why = hw.unread.get("compute_capability", f"unreadable {cc_text!r}")
        judged.missing.append(f"no compute capability (NVML: {why})")
        cc_shown = "cc n/a"
    else:
        arch = architecture(cc)
        named = f"{cc[0]}.{cc[1]}" + (f" ({arch})" if arch else "")
        cc_shown = f"{cc[0]}.{cc[1]}" + (f" {arch}" if arch else "")
        judged.capability = float(f"{cc[0]}.{cc[1]}")
        if cc == TURING:
            judged.warnings.append(f"compute capability {named}: {TURING_COST}")
        elif cc < TURING:
            judged.warnings.append(
                f"compute capability {named}, older than Turing (7.5): {TURING_COST}"
            )
    width = "" if hw.pcie_link_width is None else f" x{hw.pcie_link_width}"
    now, most, gpu_most = (
        hw.pcie_link_generation,
        hw.pcie_link_generation_max,
        hw.pcie_link_generation_gpu_max,
    )
    if most is None and now is not None and now > 3:
        most = now  # the link ran faster than 3.0: its maximum is at least that
    if most is None:
        label = "pcie_link_generation_max" if now is not None else "pcie_link_generation"
        why = hw.unread.get(label, "not reported")
        judged.missing.append(
            f"no PCIe link maximum (NVML: {why}); {now}.0 at the first poll, which an idle "
            "link lowers"
            if now is not None
            else f"no PCIe link generation (NVML: {why})"
        )
        judged.shown = f"{cc_shown}, PCIe n/a"
        return judged
    judged.shown = f"{cc_shown}, PCIe {most}.0{width}"
    slot = (
        f"the GPU supports PCIe {gpu_most}.0, its slot (or the system) holds it to {most}.0"
        if gpu_most is not None and gpu_most > most
        else ""
    )
    idle = (
        f"{now}.0 at the first poll (an idle link slows down)"
        if now is not None and now < most
        else ""
    )
    if most <= 3:
        slower = "" if most == 3 else ", slower than 3.0"
        judged.warnings.append(
            "; ".join(filter(None, [f"PCIe {most}.0{width}{slower}: {PCIE_3_COST}", slot, idle]))
        )
    else:
        judged.notes.extend(filter(None, [slot, idle]))
    return judged


def _merge(by_gpu: Sequence[tuple[str, list[str]]], every: int) -> list[str]:
    """Each text once, prefixed with its GPUs unless every GPU has it."""
    gpus_of: dict[str, list[str]] = {}
    for gpu, texts in by_gpu:
        for text in texts:
            gpus_of.setdefault(text, []).append(gpu)
    return [
        text if len(gpus) == every else f"{', '.join('gpu' + g for g in gpus)}: {text}"
        for text, gpus in gpus_of.items()
    ]


def check_hardware(state: AgentState) -> CheckResult:
    config, gpus = state.config, state.gpus
    if config is not None and config.platform == "cpu":
        return CheckResult(
            NAME, LIMIT, "n/a", None, "n/a",
            "CPU engine: no GPU, no compute capability or PCIe link to judge",
        )  # fmt: skip
    if not gpus.nvml_up:
        return CheckResult(
            NAME, LIMIT, "n/a", None, "n/a",
            "no NVIDIA GPU on the engine's machine (nvml_up 0): no compute capability or "
            "PCIe link to read",
        )  # fmt: skip
    if not gpus.hardware:
        why = (
            "the agent reports no GPU hardware (an agent older than this check)"
            if gpus.per_gpu
            else "NVML is up but reports no GPU"
        )
        return CheckResult(NAME, LIMIT, "n/a", None, "n/a", why)
    judged = {gpu: _judge_gpu(hw) for gpu, hw in sorted(gpus.hardware.items())}
    shown_texts = {j.shown for j in judged.values()}
    if len(shown_texts) == 1:
        shown = shown_texts.pop()
    else:
        shown = "; ".join(f"gpu{gpu} {j.shown}" for gpu, j in judged.items())
    every = len(judged)
    warnings = _merge([(g, j.warnings) for g, j in judged.items()], every)
    missing = _merge([(g, j.missing) for g, j in judged.items()], every)
    notes = _merge([(g, j.notes) for g, j in judged.items()], every)
    read = [j.capability for j in judged.values() if j.capability is not None]
    value = min(read) if read else None
    status: Status
    if warnings:
        status, texts = "warn", [*warnings, *missing]
    elif missing:
        status, texts = "n/a", missing
    else:
        status = "pass"
        texts = [
            "past the reports' hardware limits (Turing's too few INT8 tensor cores, "
            f"PCIe 3.0's {PCIE_3_GB_PER_S:g} GB/s)",
            *notes,
        ]
    return CheckResult(NAME, LIMIT, status, value, shown, "; ".join(texts))
