"""Where `runbook top` reads a snapshot from, and where its answers to approvals go.

- `AgentSource` (`--engine URL`, repeatable): each agent's /v1/state, the
  findings of the embedded evaluator (the same rules and evaluator `runbook
  serve` runs, over each agent's /metrics, in memory), and, when a journal is
  named (`--db`, `--config`), its executions in progress and awaiting
  approval; answers go to the journal as `runbook approve` writes them.
- `ServerSource` (`--server URL`): the service's API (/api/engines/state,
  /api/incidents, /api/executions, /api/pending), its answers parsed into the
  service's models (service/api.py); answers are POSTed with the webhook's
  credentials, which name who answered, as the on-call page's are.

Errors are drawn once, each with its exit code:

    ServiceError        (SERVICE)  unreachable, not a `runbook serve`, or a refused credential
    DecisionFailed      (FAILED)   an answer the journal or the service did not take
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError
from vllm_runbook.collector.agent_api import answer_error
from vllm_runbook.collector.auth import TokenError, is_loopback, runtime_dir
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.rules.incidents import engine_name
from vllm_runbook.runbooks.engine.client import (
    CommandRefused,
    EngineClient,
    EngineClientError,
    normalize_url,
)
from vllm_runbook.runbooks.model.config import DEFAULT_APPROVAL_TIMEOUT, Config
from vllm_runbook.runbooks.model.exit_codes import ExitCode, RunbookError
from vllm_runbook.runbooks.operate.top.model import (
    EngineView,
    ExecutionView,
    Finding,
    Snapshot,
    executions_from,
    finding_from_incident,
)
from vllm_runbook.runbooks.service.api import (
    ApiError,
    Decision,
    EngineState,
    Execution,
    Executions,
    Incidents,
    PendingApprovals,
    WhoAmI,
)

APPROVE, REJECT = "approve", "reject"

Answer = TypeVar("Answer", bound=BaseModel)


class ServiceError(RunbookError):
    """The service cannot be used: unreachable, not ours, or it refused the credentials."""

    exit_code = ExitCode.SERVICE


class DecisionFailed(RunbookError):
    """An approve/reject that was not taken (too late, not awaiting, no credentials)."""

    exit_code = ExitCode.FAILED


class Source(Protocol):
    description: str
    who: str | None
    """Who an answer is recorded as; None: this view cannot answer (why: `cannot_decide`)."""
    cannot_decide: str

    def snapshot(self) -> Snapshot: ...

    def decide(self, execution_id: int, verb: str, note: str | None = None) -> str: ...

    def close(self) -> None: ...


def inventory_name(url: str) -> str:
    """An engine named by its agent URL: its host and port (`127.0.0.1:9360`)."""
    return urlsplit(url).netloc


# -- straight from the agents -------------------------------------------------------------


class AgentSource:
    """Agents' /v1/state, the embedded evaluator's findings, the journal's executions."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout: float,
        config: Config | None = None,
        journal: bool = False,
        journal_url: str | None = None,
        who: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from vllm_runbook.runbooks.service.rules_service import RulesService

        self.clients = [EngineClient(url, timeout=timeout) for url in urls]
        self.names = [inventory_name(c.url) for c in self.clients]
        if len(set(self.names)) != len(self.names):
            raise CommandRefused(f"an engine is given twice ({', '.join(self.names)})")
        engines = tuple(
            EngineConfig.model_validate({"name": n, "agent": c.url})
            for n, c in zip(self.names, self.clients, strict=True)
        )
        # The configuration's rules (catalog, overrides), over these engines.
        rules_config = (config or Config()).model_copy(update={"engines": engines})
        self.rules = RulesService.from_config(rules_config, scrape_timeout=timeout)
        self.clock = clock
        self.timeout_s = config.approvals.timeout_seconds if config else DEFAULT_APPROVAL_TIMEOUT
        self.journal: Any = None
        if journal:  # `journal_url` None: the store's default, as `runbook pending` reads it
            from vllm_runbook.runbooks.store import Journal, has_journal

            if has_journal(journal_url):
                self.journal = Journal(journal_url)
        self.who = who if self.journal is not None else None
        self.cannot_decide = "no journal to answer in: give --db URL or --config FILE"
        self.description = f"{len(urls)} engine(s), embedded rules" + (
            ", journal" if self.journal is not None else ""
        )
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)))

    def check(self) -> None:
        """Each agent answers now (raises the first one's error: the CLI's exit code)."""
        list(self._pool.map(lambda c: c.state(), self.clients))

    def _view(self, index: int) -> EngineView:
        try:
            return EngineView(self.names[index], self.clients[index].state())
        except EngineClientError as exc:
            return EngineView(self.names[index], None, str(exc))

    def snapshot(self) -> Snapshot:
        views = tuple(self._pool.map(self._view, range(len(self.clients))))
        now = self.clock()
        self.rules.run_cycle(now)
        findings = tuple(
            Finding(a.alert, a.severity, engine_name(a.engine), a.value, a.first_seen)
            for a in sorted(self.rules.evaluator.open_alerts(), key=lambda a: a.first_seen)
            if a.state == "firing"
        )
        problems = tuple(f"{v.name}: {v.error}" for v in views if v.error)
        executions = None
        if self.journal is not None:
            from vllm_runbook.runbooks.store import StoreError

            try:
                # The journal's records as the service's API answers them.
                recent = [Execution.from_record(r) for r in self.journal.list_executions(limit=100)]
                pending = [Execution.from_record(r) for r in self.journal.pending_approvals()]
                executions = executions_from(recent, pending)
            except StoreError as exc:
                problems += (f"journal: {exc}",)
        return Snapshot(now, views, findings, executions, problems)

    def decide(self, execution_id: int, verb: str, note: str | None = None) -> str:
        if self.journal is None or self.who is None:
            raise DecisionFailed(self.cannot_decide)
        from vllm_runbook.runbooks.store import StoreError
        from vllm_runbook.runbooks.store.models import ApprovalState

        decision = ApprovalState.APPROVED if verb == APPROVE else ApprovalState.REJECTED
        try:
            result = self.journal.decide(
                execution_id, decision, self.who, note, timeout_s=self.timeout_s
            )
        except StoreError as exc:
            raise DecisionFailed(str(exc)) from None
        if not result.ok:
            raise DecisionFailed(result.message)
        return str(result.message)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.rules.close()
        if self.journal is not None:
            self.journal.close()


# -- from the service ---------------------------------------------------------------------


def _secret(path: Path | str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise TokenError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not value:
        raise TokenError(f"{what} {path} is empty")
    return value


def server_authorization(
    url: str, *, token_file: str | None = None, config: Config | None = None
) -> str | None:
    """The Authorization header for the service: the webhook's credentials, found
    as `runbook serve` finds them (`--token-file`, then the configuration's
    webhook section, then RUNBOOK_WEBHOOK_TOKEN, then the token a local service
    generated); None when there are none (then the view only reads)."""
    if token_file:
        return "Bearer " + _secret(token_file, "token file")
    if config is not None:
        hook = config.webhook
        if hook.token_file is not None:
            return "Bearer " + _secret(hook.token_file, "webhook token_file")
        if hook.username and hook.password_file is not None:
            password = _secret(hook.password_file, "webhook password_file")
            pair = f"{hook.username}:{password}".encode()
            return "Basic " + base64.b64encode(pair).decode()
    env = os.environ.get("RUNBOOK_WEBHOOK_TOKEN", "").strip()
    if env:
        return "Bearer " + env
    host = urlsplit(url).hostname
    generated = runtime_dir() / "webhook.token"
    if host and is_loopback(host) and generated.is_file():
        return "Bearer " + _secret(generated, "webhook token")
    return None


class ServerSource:
    """The service's API: what its replicas see, and answers in the names of its credentials."""

    def __init__(self, url: str, authorization: str | None, *, timeout: float) -> None:
        try:
            self.url = normalize_url(url)
        except EngineClientError as exc:
            raise ServiceError(str(exc).replace("engine agent", "service")) from None
        if authorization is not None and not (
            authorization.isascii() and authorization.isprintable()
        ):
            raise TokenError("the service token must be printable ASCII")
        self.headers = {"Authorization": authorization} if authorization else {}
        self.timeout = timeout
        self.who: str | None = None
        self.cannot_decide = (
            "no credentials to answer with: give --token-file FILE or --config FILE "
            "(the webhook's, as `runbook serve` reads them)"
        )
        self.description = f"service {self.url}"
        self._client = httpx.Client(timeout=timeout, headers=self.headers)

    def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            return self._client.request(method, self.url + path, json=body)
        except httpx.TimeoutException:
            raise ServiceError(
                f"service {self.url} unreachable: no answer within {self.timeout:g} s"
            ) from None
        except httpx.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ServiceError(f"service {self.url} unreachable: {reason}") from None

    def _json(self, path: str) -> Any:
        response = self._call("GET", path)
        if response.status_code == 401:
            raise ServiceError(f"service {self.url} refused the credentials (401 on {path})")
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if response.status_code != 200 or not isinstance(payload, list | dict):
            raise ServiceError(
                f"{self.url}{path} answered HTTP {response.status_code}"
                + ("" if payload is not None else " without JSON")
                + ": is it a `runbook serve`?"
            )
        return payload

    def _answer(self, path: str, model: type[Answer]) -> Answer:
        """A GET's answer parsed into its model (service/api.py)."""
        payload = self._json(path)
        try:
            return model.model_validate(payload)
        except ValidationError as exc:
            raise ServiceError(
                f"{self.url}{path} does not answer as a `runbook serve` does: {answer_error(exc)}"
            ) from None

    def check(self) -> None:
        """The service answers as ours, and its credentials (when given) are accepted."""
        health = self._json("/healthz")
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise ServiceError(f"{self.url}/healthz does not answer as a `runbook serve` does")
        if self.headers:
            self.who = self._answer("/api/whoami", WhoAmI).who

    def _engine(self, row: Any) -> EngineView:
        """One row of /api/engines/state; a state this `runbook top` cannot read
        (another version's agent) is that engine's error, not the view's."""
        try:
            answer = EngineState.model_validate(row)
        except ValidationError as exc:
            name = str(row.get("name")) if isinstance(row, dict) else "?"
            return EngineView(name, None, f"not an agent's state ({answer_error(exc)})")
        if not answer.up or answer.state is None:
            return EngineView(answer.name, None, str(answer.error))
        return EngineView(answer.name, answer.state)

    def snapshot(self) -> Snapshot:
        rows = self._json("/api/engines/state")
        if not isinstance(rows, list):
            raise ServiceError(f"{self.url}/api/engines/state is not a list of engines")
        views = tuple(self._engine(row) for row in rows)
        problems = [f"{v.name}: {v.error}" for v in views if v.error]
        incidents = self._answer("/api/incidents?open_only=true", Incidents).root
        findings = tuple(
            finding_from_incident(i)
            for i in sorted(incidents, key=lambda i: i.first_seen)
            if i.state == "firing"
        )
        recent = self._answer("/api/executions?limit=100", Executions).root
        pending = self._answer("/api/pending", PendingApprovals).root
        executions: tuple[ExecutionView, ...] = executions_from(recent, pending)
        return Snapshot(time.time(), views, findings, executions, tuple(problems))

    def decide(self, execution_id: int, verb: str, note: str | None = None) -> str:
        if self.who is None:
            raise DecisionFailed(self.cannot_decide)
        response = self._call("POST", f"/api/executions/{int(execution_id)}/{verb}", {"note": note})
        if response.status_code == 401:
            raise DecisionFailed(f"service {self.url} refused the credentials")
        if response.status_code == 200:
            try:
                return Decision.model_validate_json(response.content).message
            except ValidationError as exc:  # taken, but not said as the service says it
                return f"HTTP 200, not a decision's answer ({answer_error(exc)})"
        try:
            error: str | None = ApiError.model_validate_json(response.content).error
        except ValidationError:  # not JSON, or not the service's refusal
            error = None
        raise DecisionFailed(error or f"HTTP {response.status_code}")

    def close(self) -> None:
        self._client.close()
