"""pytest plugin: vLLM's GPU wheel, imported on a CPU for its scheduler only
(`-p compat.cpu_platform`, both suites of the GPU wheel in `make compat`).

From vLLM 0.34 the CPU platform refuses every configuration on an x86 CPU
without Triton's CPU backend ("vLLM on x86 CPUs requires Triton
(triton-cpu)", `CpuPlatform.check_and_update_config`): its model runner
compiles Triton kernels. The GPU wheel does not ship triton-cpu, and the
scheduler tests never run a model: no kernel, Triton's or another, is
called. So, where the platform would refuse for that reason alone, this
plugin tells it Triton is there (`vllm.triton_utils.HAS_TRITON`, read by
the check at each call) and says so in the report header. Nothing else of
vLLM is changed; a vLLM that does not read the flag is left alone.
"""

from __future__ import annotations

from typing import Any

_patched = False


def _install() -> None:
    global _patched
    try:
        import vllm.triton_utils as triton_utils
        from vllm.platforms import current_platform
    except Exception:
        return
    if not current_platform.is_cpu() or getattr(triton_utils, "HAS_TRITON", True):
        return
    triton_utils.HAS_TRITON = True
    _patched = True


_install()


def pytest_report_header(config: Any) -> str:
    if _patched:
        return (
            "vllm-runbook compat: no triton-cpu in the GPU wheel; "
            "the CPU platform told it is there (scheduler only)"
        )
    return "vllm-runbook compat: the CPU platform left as it is"
