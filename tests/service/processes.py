"""Real processes for the service tests: Alertmanager and `runbook serve` on loopback.

Each is a context manager that stops its process on the way out, also when
the test fails (its log is printed then)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from vllm_runbook.dashboards.generate import DASHBOARDS_DIR
from vllm_runbook.runbooks.demo.servers import free_port, logged_process

from tests.engines import http_get, runbook_cli_command, runbook_cli_env


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
        url = f"http://127.0.0.1:{port}"
        with logged_process(cmd, log_path, url + "/-/ready", 60, stop_timeout=20) as proc:
            yield cls(proc, url, log_path)

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
        cls,
        config: Path,
        log_path: Path,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Iterator[RunbookServe]:
        port = port or free_port()
        cmd = runbook_cli_command("serve", "--config", str(config), "--port", str(port), *args)
        url = f"http://127.0.0.1:{port}"
        with logged_process(
            cmd, log_path, url + "/healthz", 90, runbook_cli_env(env), stop_timeout=45, tail=6000
        ) as proc:
            yield cls(proc, url, log_path)

    def get(self, path: str) -> Any:
        status, body = http_get(self.url + path, timeout=10)
        assert status == 200, body
        return json.loads(body)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())
