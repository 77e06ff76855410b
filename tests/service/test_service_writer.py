"""The webhook's writer (GroupCommitter) as a job of a scheduler: what queued
together commits together, one bad delivery fails alone, an unavailable store
fails the batch, a cancelled request holds nobody up, and close commits what
is still queued."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog
from vllm_runbook.runbooks.service.alertmanager import WebhookPayload
from vllm_runbook.runbooks.service.jobs import job_scheduler
from vllm_runbook.runbooks.service.webhooks import GroupCommitter, Outcome, Router
from vllm_runbook.runbooks.store import InvalidInput, Journal, StoreUnavailable

from tests.service.test_service_webhooks import CONFIG, payload


class Gate:
    """The store's record_deliveries, held until `open` and counting each
    batch's group keys; a delivery of group "bad" is refused, and the store
    is down while `down` is set."""

    def __init__(self, store: Journal) -> None:
        self.record = store.record_deliveries
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.down = False
        store.record_deliveries = self  # type: ignore[method-assign]

    def __call__(self, deliveries: list[Any]) -> Any:
        self.batches.append([d.group_key for d in deliveries])
        self.entered.set()
        assert self.opened.wait(30)
        if self.down:
            raise StoreUnavailable("store down")
        if any(d.group_key == "bad" for d in deliveries):
            raise InvalidInput("refused")
        return self.record(deliveries)


@pytest.fixture
def writer(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[GroupCommitter, Gate]]:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    config = load_config(cfg)
    router = Router(config.engines, config.automation, {}, frozenset(load_runbook_catalog()))
    store = Journal(sqlite_url)
    committer = GroupCommitter(store, router, max_batch=3)
    gate = Gate(store)
    scheduler: BackgroundScheduler = job_scheduler(1)
    committer.schedule(scheduler)
    scheduler.start()
    try:
        yield committer, gate
    finally:
        gate.opened.set()
        committer.close()
        scheduler.shutdown(wait=False)
        store.close()


def submit(committer: GroupCommitter, group: str, n: int) -> Future[Outcome]:
    raw = payload(fingerprint=f"fp-{n}")
    raw["groupKey"] = group
    return committer.submit(WebhookPayload.model_validate(raw), raw)


def hold_first(committer: GroupCommitter, gate: Gate) -> Future[Outcome]:
    """A first delivery, its commit held: what is submitted next queues behind it."""
    first = submit(committer, "first", 0)
    assert gate.entered.wait(30)
    return first


def test_what_queues_together_commits_together_in_batches(
    writer: tuple[GroupCommitter, Gate],
) -> None:
    committer, gate = writer
    first = hold_first(committer, gate)
    queued = [submit(committer, f"g{n}", n) for n in range(1, 6)]
    gate.opened.set()
    outcomes = [f.result(30) for f in [first, *queued]]
    assert len({o.event_id for o in outcomes}) == 6
    assert gate.batches == [["first"], ["g1", "g2", "g3"], ["g4", "g5"]]  # at most max_batch


def test_a_bad_delivery_fails_alone_and_a_store_down_fails_the_batch(
    writer: tuple[GroupCommitter, Gate],
) -> None:
    committer, gate = writer
    first = hold_first(committer, gate)
    good, bad, other = (submit(committer, g, n) for n, g in enumerate(["a", "bad", "b"], 1))
    gate.opened.set()
    assert first.result(30) and good.result(30) and other.result(30)
    with pytest.raises(InvalidInput):
        bad.result(30)
    # The batch failed, then one at a time.
    assert gate.batches[1:] == [["a", "bad", "b"], ["a"], ["bad"], ["b"]]

    gate.batches.clear()
    gate.opened.clear()
    gate.entered.clear()
    held = hold_first(committer, gate)
    gate.down = True
    down = [submit(committer, g, n) for n, g in enumerate(["c", "d"], 10)]
    gate.opened.set()
    for future in [held, *down]:
        with pytest.raises(StoreUnavailable):
            future.result(30)
    assert gate.batches == [["first"], ["c", "d"]]  # not retried one at a time


def test_a_cancelled_delivery_holds_up_none_of_its_batch(
    writer: tuple[GroupCommitter, Gate],
) -> None:
    committer, gate = writer
    first = hold_first(committer, gate)
    gone, kept = submit(committer, "gone", 1), submit(committer, "kept", 2)
    assert gone.cancel()  # its request was cancelled (the client went away)
    gate.opened.set()
    assert first.result(30) and kept.result(30)
    assert gate.batches == [["first"], ["gone", "kept"]]
    assert submit(committer, "later", 3).result(30)  # the job goes on


def test_close_commits_what_is_queued_and_then_the_caller_commits(
    writer: tuple[GroupCommitter, Gate],
) -> None:
    committer, gate = writer
    first = hold_first(committer, gate)
    queued = [submit(committer, f"q{n}", n) for n in range(1, 3)]
    closing = threading.Thread(target=committer.close)
    closing.start()
    gate.opened.set()
    closing.join(30)
    assert not closing.is_alive() and not committer.scheduled
    assert all(f.done() and f.exception() is None for f in [first, *queued])
    # Not scheduled any more: a delivery is committed by whoever submits it.
    late = submit(committer, "late", 9)
    assert not late.done()
    committer.drain()
    assert late.result(0)
