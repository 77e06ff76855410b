"""A fake execution that stops at a named point and waits to be SIGKILLed.

Run as `python -m tests.journal.crash_worker URL POINT`; prints
`at POINT <execution id>` once the journal holds everything up to POINT.
It does what the executor will do, in the same order, against the real store.
"""

from __future__ import annotations

import sys
import time

from vllm_runbook.runbooks.store import Journal

POINTS = ("created", "running", "applying", "applied", "verifying")


def main(url: str, stop_at: str) -> None:
    store = Journal(url)
    record, _ = store.create_execution("oom-pressure", "llama-0", trigger="cli", who="crash")

    def reached(point: str) -> None:
        if point == stop_at:
            print(f"at {point} {record.id}", flush=True)
            time.sleep(3600)

    reached("created")
    store.transition(record.id, "running")
    reached("running")
    step = store.add_step(
        record.id,
        "scale_max_num_batched_tokens",
        {"factor": 0.5},
        before={"max_num_batched_tokens": 512},
    )
    reached("applying")  # the engine may or may not have taken the change
    store.finish_step(step.id, "applied", after={"max_num_batched_tokens": 256})
    reached("applied")
    store.transition(record.id, "verifying")
    reached("verifying")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
