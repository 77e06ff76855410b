"""HTTP client for the engine agent (collector/agent.py).

Errors are drawn once, each with the CLI exit code it maps to:

    EngineClientError
    ├── EngineUnreachable   (3)  connection refused, timeout, not an agent
    ├── AuthFailed          (3)  401: no token, or the wrong one
    └── CommandRefused      (2)  400/422: malformed, or out of bounds
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import httpx
from vllm_runbook.collector.auth import find_local_token, is_loopback


class EngineClientError(Exception):
    exit_code = 1

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}


class EngineUnreachable(EngineClientError):
    exit_code = 3


class AuthFailed(EngineClientError):
    exit_code = 3


class CommandRefused(EngineClientError):
    exit_code = 2


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CommandRefused(f"not an engine agent URL: {url!r}")
    return url


def resolve_token(url: str, token: str | None = None) -> str | None:
    """Explicit token, else VLLM_RUNBOOK_TOKEN, else the token a local agent
    stored in the runtime directory."""
    if token:
        return token
    env = os.environ.get("VLLM_RUNBOOK_TOKEN", "").strip()
    if env:
        return env
    parts = urlsplit(url)
    if parts.hostname and is_loopback(parts.hostname) and parts.port:
        return find_local_token(parts.port)
    return None


class EngineClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 35.0) -> None:
        self.url = normalize_url(url)
        self.token = resolve_token(self.url, token)
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = httpx.request(
                method, self.url + path, json=body, headers=headers, timeout=self.timeout
            )
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"engine {self.url} unreachable: {exc}") from None
        try:
            payload = response.json()
        except ValueError:
            raise EngineUnreachable(
                f"{self.url} answered HTTP {response.status_code} without JSON: "
                "is it a vllm-runbook agent?"
            ) from None
        if response.status_code == 401:
            hint = "" if self.token else " (no token: use --token or VLLM_RUNBOOK_TOKEN)"
            raise AuthFailed(f"engine {self.url} refused the token{hint}")
        if response.status_code in (400, 422):
            raise CommandRefused(str(payload.get("error", payload)), payload)
        if response.status_code >= 300:
            raise EngineClientError(
                f"engine {self.url}: HTTP {response.status_code}: {payload.get('error', payload)}",
                payload,
            )
        return payload

    def state(self) -> dict[str, Any]:
        return dict(self._request("GET", "/v1/state"))

    def set_knobs(
        self, clamp: bool = False, dry_run: bool = False, **values: Any
    ) -> dict[str, Any]:
        body = {k: v for k, v in values.items() if v is not None}
        return dict(
            self._request("POST", "/v1/knobs", {**body, "clamp": clamp, "dry_run": dry_run})
        )

    def restore(self, dry_run: bool = False) -> dict[str, Any]:
        return dict(self._request("POST", "/v1/restore", {"dry_run": dry_run}))
