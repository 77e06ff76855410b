"""Real processes for the service tests: Alertmanager and `runbook serve` on loopback.

Each is a context manager that stops its process on the way out, also when
the test fails (its log is printed then)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dashboards.generate import DASHBOARDS_DIR
from tests.engines import REPO_ROOT, free_port, http_get, wait_http


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def alertmanager_config(webhook_url: str, token_file: Path) -> str:
    """The checked-in alertmanager.yml with the test's receiver URL, token file
    and short timers (group_wait 0s, group_interval 1s)."""
    doc = yaml.safe_load((DASHBOARDS_DIR / "alertmanager.yml").read_text())
    doc["route"].update(group_wait="0s", group_interval="1s", repeat_interval="1h")
    [receiver] = doc["receivers"]
    [hook] = receiver["webhook_configs"]
    assert hook["send_resolved"] is True
    hook["url"] = webhook_url
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    return str(yaml.safe_dump(doc, sort_keys=False))


@dataclass
class AlertmanagerServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    @contextlib.contextmanager
    def run(
        cls,
        config_text: str,
        workdir: Path,
        binary: str = "prometheus-alertmanager",
        port: int | None = None,
    ) -> Iterator[AlertmanagerServer]:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "alertmanager.yml"
        config.write_text(config_text)
        port = port or free_port()
        log_path = workdir / "alertmanager.log"
        cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no gossip: a single instance, nothing listens
            "--log.level=warn",
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        try:
            wait_http(server.url + "/-/ready", 60, proc)
            yield server
        except BaseException:
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise
        finally:
            _stop(proc, 20)

    def alerts(self) -> list[dict[str, Any]]:
        return list(json.loads(http_get(self.url + "/api/v2/alerts")[1]))


@dataclass
class RunbookServe:
    """`runbook serve` of this checkout in a subprocess."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    @contextlib.contextmanager
    def run(
        cls, config: Path, log_path: Path, *args: str, port: int | None = None
    ) -> Iterator[RunbookServe]:
        port = port or free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        cmd = [sys.executable, "-m", "runbooks.cli", "serve", "--config", str(config),
               "--port", str(port), *args]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        served = cls(proc, f"http://127.0.0.1:{port}", log_path)
        try:
            wait_http(served.url + "/healthz", 90, proc)
            yield served
        except BaseException:
            sys.stderr.write(log_path.read_text(errors="replace")[-6000:])
            raise
        finally:
            _stop(proc, 45)

    def get(self, path: str) -> Any:
        status, body = http_get(self.url + path, timeout=10)
        assert status == 200, body
        return json.loads(body)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())
