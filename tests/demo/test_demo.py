"""`runbook demo` (`make demo`) as CI runs it: the whole story on a real CPU
engine and a real `runbook serve`, ending by itself with exit 0 and a timeline
picture. It runs from a directory of its own, not the checkout."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.engines import runbook_cli_command

pytestmark = [pytest.mark.engine, pytest.mark.service]

# What the terminal must show, in this order (the service's events as they happen).
STORY = [
    r"── steady:",
    r"── long-burst:",
    r"finding VllmOOMPressure fired on cpu-0",
    r"runbook oom-pressure chosen for VllmOOMPressure \(automation auto\) → execution #(\d+)",
    r"#\d+ checks: max_sequence_tokens .*kv_usage .*preemption_rate",
    r"#\d+ action scale_max_num_batched_tokens: before max_num_batched_tokens=512",
    r"#\d+ action scale_max_num_batched_tokens: after max_num_batched_tokens=256",
    r"#\d+ verification: preemptions_per_minute .* \(improved\)",
    r"── starvation:",
    r"finding VllmRequestStarvation fired on cpu-0",
    r"runbook latency-spike chosen for VllmRequestStarvation \(automation auto\) → execution #\d+",
    r"#\d+ action set_policy: before policy=priority",
    r"#\d+ action set_policy: after policy=fcfs",
    # Judged on the requests starving at the switch (the 8 low-priority ones at most).
    r"#\d+ verification: starving_waiting [1-8] → 0 .*\(improved\)",
    # The stream outlasts the switch: its finding resolves, its cause holds.
    r"#\d+ holding: ",
    r"stream after the switch: \d+ s; #\d+ held for \d+ s .*the policy stayed fcfs at every",
    r"── recovery:",
    r"summary",
    r"timeline picture: ",
    r"demo: ok",
]


@pytest.mark.timeout(1000)
def test_demo_story_detects_fixes_and_reverts(tmp_path: Path) -> None:
    # The test session's conftest makes vLLM run in-process and sets the
    # agent's port and token directory: the demo chooses its own.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "RUNBOOK_")) or k == "VLLM_CPU_KVCACHE_SPACE"
    }
    env.update(CI="true")
    directory = tmp_path / "demo"
    proc = subprocess.run(
        runbook_cli_command("demo", "--dir", str(directory)),
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]

    position = 0
    for pattern in STORY:
        match = re.compile(pattern).search(out, position)
        assert match, f"not found after position {position}: {pattern}\n{out[-6000:]}"
        position = match.end()
    # Both changes were reverted when their findings resolved.
    for runbook in ("oom-pressure", "latency-spike"):
        assert re.search(rf"#\d+ {runbook} on .*: reverted", out), out[-4000:]
    assert re.search(r"revert #\d+ of #\d+: .*resolved", out)
    assert "finding VllmOOMPressure resolved" in out
    assert "finding VllmRequestStarvation resolved" in out
    # After the stream ended, the cause was seen gone before the revert.
    assert "the high-priority stream goes on after the switch" in out
    assert re.search(r"#\d+ holding: the cause is gone \(oldest_waiting < 2\)", out)
    # The switch's revert: once the stream ended (or the engine's queue drained).
    assert re.search(
        r"#\d+ succeeded: execution #\d+ reverted: its alert resolved \d+ s ago and "
        r"oldest_waiting < 2 held for 6 s",
        out,
    )
    # Plain lines for CI: no terminal control sequences.
    assert "\033[" not in out

    (picture,) = re.findall(r"timeline picture: (.+)", out)
    png = Path(picture.strip())
    png = png if png.is_absolute() else tmp_path / png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (directory / "runbook.signals.jsonl").stat().st_size > 0
    # Every process it started is gone: nothing listens on its ports any more.
    ports = re.findall(r"127\.0\.0\.1:(\d+)", (directory / "runbook.yaml").read_text())
    for port in ports:
        with pytest.raises(OSError):
            import socket

            socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
