"""Records tests/data/storm.om.gz, the history `runbook backtest`'s test replays.

Two real CPU vLLM engines (the tiny model, collector plugin in-process), one
after the other, each scraped every SCRAPE seconds of wall time over its
agent's /metrics for PHASES seconds:

- `cpu-storm`: 32 KV blocks, max_num_seqs 16; light traffic, then STORM
  seconds of 16 long requests kept in flight (they outgrow the cache: vLLM
  preempts), then light traffic again;
- `cpu-healthy`: the default test engine (256 blocks), light traffic only.

Only the series the rule catalog and the runbooks' checks read are kept
(rules/needs.py via store_for_rules, plus the knobs). Timestamps are the
scrapes' wall-clock times, made relative to the first scrape: the test shifts
them to just before its own start. The output is OpenMetrics text, one series'
samples together, as `promtool tsdb create-blocks-from openmetrics` wants it.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python -m tests.data.record_storm

(takes about 9 minutes on 2 cores; recorded once, the file is committed). The
model's name (a temporary path) is kept as its last part, `tiny-llama`.
"""

from __future__ import annotations

import gzip
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SCRAPE = 5.0
LIGHT, STORM = 60.0, 120.0
OUT = Path(__file__).with_name("storm.om.gz")
EXTRA = (
    "vllm_runbook_max_num_seqs",
    "vllm_runbook_max_num_batched_tokens",
    "vllm_runbook_startup_max_num_seqs",
    "vllm_runbook_startup_max_num_batched_tokens",
    "vllm_runbook_kv_blocks_used",
    "vllm_runbook_kv_blocks_free",
    "vllm_runbook_num_requests_running",
    "vllm_runbook_scheduler_policy",
)


def wanted_names() -> set[str]:
    """What `runbook backtest` reads: the rules' series, the checks' and the knobs'."""
    from vllm_runbook.rules.backtest import Replay
    from vllm_runbook.rules.model import load_catalog
    from vllm_runbook.runbooks.engine.operations import engine_registry
    from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks
    from vllm_runbook.runbooks.operate.backtest import Simulator

    runbooks = load_runbooks(None, engine_registry())
    replay = Replay(
        load_catalog().bind({}),
        signals=Simulator.signals(runbooks),
        series=Simulator.extra_series(),
    )
    return set(replay.names) | set(EXTRA)


def scrape(url: str, names: set[str], at: float, out: dict[str, list[tuple[float, str]]]) -> None:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name in names:
            out.setdefault(series, []).append((at, value))


def record(
    model: Path, instance: str, storm: bool, names: set[str], t0: float | None
) -> tuple[float, dict[str, list[tuple[float, str]]]]:
    from tests.engines import InProcessEngine

    overrides = (
        dict(num_gpu_blocks_override=32, max_num_seqs=16, max_model_len=512) if storm else {}
    )
    engine = InProcessEngine.start(model, **overrides)
    samples: dict[str, list[tuple[float, str]]] = {}
    url = engine.collector.server.url
    start = time.time()
    t0 = start if t0 is None else t0
    next_scrape, next_light, n = start, start, 0
    try:
        while (now := time.time()) < start + 2 * LIGHT + STORM:
            if now >= next_scrape:
                scrape(url, names, round(now - t0, 3), samples)
                next_scrape += SCRAPE
            in_storm = storm and start + LIGHT <= now < start + LIGHT + STORM
            if in_storm and engine.engine.get_num_unfinished_requests() < 16:
                engine.add(f"long-{n}", 200, max_tokens=100, offset=20 * n)
                n += 1
            elif not in_storm and now >= next_light:
                engine.add(f"light-{n}", 24, max_tokens=8, offset=7 * n)
                n += 1
                next_light = now + 1.0
            if engine.engine.has_unfinished_requests():
                engine.step()
                time.sleep(0.001)  # the agent's thread answers the scrape
            else:
                time.sleep(0.01)
    finally:
        engine.close()
    return t0, {_with_instance(k, instance): v for k, v in samples.items()}


def _with_instance(series: str, instance: str) -> str:
    # the model's name is its (temporary) path: the file keeps its last part
    series = re.sub(r'model_name="[^"]*/([^"/]+)"', r'model_name="\1"', series)
    if "{" in series:
        name, rest = series.split("{", 1)
        return f'{name}{{instance="{instance}",{rest}'
    return f'{series}{{instance="{instance}"}}'


def main() -> None:
    from vllm_runbook.collector.tiny_model import create_tiny_model

    names = wanted_names()
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny-llama")
        _, storm = record(model, "cpu-storm", True, names, None)
        # the healthy engine's series on the same clock, from the first scrape on
        _, healthy = record(model, "cpu-healthy", False, names, time.time())
    lines = []
    for series in sorted({**storm, **healthy}):
        points = storm.get(series) or healthy[series]
        lines += [f"{series} {value} {at:.3f}" for at, value in points]
    lines.append("# EOF")
    OUT.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    print(f"wrote {OUT}: {len(lines) - 1} samples of {len(storm) + len(healthy)} series")


if __name__ == "__main__":
    main()
