"""`runbook demo`: an engine in trouble, detected, fixed and reverted, live on one machine.

Creates a random-weight tiny Llama, starts vLLM's OpenAI server on the CPU
with the collector plugin (small KV cache, scheduling policy `priority`) and
`runbook serve` on SQLite with its embedded evaluator and automation `auto`
for oom-pressure and latency-spike, then drives five phases of traffic:

  steady       mixed-length requests sharing a system prompt
  long-burst   long prompts that overfill the KV cache: preemptions
               → VllmOOMPressure → oom-pressure halves the budget, caps max_num_seqs
  settle       light traffic while oom-pressure's finding resolves and is reverted
  starvation   low-priority requests stuck behind a stream of high-priority ones
               → VllmRequestStarvation → latency-spike switches the policy to FCFS
  recovery     light traffic; the findings resolve and the service reverts

It prints one line of signals per second and every event of the service as
it happens (from its /api/incidents and /api/executions), then a summary
table and a timeline picture. Exits 1 when the story did not happen (no
detection, no action, no recovery), 2 when it could not start. Every process
it starts is stopped on the way out, also on Ctrl-C.

The demo's rule overrides and runbook timings (seconds instead of minutes)
are in the files it writes to the demo directory; see DEMO.md in
vllm_runbook.runbooks (package data). It needs the installed package and vLLM, no source checkout.

The package, by job: config (settings, the files it writes), traffic (the
clients), live (the event feed and the per-second monitor), story (the
processes and the phases), summary (the verdict); the server processes are
vllm_runbook.runbooks.processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DESCRIPTION = __doc__.splitlines()[0].removeprefix("`runbook demo`: ")


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (CI cancelling, `timeout`) unwinds like Ctrl-C: every process is stopped."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_subcommands(subparsers: Any) -> None:
    """`runbook demo [--ci] [--dir DIR]`."""
    p = subparsers.add_parser("demo", help=DESCRIPTION, description=DESCRIPTION)
    p.add_argument(
        "--ci",
        action="store_true",
        help="plain output (also when CI=true or stdout is not a terminal)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("RUNBOOK_DEMO_DIR", ".demo")),
        help="working directory: model, database, logs, picture (default .demo)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """0 the story happened, 1 it did not, 2 it could not start, 130 interrupted."""
    # The story's modules (httpx, asyncio, matplotlib later) load only when it runs.
    from vllm_runbook.runbooks.demo.story import DemoFailed, run

    ci = args.ci or os.environ.get("CI", "").lower() in ("1", "true") or not sys.stdout.isatty()
    try:
        with _terminate_as_interrupt():
            return run(args.dir, ci)
    except KeyboardInterrupt:
        print("\ndemo: interrupted; every process it started is stopped", flush=True)
        return 130
    except DemoFailed as exc:
        print(f"demo: could not start: {exc}", flush=True)
        return 2
