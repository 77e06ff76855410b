"""vLLM loads the plugin through its entry point and the plugin hooks the
scheduler class vLLM picks; a vLLM the matrix recorded green for loads it
without the out-of-range warning. `make compat` runs this in every version's
environment."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_runbook.collector.vllm_support import load_matrix

CODE = """
import json, logging, vllm
from vllm.plugins import load_general_plugins
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("vllm_runbook.collector").addHandler(handler)
load_general_plugins()
import vllm_runbook.collector.plugin as plugin
from vllm.config.scheduler import SchedulerConfig
from vllm_runbook.collector.hook import RunbookSchedulerMixin
from vllm_runbook.collector.settings import check_vllm_version
cls = SchedulerConfig.get_scheduler_cls(SchedulerConfig.default_factory())
print(json.dumps({
    "version": vllm.__version__,
    "registered": plugin._registered,
    "hooked": issubclass(cls, RunbookSchedulerMixin),
    "base": cls.__bases__[-1].__name__,
    "messages": [r.getMessage() for r in records],
}))
"""


def load() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_the_plugin_and_it_hooks_the_scheduler() -> None:
    seen = load()
    assert seen["registered"] is True
    assert seen["hooked"] is True and seen["base"] == "Scheduler"
    recorded = {v["vllm"]: v["green"] for v in load_matrix()["versions"]}
    if recorded.get(seen["version"]):
        # A version the last matrix run was green for: no warning at all.
        assert seen["messages"] == []
    else:
        assert len(seen["messages"]) == 1
        assert "outside the tested range" in seen["messages"][0]
