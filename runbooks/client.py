"""HTTP client for the engine agent (collector/agent.py).

Errors are drawn once, each with the CLI exit code it maps to:

    EngineClientError
    ├── EngineUnreachable   (3)  connection refused, timeout, truncated answer
    │   └── NotAnAgent      (3)  answers, but not as a vllm-runbook agent does
    ├── AuthFailed          (3)  401: no token, or the wrong one
    └── CommandRefused      (2)  400/422: malformed, or out of bounds; a bad URL
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


class NotAnAgent(EngineUnreachable):
    pass


class AuthFailed(EngineClientError):
    exit_code = 3


class CommandRefused(EngineClientError):
    exit_code = 2


def normalize_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")  # after the scheme is known: "http://" must not become a host
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise CommandRefused(f"not an engine agent URL: {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CommandRefused(f"not an engine agent URL: {url!r}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise CommandRefused(f"not an engine agent URL: {url!r} (spaces or control characters)")
    return url


# What the CLI, the executor and the checklists read from the agent's answers:
# anything else answering JSON is not an agent (and must not end in a KeyError).
_STATE_SHAPE: dict[str, Any] = {
    "engine": {"model_name": str, "engine": str, "step": int, "vllm_version": str},
    "collector_up": bool,
    "knobs": {"max_num_batched_tokens": int, "max_num_seqs": int, "policy": str},
    "startup": {"max_num_batched_tokens": int, "max_num_seqs": int, "policy": str},
    "bounds": {
        "max_num_batched_tokens": {"min": int, "max": int},
        "max_num_seqs": {"min": int, "max": int},
    },
    "stats": dict,
}
_CHANGE_SHAPE: dict[str, Any] = {
    "dry_run": bool,
    "changes": [{"knob": str, "before": object, "after": object}],
    "clamped": [{"knob": str, "requested": object, "applied": object}],
    "before": dict,
    "after": dict,
    "effective_from_step": int,
}


def shape_error(value: Any, shape: Any, where: str = "answer") -> str | None:
    """Where `value` departs from `shape` (a type, a dict of shapes, or a
    one-element list: a list of that shape), or None when it fits."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        for key, inner in shape.items():
            if key not in value:
                return f"{where} has no {key!r}"
            error = shape_error(value[key], inner, f"{where}.{key}")
            if error:
                return error
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where} is not a list"
        for i, item in enumerate(value):
            error = shape_error(item, shape[0], f"{where}[{i}]")
            if error:
                return error
        return None
    if shape is int and isinstance(value, bool):
        return f"{where} is not an integer"
    if not isinstance(value, shape):
        return f"{where} is not {'an' if shape is int else 'a'} {shape.__name__}"
    return None


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
        if self.token is not None and not (
            self.token.isascii() and self.token.isprintable() and " " not in self.token
        ):
            raise CommandRefused("the agent token must be printable ASCII without spaces")
        if not timeout > 0:
            raise CommandRefused(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = timeout

    def _expect(self, payload: Any, shape: Any) -> dict[str, Any]:
        error = shape_error(payload, shape)
        if error:
            raise NotAnAgent(
                f"{self.url} does not answer like a vllm-runbook agent ({error}): "
                "is the URL the agent's (VLLM_RUNBOOK_PORT), not vLLM's API server?"
            )
        return dict(payload)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = httpx.request(
                method, self.url + path, json=body, headers=headers, timeout=self.timeout
            )
        except httpx.TimeoutException:
            raise EngineUnreachable(
                f"engine {self.url} unreachable: no answer within {self.timeout:g} s"
            ) from None
        except httpx.HTTPError as exc:
            reason = _one_line(str(exc)) or type(exc).__name__
            raise EngineUnreachable(f"engine {self.url} unreachable: {reason}") from None
        except httpx.InvalidURL as exc:
            raise CommandRefused(f"not an engine agent URL: {self.url!r} ({exc})") from None
        try:
            payload = response.json()
        except ValueError:  # not JSON, not UTF-8, empty
            raise NotAnAgent(
                f"{self.url} answered HTTP {response.status_code} without JSON: "
                "is it a vllm-runbook agent?"
            ) from None
        if response.status_code == 401:
            hint = "" if self.token else " (no token: use --token or VLLM_RUNBOOK_TOKEN)"
            raise AuthFailed(f"engine {self.url} refused the token{hint}")
        error = payload.get("error") if isinstance(payload, dict) else None
        detail = payload if isinstance(payload, dict) else {}
        if response.status_code in (400, 422):
            if not isinstance(error, str):
                raise NotAnAgent(
                    f"{self.url} answered HTTP {response.status_code} without an error "
                    "message: is it a vllm-runbook agent?"
                )
            raise CommandRefused(_one_line(error), detail)
        if response.status_code >= 300:
            if not isinstance(error, str):
                raise NotAnAgent(
                    f"{self.url} answered HTTP {response.status_code} without an error "
                    "message: is it a vllm-runbook agent?"
                )
            raise EngineClientError(
                f"engine {self.url}: HTTP {response.status_code}: {_one_line(error)}", detail
            )
        return payload

    def state(self, since_step: int | None = None) -> dict[str, Any]:
        """`/v1/state`; with `since_step`, also what happened from that step on."""
        path = "/v1/state" if since_step is None else f"/v1/state?since_step={int(since_step)}"
        return self._expect(self._request("GET", path), _STATE_SHAPE)

    def set_knobs(
        self, clamp: bool = False, dry_run: bool = False, **values: Any
    ) -> dict[str, Any]:
        body = {k: v for k, v in values.items() if v is not None}
        answer = self._request("POST", "/v1/knobs", {**body, "clamp": clamp, "dry_run": dry_run})
        return self._expect(answer, _CHANGE_SHAPE)

    def restore(self, dry_run: bool = False) -> dict[str, Any]:
        answer = self._request("POST", "/v1/restore", {"dry_run": dry_run})
        return self._expect(answer, _CHANGE_SHAPE)


def _one_line(text: str, limit: int = 300) -> str:
    """A server's message as one short line (it goes to the CLI's stderr)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
