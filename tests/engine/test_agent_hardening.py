"""A real engine under hostile agent clients, and live control racing vLLM's
own queue changes (pause, reset of the prefix cache)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.auth import find_local_token

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def guarded_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    limits = {"VLLM_RUNBOOK_AGENT_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    limits["VLLM_RUNBOOK_AGENT_TIMEOUT"] = "1"
    os.environ.update(limits)
    try:
        eng = InProcessEngine.start(tiny_model)
    finally:
        for name in limits:
            os.environ.pop(name)
    yield eng
    eng.close()


def _auth(eng: InProcessEngine) -> dict[str, str]:
    return {"Authorization": f"Bearer {find_local_token(eng.collector.server.port)}"}


def _post(eng: InProcessEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(eng.collector.server.url + path, json=body, headers=_auth(eng), timeout=60)


def _answer(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_hostile_clients_do_not_stop_the_engine_or_the_scrape(
    guarded_engine: InProcessEngine, capfd: pytest.CaptureFixture[str]
) -> None:
    eng = guarded_engine
    server = eng.collector.server
    token = find_local_token(server.port)
    address = (server.host, server.port)
    steps_before = eng.collector.stats.steps
    opened: list[socket.socket] = []

    def connect(raw: bytes) -> socket.socket:
        sock = socket.create_connection(address, timeout=60)
        sock.sendall(raw)
        opened.append(sock)
        return sock

    try:
        # Twice as many hostile connections as handler slots, all at once:
        # silent, half a request line, lying lengths with and without a token.
        silent = [connect(b"") for _ in range(2)]
        trickle = connect(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        lying = connect(
            b"POST /v1/knobs HTTP/1.1\r\nAuthorization: Bearer "
            + token.encode()
            + b'\r\nContent-Length: 1000\r\n\r\n{"max_num_seqs"'
        )
        no_token = connect(b"POST /v1/knobs HTTP/1.1\r\nContent-Length: -1\r\n\r\n")
        not_a_number = connect(b"GET /metrics HTTP/1.1\r\nContent-Length: abc\r\n\r\n")
        huge = connect(
            b"POST /v1/knobs HTTP/1.1\r\nAuthorization: Bearer "
            + token.encode()
            + b"\r\nContent-Length: 1000000000000\r\n\r\n"
        )
        garbage = connect(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")

        # The engine keeps stepping meanwhile: every request finishes once.
        for i in range(16):
            eng.add(f"hostile-{i}", 64, max_tokens=8, offset=13 * i)
        eng.run_until_done()
        assert {f"hostile-{i}" for i in range(16)} <= set(eng.finished)
        assert all(len(eng.finished[f"hostile-{i}"].outputs[0].token_ids) == 8 for i in range(16))

        # The scrape from the same address answers once the hostile clients'
        # time is up (1 s idle, 1.5 s a request): until then that address holds
        # its share of the slots and is refused at once.
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(server.url + "/metrics", timeout=60)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 503  # refused while its slots were busy
            time.sleep(0.25)
        assert r.status_code == 200
        assert f"{M.SCHEDULE_SECONDS.name}_count" in r.text
        assert eng.collector.stats.steps > steps_before

        answers = {
            name: _answer(s)
            for name, s in [
                ("silent", silent[0]),
                ("trickle", trickle),
                ("lying", lying),
                ("no_token", no_token),
                ("not_a_number", not_a_number),
                ("huge", huge),
                ("garbage", garbage),
            ]
        }
    finally:
        for sock in opened:
            sock.close()
    refused = b"HTTP/1.1 503 "
    for name in ("no_token", "not_a_number", "huge", "garbage"):
        # Answered at once, or refused for want of a slot; never left hanging.
        expected = {"no_token": 401, "not_a_number": 400, "huge": 413, "garbage": 400}[name]
        assert answers[name].startswith((f"HTTP/1.1 {expected} ".encode(), refused)), name
    for name in ("silent", "trickle", "lying"):
        # Timed out: closed without an answer (or refused for want of a slot).
        assert answers[name] in (b"",) or answers[name].startswith(refused), name
    # The knobs did not move and nothing was logged as a failure.
    assert eng.collector.control.knobs()["max_num_seqs"] == 64
    assert "Traceback" not in capfd.readouterr().err


def test_bodies_that_are_not_json_are_refused(guarded_engine: InProcessEngine) -> None:
    url = guarded_engine.collector.server.url + "/v1/knobs"
    auth = _auth(guarded_engine)
    for body in (b"\xff\xfe\x00", b"[" * 50_000, b'{"max_num_seqs": 1'):
        r = httpx.post(url, content=body, headers=auth, timeout=60)
        assert r.status_code == 400 and "not JSON" in r.json()["error"]
    assert guarded_engine.collector.control.knobs()["max_num_seqs"] == 64
    # The state names the scheduler vLLM picked (the GPU check expects the async one).
    state = httpx.get(guarded_engine.collector.server.url + "/v1/state", timeout=60).json()
    assert state["engine"]["scheduler_class"] == "RunbookScheduler"


def test_policy_switch_while_paused_loses_no_request(guarded_engine: InProcessEngine) -> None:
    """Paused (PAUSED_ALL) counts as idle, so the HTTP thread applies the
    switch itself; vLLM's reset_prefix_cache(reset_running_requests=True)
    moves running requests onto `waiting` at the same time. The switch is
    forced into the middle of that loop: it must wait for the lock."""
    eng = guarded_engine
    core, scheduler = eng.core, eng.scheduler
    ids = [f"race-{i}" for i in range(12)]
    for i, request_id in enumerate(ids):
        eng.add(request_id, 40, max_tokens=6, offset=11 * i, priority=i % 3)
    for _ in range(2):
        eng.step()
    assert len(scheduler.running) == 12 and not set(ids) & set(eng.finished)

    core.pause_scheduler(mode="keep", clear_cache=False)
    assert eng.collector.engine_idle()  # the HTTP thread will apply the command
    original = scheduler._preempt_request
    switch: dict[str, Any] = {}

    def preempt(*args: Any, **kwargs: Any) -> Any:
        if "thread" not in switch:
            thread = threading.Thread(
                target=lambda: switch.update(r=_post(eng, "/v1/knobs", {"policy": "priority"}))
            )
            switch["thread"] = thread
            thread.start()
            # Without the lock the switch completes here, mid-preemption.
            thread.join(timeout=3)
            switch["done_during_reset"] = not thread.is_alive()
        return original(*args, **kwargs)

    scheduler._preempt_request = preempt
    try:
        assert core.reset_prefix_cache(reset_running_requests=True)
    finally:
        del scheduler._preempt_request
    switch["thread"].join(60)
    assert switch["done_during_reset"] is False
    assert switch["r"].status_code == 200, switch["r"].text
    assert switch["r"].json()["after"]["policy"] == "priority"
    assert not scheduler.running and len(scheduler.waiting) == 12  # all preempted, none lost

    core.resume_scheduler()
    eng.run_until_done(max_steps=2000)
    assert set(ids) <= set(eng.finished)  # each exactly once (InProcessEngine checks)
    assert all(len(eng.finished[i].outputs[0].token_ids) == 6 for i in ids)
    assert _post(eng, "/v1/restore", {}).json()["after"]["policy"] == "fcfs"


def test_one_client_holding_every_connection_leaves_the_scrape_and_control_served(
    guarded_engine: InProcessEngine,
) -> None:
    # 64 idle connections from 127.0.0.1 (16 times the slots): the agent keeps
    # half its slots for other clients and refuses that client's excess at once.
    eng = guarded_engine
    server = eng.collector.server
    address = (server.host, server.port)
    steps_before = eng.collector.stats.steps
    flood: list[socket.socket] = []
    try:
        for _ in range(64):
            flood.append(
                socket.create_connection(address, timeout=10, source_address=("127.0.0.1", 0))
            )
        # Another client (all of 127/8 is this host's): a scrape and a control
        # call, answered at once (2 s is the socket's timeout, not a measurement).
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=other, timeout=2) as client:
            r = client.get(server.url + "/metrics")
            assert r.status_code == 200, r.text
            assert f"{M.SCHEDULE_SECONDS.name}_count" in r.text
            r = client.post(
                server.url + "/v1/knobs",
                json={"max_num_seqs": 32, "dry_run": True},
                headers=_auth(eng),
            )
            assert r.status_code == 200, r.text
            assert r.json()["dry_run"] is True
        # The engine keeps stepping meanwhile.
        for i in range(4):
            eng.add(f"flooded-{i}", 32, max_tokens=4, offset=7 * i)
        eng.run_until_done()
        assert {f"flooded-{i}" for i in range(4)} <= set(eng.finished)
        assert eng.collector.stats.steps > steps_before
        answers = [_answer(s) for s in flood]
    finally:
        for sock in flood:
            sock.close()
    # The client's excess was answered 503 at once; its own share (2 slots) was
    # closed at the idle timeout (1 s) without an answer, and a slot so freed
    # while the flood opened went to the next of its connections.
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
    assert all(b"too many connections from this address" in a for a in refused)
    assert answers.count(b"") + len(refused) == 64
    assert len(refused) >= 64 - 4 * (MAX_CONNECTIONS // 2)
    assert eng.collector.control.knobs()["max_num_seqs"] == 64
