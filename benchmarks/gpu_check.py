"""The prepared GPU check: what only a CUDA machine can show.

Serves a tiny random-weight model with the plugin (`vllm serve`, its own
defaults: async scheduling, cudagraphs) plus `--cudagraph-metrics`, sends a
known workload and checks:

1. async path: the scheduler vLLM picked is our hook mixed into its
   AsyncScheduler, the collector is up, every schedule() was timed, and the
   tokens it scheduled are exactly the workload's (Σ prompt + Σ (max_tokens − 1));
2. cudagraph padding: the collector's padded/unpadded token counters (from
   `cudagraph_stats`) equal the totals of vLLM's own CUDAGraph tables in the
   server log, and the predicted padding (used without `--cudagraph-metrics`)
   equals vLLM's padding for every row it logged;
3. NVML: `nvml_up` 1, one series per visible GPU, memory used within 5 % of
   nvidia-smi's and ≤ total, utilisation and the memory controller's (DRAM)
   utilisation in [0, 1], the window's peak memory at least the memory in use;
   one `gpu_hardware_info` series per GPU, the same as /v1/state's
   `gpus.hardware`, its compute capability and PCIe link maximum nvidia-smi's,
   the link's generation now and width within what nvidia-smi says they reach.

Prints one line per check and a summary; exits 1 when a check failed, 2 when
the server did not come up. Run it through gpu_check.sh (which installs
vLLM into a fresh virtualenv), or directly where vLLM and this package are
installed:

    python benchmarks/gpu_check.py --workdir /tmp/gpu-check
    python benchmarks/gpu_check.py --self-test     # the parsers, no GPU needed
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm_runbook_"
MEMORY_TOLERANCE = 0.05
# (prompt tokens, max_tokens) per request: odd sizes so batches fall between
# cudagraph capture sizes and get padded.
WORKLOAD = [(13 + 7 * i, 9 + (i % 5)) for i in range(24)]


# -- parsing (unit-tested without a GPU) ------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_exposition(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by (name, sorted labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {ls: v for (n, ls), v in samples.items() if n == name}


@dataclass
class CudagraphLog:
    """vLLM's own CUDAGraph statistics, from the server log (--cudagraph-metrics)."""

    capture_sizes: list[int] = field(default_factory=list)
    mode: str = ""
    # (unpadded, padded, paddings, runtime mode, count) per logged row
    rows: list[tuple[int, int, int, str, int]] = field(default_factory=list)

    @property
    def unpadded(self) -> int:
        return sum(u * c for u, _, _, _, c in self.rows)

    @property
    def padded(self) -> int:
        return sum(p * c for _, p, _, _, c in self.rows)


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\w+)\s*\|\s*(\d+)\s*\|\s*$")
_SIZES = re.compile(r"- Capture sizes: \[([\d,\s]*)\]")
_MODE = re.compile(r"- Mode: (\S+)")


def parse_cudagraph_log(text: str) -> CudagraphLog:
    """Every table CUDAGraphLogging wrote (each covers one log interval)."""
    log = CudagraphLog()
    for line in text.splitlines():
        if m := _SIZES.search(line):
            log.capture_sizes = sorted(int(x) for x in m.group(1).split(",") if x.strip())
        elif m := _MODE.search(line):
            log.mode = m.group(1)
        elif m := _ROW.match(line.strip()):
            u, p, n, mode, count = m.groups()
            log.rows.append((int(u), int(p), int(n), mode, int(count)))
    return log


def predicted_padded(num_tokens: int, capture_sizes: list[int]) -> int:
    """The collector's prediction (collector/step_stats.py), repeated here so the
    check also runs against an installed copy of any version."""
    if not capture_sizes or num_tokens > capture_sizes[-1] or num_tokens <= 0:
        return num_tokens
    return capture_sizes[bisect.bisect_left(capture_sizes, num_tokens)]


def parse_nvidia_smi(text: str) -> dict[str, tuple[float, float]]:
    """`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`
    → {index: (used bytes, total bytes)}."""
    out = {}
    for line in text.strip().splitlines():
        index, used, total_mib = (x.strip() for x in line.split(","))
        out[index] = (float(used) * 2**20, float(total_mib) * 2**20)
    return out


# nvidia-smi's names for what the collector reads once per GPU (`gpu_hardware_info`).
SMI_HARDWARE_QUERY = "index,compute_cap,pcie.link.gen.max,pcie.link.width.max"
HARDWARE_LABELS = (
    "compute_capability",
    "pcie_link_generation",
    "pcie_link_generation_max",
    "pcie_link_generation_gpu_max",
    "pcie_link_width",
)


def parse_nvidia_smi_hardware(text: str) -> dict[str, tuple[str, int | None, int | None]]:
    """`nvidia-smi --query-gpu=SMI_HARDWARE_QUERY --format=csv,noheader,nounits` →
    {index: (compute capability, PCIe link generation max, width max)}; None where
    nvidia-smi says [N/A]."""

    def number(x: str) -> int | None:
        return int(x) if x.isdigit() else None

    out = {}
    for line in text.strip().splitlines():
        index, cap, gen_max, width_max = (x.strip() for x in line.split(","))
        out[index] = (cap, number(gen_max), number(width_max))
    return out


# -- checks ------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_async(state: dict[str, Any], before: Samples, after: Samples) -> list[Check]:
    engine = state["engine"]
    cls = engine.get("scheduler_class", "?")
    steps = total(after, PREFIX + "steps_total") - total(before, PREFIX + "steps_total")
    timed = total(after, PREFIX + "schedule_seconds_count") - total(
        before, PREFIX + "schedule_seconds_count"
    )
    scheduled = total(after, PREFIX + "scheduled_tokens_total") - total(
        before, PREFIX + "scheduled_tokens_total"
    )
    expected = sum(p + m - 1 for p, m in WORKLOAD)
    return [
        Check("async: scheduler class", cls == "RunbookAsyncScheduler", f"{cls}"),
        Check("async: collector up", bool(state["collector_up"]), f"{state['collector_up']}"),
        Check(
            "async: every schedule() timed",
            steps > 0 and timed == steps,
            f"{timed:.0f} timed of {steps:.0f} steps",
        ),
        Check(
            "async: scheduled tokens = workload",
            scheduled == expected,
            f"{scheduled:.0f} scheduled, workload {expected}",
        ),
    ]


def check_padding(before: Samples, after: Samples, log: CudagraphLog) -> list[Check]:
    padded = total(after, PREFIX + "padded_tokens_total") - total(
        before, PREFIX + "padded_tokens_total"
    )
    unpadded = total(after, PREFIX + "unpadded_tokens_total") - total(
        before, PREFIX + "unpadded_tokens_total"
    )
    wrong = [
        (u, p, mode)
        for u, p, _, mode, _ in log.rows
        if mode != "NONE" and predicted_padded(u, log.capture_sizes) != p
    ]
    padded_rows = sum(c for u, p, _, _, c in log.rows if p > u)
    return [
        Check(
            "padding: vLLM logged cudagraph stats",
            bool(log.rows) and padded_rows > 0,
            f"{len(log.rows)} rows, {padded_rows} padded batches, capture sizes "
            f"{log.capture_sizes[:6]}{'…' if len(log.capture_sizes) > 6 else ''}",
        ),
        Check(
            "padding: collector = vLLM's counters",
            (padded, unpadded) == (log.padded, log.unpadded),
            f"collector padded/unpadded {padded:.0f}/{unpadded:.0f}, "
            f"vLLM {log.padded}/{log.unpadded}",
        ),
        Check(
            "padding: prediction = vLLM's padding",
            not wrong,
            "every row" if not wrong else f"differs for (unpadded, padded, mode) {wrong[:3]}",
        ),
    ]


def check_nvml(after: Samples, smi: dict[str, tuple[float, float]]) -> list[Check]:
    up = total(after, PREFIX + "nvml_up")
    used = {
        dict(ls).get("gpu"): v for ls, v in series(after, PREFIX + "gpu_memory_used_bytes").items()
    }
    totals = {
        dict(ls).get("gpu"): v for ls, v in series(after, PREFIX + "gpu_memory_total_bytes").items()
    }
    util = series(after, PREFIX + "gpu_utilization_ratio")
    dram = series(after, PREFIX + "gpu_dram_utilization_ratio")
    peak = {
        dict(ls).get("gpu"): v
        for ls, v in series(after, PREFIX + "gpu_memory_used_peak_bytes").items()
    }
    memory_ok, notes = bool(used), []
    for gpu, (smi_used, smi_total) in smi.items():
        mine = used.get(gpu)
        if mine is None or totals.get(gpu) is None:
            memory_ok = False
            notes.append(f"gpu {gpu}: no series")
            continue
        close = abs(mine - smi_used) <= MEMORY_TOLERANCE * smi_total
        memory_ok &= close and mine <= totals[gpu] and abs(totals[gpu] - smi_total) < 2**21
        notes.append(f"gpu {gpu}: {mine / 2**30:.2f}/{smi_used / 2**30:.2f} GiB (ours/smi)")
    return [
        Check("nvml: up", up == 1, f"nvml_up {up:g}"),
        Check(
            "nvml: one series per GPU", set(used) == set(smi), f"{sorted(used)} vs {sorted(smi)}"
        ),
        Check("nvml: memory matches nvidia-smi", memory_ok, "; ".join(notes)),
        Check(
            "nvml: utilisation in [0, 1]",
            bool(util) and all(0 <= v <= 1 for v in util.values()),
            f"{sorted(util.values())}",
        ),
        Check(
            "nvml: DRAM busy in [0, 1], peak >= in use",
            bool(dram)
            and all(0 <= v <= 1 for v in dram.values())
            and set(peak) == set(used)
            and all(peak[g] >= v for g, v in used.items()),
            f"dram {sorted(dram.values())}; peak {sorted(peak.values())}",
        ),
    ]


def check_hardware(
    after: Samples,
    state: dict[str, Any],
    smi: dict[str, tuple[str, int | None, int | None]],
    gpus: set[str],
) -> list[Check]:
    """The hardware read once per GPU: the series, /v1/state and nvidia-smi agree.
    `smi` is empty where nvidia-smi does not know the query (an old driver)."""
    info = {
        labels["gpu"]: {k: labels.get(k, "") for k in HARDWARE_LABELS}
        for labels in (dict(ls) for ls in series(after, PREFIX + "gpu_hardware_info"))
    }
    wire = {
        gpu: {k: "" if hw.get(k) is None else str(hw[k]) for k in HARDWARE_LABELS}
        for gpu, hw in state.get("gpus", {}).get("hardware", {}).items()
    }
    agree, notes = bool(info) and set(info) == gpus, []
    for gpu in sorted(info):
        hw = info[gpu]
        notes.append(
            f"gpu {gpu}: cc {hw['compute_capability'] or '?'}, PCIe "
            f"{hw['pcie_link_generation'] or '?'}/{hw['pcie_link_generation_max'] or '?'}"
            f"/{hw['pcie_link_generation_gpu_max'] or '?'} x{hw['pcie_link_width'] or '?'}"
        )
        if gpu not in smi:
            agree &= bool(hw["compute_capability"])
            continue
        cap, gen_max, width_max = smi[gpu]
        mine = {k: int(v) if v.isdigit() else None for k, v in hw.items()}
        now, most, gpu_most, width = (
            mine["pcie_link_generation"],
            mine["pcie_link_generation_max"],
            mine["pcie_link_generation_gpu_max"],
            mine["pcie_link_width"],
        )
        agree &= hw["compute_capability"] == cap
        agree &= gen_max is None or (most == gen_max and now is not None and 1 <= now <= most)
        agree &= gpu_most is None or most is None or gpu_most >= most
        agree &= width_max is None or (width is not None and 1 <= width <= width_max)
        notes[-1] += f" (smi: cc {cap}, gen max {gen_max}, width max {width_max})"
    if not smi:
        notes.append("nvidia-smi gave no hardware fields: the series checked alone")
    return [
        Check("nvml: hardware per GPU = nvidia-smi", agree, "; ".join(notes) or "no series"),
        Check(
            "nvml: hardware in /v1/state = the series",
            bool(wire) and wire == info,
            "same" if wire == info else f"state {wire} vs series {info}",
        ),
    ]


def summary(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


# -- the run on a GPU ------------------------------------------------------------------


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait(url: str, deadline_s: float, proc: subprocess.Popen[bytes]) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            _get(url, timeout=2)
            return True
        time.sleep(1)
    return False


@contextlib.contextmanager
def served(model: Path, log_path: Path, api_port: int, agent_port: int) -> Iterator[Any]:
    env = {
        **os.environ,
        "VLLM_RUNBOOK_PORT": str(agent_port),
        "VLLM_LOG_STATS_INTERVAL": "1",  # flush the CUDAGraph tables every second
    }
    cmd = [
        "vllm", "serve", str(model), "--port", str(api_port), "--host", "127.0.0.1",
        "--cudagraph-metrics", "--max-model-len", "1024", "--max-num-seqs", "32",
        "--gpu-memory-utilization", "0.3", "--enable-prefix-caching",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_on_gpu(workdir: Path) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from vllm_runbook.collector.tiny_model import create_tiny_model, prompt_token_ids

    workdir.mkdir(parents=True, exist_ok=True)
    model = create_tiny_model(workdir / "tiny-llama")
    log_path = workdir / "vllm-serve.log"
    api, agent = 18000, 19360
    with served(model, log_path, api, agent) as proc:
        if not _wait(f"http://127.0.0.1:{api}/health", 420, proc):
            sys.stdout.write(log_path.read_text(errors="replace")[-4000:])
            print("FAIL  the server did not come up (log tail above)")
            return 2
        agent_url = f"http://127.0.0.1:{agent}"
        before = parse_exposition(_get(agent_url + "/metrics"))
        model_id = json.loads(_get(f"http://127.0.0.1:{api}/v1/models"))["data"][0]["id"]

        def complete(i: int) -> None:
            prompt, max_tokens = WORKLOAD[i]
            _post_json(
                f"http://127.0.0.1:{api}/v1/completions",
                {
                    "model": model_id,
                    # distinct first tokens: no prefix-cache hit shrinks the work
                    "prompt": prompt_token_ids(prompt, offset=41 * i),
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(complete, range(len(WORKLOAD))))
        time.sleep(3)  # a few stats intervals: the last CUDAGraph table is logged
        time.sleep(6)  # NVML polls (every 1 s) after the load: both read the same memory
        after = parse_exposition(_get(agent_url + "/metrics"))
        state = json.loads(_get(agent_url + "/v1/state"))
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        smi_hardware = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_HARDWARE_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    gpus = parse_nvidia_smi(smi.stdout) if smi.returncode == 0 else {}
    hardware = (
        parse_nvidia_smi_hardware(smi_hardware.stdout) if smi_hardware.returncode == 0 else {}
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # nvidia-smi lists every GPU; the engine sees these
        gpus = {i: v for i, v in gpus.items() if i in visible.split(",")}
        hardware = {i: v for i, v in hardware.items() if i in visible.split(",")}
    checks = [
        *check_async(state, before, after),
        *check_padding(before, after, parse_cudagraph_log(log_path.read_text(errors="replace"))),
        *check_nvml(after, gpus),
        *check_hardware(after, state, hardware, set(gpus)),
    ]
    print(summary(checks))
    return 0 if all(c.ok for c in checks) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vllm-runbook-gpu-check"))
    parser.add_argument(
        "--self-test", action="store_true", help="check the parsers on recorded text; no GPU"
    )
    args = parser.parse_args(argv)
    if args.self_test:
        import pytest

        test = Path(__file__).resolve().parents[1] / "tests" / "unit" / "test_gpu_check.py"
        return int(pytest.main(["-q", "-p", "no:cacheprovider", str(test)]))
    return run_on_gpu(args.workdir)


if __name__ == "__main__":
    sys.exit(main())
