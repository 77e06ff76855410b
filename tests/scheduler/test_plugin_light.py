"""The plugin needs nothing of the service: `pip install vllm-runbook` (the core
install, what goes into every engine image) is prometheus-client, pydantic
and nvidia-ml-py; the `service`, `top`, `plots` and `dashboards` extras are
not there. In a subprocess where every package those extras install is
unimportable to our code, vLLM's plugin loader loads the plugin, the
scheduler class vLLM picks comes back hooked, a real scheduler (no engine,
as test_hooked_scheduler.py builds it) starts its collector, and the agent
serves its metrics over HTTP.

"Unimportable to our code": vLLM itself imports some of them (fastapi,
starlette, aiohttp, jinja2, psutil, yaml, rich: they are vLLM's own
dependencies), so they cannot be taken from the process. A meta-path finder
refuses them to any importer in `vllm_runbook` the first time they are
looked for, and a wrapper of `__import__` refuses them where vLLM already
loaded them (sys.modules answers before any finder is asked). Both record
every refusal: the plugin must make none.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
# The extras' packages; `rich` comes with Textual (the `top` extra).
EXTRAS = ("service", "top", "plots", "dashboards")
BROUGHT = {"rich"}
# What the brief of the split named; the list read from pyproject must hold them.
NAMED = {
    *("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "apscheduler"),
    *("jinja2", "psutil", "textual", "rich", "aiohttp", "httpx", "yaml"),
}

CODE = r"""
import builtins, importlib.abc, json, logging, os, sys

blocked = frozenset(json.loads(sys.argv[1]))
model_dir = sys.argv[2]
refused = []
_import = builtins.__import__


def ours(name):
    return name == "vllm_runbook" or name.startswith("vllm_runbook.")


def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if level == 0 and name.partition(".")[0] in blocked and ours(importer):
        refused.append(f"{importer} imports {name}")
        raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
    return _import(name, globals, locals, fromlist, level)


class Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in blocked:
            return None
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen importlib")
            or frame.f_code is guarded_import.__code__
            or frame.f_globals.get("__name__", "").startswith("importlib")
        ):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if ours(importer):
            refused.append(f"{importer} finds {name}")
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Unimportable())
builtins.__import__ = guarded_import
if os.environ.get("LIGHT_TEST_CPU_PLATFORM"):  # make compat's GPU wheels (compat/cpu_platform.py)
    import compat.cpu_platform

records = []
handler = logging.Handler(logging.WARNING)
handler.emit = records.append
logging.getLogger("vllm_runbook").addHandler(handler)

import vllm
from vllm.plugins import load_general_plugins

load_general_plugins()
import vllm_runbook.collector.plugin as plugin
from vllm.config.scheduler import SchedulerConfig
from vllm_runbook.collector.hook import RunbookSchedulerMixin

from tests.scheduler.conftest import build_scheduler, make_request, step

cls = SchedulerConfig.get_scheduler_cls(SchedulerConfig.default_factory())
scheduler = build_scheduler(model_dir, hooked=False, scheduler_cls=cls)
collector = scheduler.runbook_collector
scheduler.add_request(make_request("r0", 40, max_tokens=3))
steps = 0
while scheduler.has_unfinished_requests() and steps < 20:
    step(scheduler)
    steps += 1
import urllib.request

with urllib.request.urlopen(collector.server.url + "/metrics", timeout=10) as answer:
    metrics = answer.read().decode()
loaded = sorted(m for m in sys.modules if ours(m))
plugin_refused = list(refused)
# The guard bites: the service's own modules cannot be imported here.
probes = {}
service = ("vllm_runbook.runbooks.store", "vllm_runbook.rules", "vllm_runbook.runbooks.service.app")
for module in service + ("vllm_runbook.runbooks.operate.top.app",):
    try:
        __import__(module)
        probes[module] = "imported"
    except ImportError as error:
        probes[module] = f"ImportError: {error.name}"
enabled, error = collector.enabled, collector.error
scheduler.shutdown()
print(json.dumps({
    "version": vllm.__version__,
    "registered": plugin._registered,
    "hooked": issubclass(cls, RunbookSchedulerMixin),
    "enabled": enabled,
    "error": error,
    "steps": steps,
    "metrics": metrics,
    "refused": plugin_refused,
    "loaded": loaded,
    "probes": probes,
    "messages": [f"{r.levelname} {r.getMessage()}" for r in records],
}))
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(text: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", text)
    assert match, text
    return _canonical(match.group(0))


def service_only_modules() -> set[str]:
    """The import names of every package the extras install and the core does not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_requirement(r) for r in project["dependencies"]}
    wanted = {
        _requirement(r)
        for extra in EXTRAS
        for r in project["optional-dependencies"][extra]
        if _requirement(r) != "vllm-runbook"
    } - core
    modules = {
        module
        for module, dists in packages_distributions().items()
        if not module.startswith("_") and {_canonical(d) for d in dists} & wanted
    }
    return modules | BROUGHT


def test_the_blocked_list_holds_every_service_package() -> None:
    modules = service_only_modules()
    assert modules >= NAMED, NAMED - modules
    assert not modules & {"prometheus_client", "pydantic", "pynvml", "vllm"}


def test_the_plugin_loads_and_exports_without_any_service_package(model_dir: str) -> None:
    blocked = service_only_modules()
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
    env.update(VLLM_RUNBOOK_PORT="0", VLLM_RUNBOOK_TOKEN=secrets.token_urlsafe(32))
    if "compat.cpu_platform" in sys.modules:
        env["LIGHT_TEST_CPU_PLATFORM"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", CODE, json.dumps(sorted(blocked)), model_dir],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["refused"] == [], seen["refused"]
    assert seen["registered"] is True and seen["hooked"] is True
    assert seen["enabled"] is True, seen["error"]
    assert not [m for m in seen["messages"] if m.startswith(("ERROR", "CRITICAL"))]
    # Only the collector was loaded: nothing of the rules, the runbooks or the dashboards.
    assert seen["loaded"] and all(
        m == "vllm_runbook" or m.startswith("vllm_runbook.collector") for m in seen["loaded"]
    ), seen["loaded"]
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(seen["metrics"])
        for s in family.samples
    }
    assert samples["vllm_runbook_collector_up"] == 1.0
    assert samples["vllm_runbook_steps_total"] == seen["steps"] > 0
    # The guard does refuse the service's modules to our code.
    assert all(v.startswith("ImportError: ") for v in seen["probes"].values()), seen["probes"]
