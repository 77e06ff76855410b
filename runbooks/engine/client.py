"""HTTP client for the engine agent (collector/agent.py).

It speaks the agent's models (vllm_runbook.collector.agent_api): commands are
built with them (a bad value is refused here, with the agent's own message),
answers parsed with them; an answer that does not fit is not an agent's.

`Agent` is what the runbooks use of an agent, whoever answers: `EngineClient`
over HTTP, tests/fake_agent.py's `FakeAgent` in memory.

Errors are drawn once, each with the CLI exit code it maps to (exit_codes.py):

    EngineClientError       (FAILED)
    ├── EngineUnreachable   (ENGINE)  connection refused, timeout, truncated answer
    │   └── NotAnAgent      (ENGINE)  answers, but not as a vllm-runbook agent does
    ├── AuthFailed          (ENGINE)  401: no token, or the wrong one
    └── CommandRefused      (USAGE)   400/422: malformed, or out of bounds; a bad URL
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError
from vllm_runbook.collector.agent_api import (
    AgentState,
    ChangeResult,
    KnobsCommand,
    RestoreCommand,
    answer_error,
    command_error,
)
from vllm_runbook.collector.auth import find_local_token, is_loopback
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError

AnswerT = TypeVar("AnswerT", bound=BaseModel)


class EngineClientError(RunbookError):
    exit_code = ExitCode.FAILED

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}


class EngineUnreachable(EngineClientError):
    exit_code = ExitCode.ENGINE


class NotAnAgent(EngineUnreachable):
    pass


class AuthFailed(EngineClientError):
    exit_code = ExitCode.ENGINE


class CommandRefused(EngineClientError):
    exit_code = ExitCode.USAGE


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


class Agent(Protocol):
    """What the runbooks use of an engine agent (the executor, its signal reader and
    actions, the breaker, the revert, the tuner, `runbook top`): its URL and
    timeout, and its three calls. `EngineClient` is one over HTTP; a test's fake
    (tests/fake_agent.py) is another, checked by mypy to stay one. The calls
    raise the EngineClientError family above."""

    @property
    def url(self) -> str:
        """The agent's base URL, normalized (the engine's key in the journal)."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds an answer may take (the engine's vLLM /metrics is read with it too)."""
        ...

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        """GET /v1/state; with `since_step`, also what happened from that step on;
        `episode_seconds` widens its `episode` from the collector's window."""
        ...

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> ChangeResult:
        """POST /v1/knobs: `values` are KnobsCommand's knobs (None: not given)."""
        ...

    def restore(self, dry_run: bool = False) -> ChangeResult:
        """POST /v1/restore: every knob back to its startup value."""
        ...


class EngineClient:
    """The agent over HTTP (an `Agent`)."""

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

    def _expect(self, payload: Any, model: type[AnswerT]) -> AnswerT:
        try:
            return model.model_validate(payload)
        except ValidationError as exc:
            raise NotAnAgent(
                f"{self.url} does not answer like a vllm-runbook agent ({answer_error(exc)}): "
                "is the URL the agent's (VLLM_RUNBOOK_PORT), not vLLM's API server?"
            ) from None

    def _request(self, method: str, path: str, body: BaseModel | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if body is not None:
            headers["Content-Type"] = "application/json"
        content = None if body is None else body.model_dump_json(exclude_defaults=True)
        try:
            response = httpx.request(
                method, self.url + path, content=content, headers=headers, timeout=self.timeout
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

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState:
        """`/v1/state`; with `since_step`, also what happened from that step on;
        `episode_seconds` widens its `episode` (an older agent ignores it: null)."""
        query = []
        if since_step is not None:
            query.append(f"since_step={int(since_step)}")
        if episode_seconds is not None:
            query.append(f"episode_seconds={max(0.0, float(episode_seconds)):.3f}")
        path = "/v1/state" + ("?" + "&".join(query) if query else "")
        return self._expect(self._request("GET", path), AgentState)

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> ChangeResult:
        """POST /v1/knobs: `values` are KnobsCommand's knobs (None: not given)."""
        body = {k: v for k, v in values.items() if v is not None}
        try:
            command = KnobsCommand.model_validate({**body, "clamp": clamp, "dry_run": dry_run})
        except ValidationError as exc:
            raise CommandRefused(command_error(exc)) from None
        return self._expect(self._request("POST", "/v1/knobs", command), ChangeResult)

    def restore(self, dry_run: bool = False) -> ChangeResult:
        command = RestoreCommand(dry_run=dry_run)
        return self._expect(self._request("POST", "/v1/restore", command), ChangeResult)


if TYPE_CHECKING:  # mypy: the client is an Agent
    _AN_AGENT: type[Agent] = EngineClient


def _one_line(text: str, limit: int = 300) -> str:
    """A server's message as one short line (it goes to the CLI's stderr)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
