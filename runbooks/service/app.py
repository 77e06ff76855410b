"""The `runbook serve` ASGI app.

POST /webhooks/alertmanager   Alertmanager webhook v4 (bearer or basic auth)
GET  /healthz                 liveness, and whether the store answers
GET  /metrics                 the service's own metrics
GET  /openapi.json            the API's schema (no Swagger UI: it would load a CDN's script)
GET  /api/executions          the journal
GET  /api/incidents           incidents recorded by the rule evaluator
GET  /api/pending             executions awaiting approval, newest first, a page at a time
GET  /api/engines             the inventory: each engine, its source and when it was last seen
GET  /api/engines/state       each engine's agent state now, or why not (`runbook top`)
GET  /api/whoami              who the credentials answer as (the webhook's; 401 otherwise)
POST /api/executions/{id}/approve|reject   a person's answer (the webhook's
                              credentials, which name who answered; JSON body {"note": ...})
GET  /                        the on-call page (service/page.py)

The /api answers are the models of service/api.py (the routes' return types:
the OpenAPI document carries their schemas); the refusals are `ApiError`'s shape.

The reads (/api, /metrics, /openapi.json) and the page show engines, alert
labels and reasons. Bound off loopback (`protect_reads`) they need credentials:
the webhook's, or the read token. On loopback they are open to the names the
service answers to (service/browser.py: a rebound DNS name gets 400), and
every state change from a browser must come from the service's own origin.

Every route's body limit and the body-read timeout are enforced before the
body is read (service/limits.py, RequestLimits around the whole app).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from vllm_runbook.collector.auth import TokenError
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError
from vllm_runbook.runbooks.model.config import LimitsConfig
from vllm_runbook.runbooks.service import telemetry as T
from vllm_runbook.runbooks.service.alertmanager import WebhookPayload, unstorable_text
from vllm_runbook.runbooks.service.api import (
    ApiError,
    Decision,
    Engine,
    Engines,
    EngineState,
    EngineStates,
    Execution,
    Executions,
    Incidents,
    PendingApprovals,
    WhoAmI,
)
from vllm_runbook.runbooks.service.auth import Access, Credentials, Refusal, send_refusal
from vllm_runbook.runbooks.service.browser import BrowserGuard, BrowserPolicy
from vllm_runbook.runbooks.service.discovery import Inventory
from vllm_runbook.runbooks.service.limits import (
    BODY_TOO_LARGE,
    WEBHOOK_PATH,
    Connections,
    RequestLimits,
)
from vllm_runbook.runbooks.service.page import is_page, mount_page
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.service.webhooks import GroupCommitter, Router
from vllm_runbook.runbooks.service.worker import Worker
from vllm_runbook.runbooks.store import (
    ExecutionNotFound,
    InvalidInput,
    Journal,
    StoreError,
    StoreUnavailable,
)
from vllm_runbook.runbooks.store.approvals import DEFAULT_APPROVAL_TIMEOUT_S, TOO_LATE
from vllm_runbook.runbooks.store.models import ApprovalState, ExecutionStatus

__all__ = ["Credentials", "create_app", "store_error"]

log = logging.getLogger("vllm_runbook.service")

_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")

# GET /api/pending: a page's executions by default, and at most (`limit`).
PENDING_API_DEFAULT = 100
PENDING_API_MAX = 500

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


async def store_error(request: Request, exc: Exception) -> Response:
    """The app's one handler for the store's errors: no such execution 404, a
    value the journal does not take 422, anything else the store raises 503
    (the database is down, locked or has no schema: retry later). The API
    answers JSON, the on-call page text."""
    assert isinstance(exc, StoreError)
    if isinstance(exc, ExecutionNotFound):
        return _error(404, str(exc))
    if isinstance(exc, InvalidInput):
        return _error(422, str(exc))
    if is_page(request.url.path):
        return HTMLResponse(f"store unavailable: {exc}", status_code=503)
    return _error(503, f"store unavailable: {exc}")


def create_app(
    store: Journal,
    router: Router,
    credentials: Credentials,
    worker: Worker | None = None,
    *,
    metrics: ServiceMetrics | None = None,
    status: Callable[[], dict[str, Any]] | None = None,
    protect_reads: bool = False,
    read_credentials: Credentials | None = None,
    approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S,
    browser: BrowserPolicy | None = None,
    limits: LimitsConfig | None = None,
    lifespan: Lifespan | None = None,
    inventory: Inventory | None = None,
    engines: Sequence[EngineConfig] = (),
    engine_timeout_s: float = 5.0,
    committer: GroupCommitter | None = None,
) -> FastAPI:
    """The app; `status` adds to /healthz (e.g. whether this replica leads the rules).
    `protect_reads`: the reads and the page need `credentials` or
    `read_credentials` (`runbook serve` sets it when bound off loopback).
    `approval_timeout_s`: how long an execution awaits approval.
    `browser`: the names the service answers to and its page sessions
    (default: loopback names only, sessions signed with `credentials`).
    `limits`: the webhook's body limit and the body-read timeout (the
    configuration's `limits`; the rest of it is uvicorn's, set by serve).
    `lifespan`: what runs while the app serves (`runbook serve`'s background
    jobs, service/lifecycle.py); the webhook's writer closes first on shutdown.
    `committer`: the webhook's writer, a job of the service's scheduler (by
    default one of the app's own, unscheduled: each delivery commits what is
    queued itself, off the event loop)."""
    if not credentials.token and not credentials.password:
        raise ValueError("the webhook needs a token or basic-auth credentials")
    browser = browser or BrowserPolicy.build(credentials.secret)
    metrics = metrics or ServiceMetrics()
    access = Access(credentials, browser, metrics, read_credentials, protect_reads)
    committer = committer or GroupCommitter(store, router)

    @asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else nullcontext():
            try:
                yield
            finally:
                # The deliveries queued before the jobs stop (and the store closes).
                await asyncio.to_thread(committer.close)

    # No Swagger UI or ReDoc (they load a CDN's script); the schema is a guarded read.
    app = FastAPI(
        title="vllm-runbook",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=serving,
    )
    app.add_exception_handler(Refusal, send_refusal)
    app.add_exception_handler(StoreError, store_error)

    def refused(path: str, reason: str) -> None:
        metrics.requests_refused.labels(reason).inc()
        if path == WEBHOOK_PATH and reason == BODY_TOO_LARGE:
            metrics.webhooks_rejected.labels(T.REJECT_MALFORMED).inc()

    limits = limits or LimitsConfig()
    connections = Connections(limits)
    app.add_middleware(RequestLimits, limits=limits, on_refused=refused, connections=connections)
    # Outermost: its security headers go on every answer, RequestLimits' 413/408/503 too.
    app.add_middleware(BrowserGuard, policy=browser)
    # The server's protocol counts the connections and its refusals there too.
    app.state.refused = refused
    app.state.connections = connections

    def rejected(reason: str, status_code: int, message: str, **extra: Any) -> JSONResponse:
        metrics.webhooks_rejected.labels(reason).inc()
        return _error(status_code, message, **extra)

    read = [Depends(access.reader)]
    # The refusals each route may answer, for the OpenAPI document (ApiError's shape).
    refusals: dict[int | str, dict[str, Any]] = {
        401: {"model": ApiError, "description": "credentials needed"},
        503: {"model": ApiError, "description": "store unavailable; retry later"},
    }
    decision_refusals: dict[int | str, dict[str, Any]] = {
        **refusals,
        400: {"model": ApiError, "description": "the body is not JSON"},
        404: {"model": ApiError, "description": "no such execution"},
        409: {"model": ApiError, "description": "not awaiting approval"},
        410: {"model": ApiError, "description": "too late: decided, resolved or expired"},
        422: {"model": ApiError, "description": "a body or note not taken"},
    }

    @app.post(WEBHOOK_PATH, dependencies=[Depends(access.webhook)])
    async def alertmanager(request: Request) -> Response:
        body = await request.body()  # within its limit: RequestLimits cuts it at the limit
        try:
            # NaN/Infinity are not JSON; they would not survive the store either.
            raw = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            return rejected(T.REJECT_MALFORMED, 400, f"payload is not JSON: {exc}")
        except RecursionError:
            return rejected(T.REJECT_MALFORMED, 400, "payload is not JSON: nested too deeply")
        try:
            payload = WebhookPayload.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "payload"
            return rejected(
                T.REJECT_MALFORMED,
                422,
                f"invalid Alertmanager payload: {where}: {first['msg']}",
                problems=exc.error_count(),
            )
        # Only an escape can put NUL or a surrogate into JSON text: walk only then.
        problem = unstorable_text(raw) if _SUSPECT_ESCAPE.search(body) else None
        if problem is not None:
            return rejected(T.REJECT_MALFORMED, 422, f"invalid Alertmanager payload: {problem}")
        try:
            # Off the event loop: the writer's job commits, then we answer.
            outcome = await committer.commit(payload, raw, len(body))
        except StoreUnavailable as exc:
            # Counted as a rejection, and worded for Alertmanager (it retries).
            log.error("webhook: store unavailable, Alertmanager will retry: %s", exc)
            return rejected(T.REJECT_STORE_DOWN, 503, "store unavailable; retry later")
        except StoreError as exc:
            log.error("webhook: the store refused a delivery: %s", exc)
            return rejected(T.REJECT_STORE_DOWN, 500, "the store refused the delivery")
        metrics.webhooks_received.labels(payload.status).inc()
        if outcome.rejected:
            metrics.alerts_rejected.labels(T.ALERT_STARTS_AT_OUT_OF_RANGE).inc(
                len(outcome.rejected)
            )
            log.warning(
                "webhook: %d alert(s) of group %s not stored: %s",
                len(outcome.rejected),
                payload.groupKey,
                "; ".join(f"{r['fingerprint']}: {r['reason']}" for r in outcome.rejected[:5]),
            )
        for runbook in outcome.created:
            metrics.execution_created(runbook)
        if worker is not None:
            for item in outcome.resolved:
                worker.resolved.put(item)
            worker.wake()
        return JSONResponse(outcome.as_dict())

    @app.get("/healthz")
    def healthz() -> Response:
        # Healthy means deliveries can be stored: a write, rolled back (the
        # SQLite file is the one opened and writable, PostgreSQL not read-only).
        store.probe_write()
        return JSONResponse({"status": "ok", **(status() if status else {})})

    @app.get("/metrics", dependencies=read)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False, dependencies=read)
    def openapi() -> Response:
        return JSONResponse(app.openapi())

    @app.get("/api/executions", dependencies=read, responses=refusals)
    def executions(engine: str | None = None, limit: int = 50) -> Executions:
        return Executions.of(store.list_executions(engine, limit=max(1, min(limit, 1000))))

    @app.get("/api/incidents", dependencies=read, responses=refusals)
    def incidents(open_only: bool = False) -> Incidents:
        return Incidents.of(store.list_incidents(open_only=open_only))

    @app.get("/api/engines", dependencies=read, responses={401: refusals[401]})
    def engine_inventory() -> Engines:
        entries = (inventory or router.inventory or Inventory()).entries()
        return Engines([Engine.from_entry(e) for e in entries])

    @app.get("/api/pending", dependencies=read, responses=refusals)
    def pending(
        response: Response,
        engine: str | None = None,
        runbook: str | None = None,
        limit: int = PENDING_API_DEFAULT,
        before: int | None = None,
    ) -> PendingApprovals:
        # Newest first, a page at a time: X-Total-Count (all that match),
        # X-Rest-Count (older than this page) and, when there are more, a Link
        # to the next page (`before` = the last id of this one).
        limit = max(1, min(limit, PENDING_API_MAX))
        page = store.pending_page(limit=limit, engine=engine, runbook=runbook, before=before)
        response.headers["X-Total-Count"] = str(page.total)
        response.headers["X-Rest-Count"] = str(page.rest)
        if page.rest:
            query = {"engine": engine, "runbook": runbook, "limit": limit}
            query["before"] = page.records[-1].id
            given = urlencode({k: v for k, v in query.items() if v is not None})
            response.headers["Link"] = f'</api/pending?{given}>; rel="next"'
        return PendingApprovals.of(page.records)

    def engine_state(engine: EngineConfig) -> EngineState:
        current = inventory or router.inventory
        try:
            token = current.token(engine.agent) if current is not None else None
            state = EngineClient(engine.agent, token=token, timeout=engine_timeout_s).state()
        except (EngineClientError, TokenError) as exc:  # down, not an agent: said, not raised
            return EngineState(
                name=engine.name, agent=engine.agent, up=False, error=str(exc), state=None
            )
        return EngineState(name=engine.name, agent=engine.agent, up=True, error=None, state=state)

    @app.get("/api/engines/state", dependencies=read, responses={401: refusals[401]})
    async def engine_states() -> EngineStates:
        # The inventory's engines (static and discovered) where there is one, else
        # `engines`. Every agent at once: the answer costs the slowest engine, not the sum.
        current = inventory or router.inventory
        listed = current.engines() if current is not None else tuple(engines)
        rows = await asyncio.gather(*(asyncio.to_thread(engine_state, e) for e in listed))
        return EngineStates(list(rows))

    @app.get("/api/whoami", responses={401: refusals[401]})
    def whoami(who: str = Depends(access.decider)) -> WhoAmI:
        return WhoAmI(who=who)

    async def decide(
        request: Request, execution_id: int, decision: str, who: str
    ) -> Decision | Response:
        body: dict[str, Any] = {}
        raw = await request.body()
        if raw.strip():
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                return _error(400, "body is not JSON")
            except RecursionError:
                return _error(400, "body is not JSON: nested too deeply")
            if not isinstance(body, dict) or not isinstance(body.get("note"), str | None):
                return _error(422, 'body: {"note": "..."} (a string, optional)')
            if "by" in body:
                return _error(
                    422,
                    'body: "by" is not accepted: the journal records who answered from the '
                    "credentials (the basic-auth user, or the token's webhook.token_name)",
                )
        # No such execution (404), a note the journal refuses (422), the store
        # down (503): the app's store_error handler.
        result = await asyncio.to_thread(
            store.decide,
            execution_id,
            decision,
            who[:256],
            body.get("note"),
            timeout_s=approval_timeout_s,
        )
        if not result.ok:
            code = 410 if result.outcome == TOO_LATE else 409
            # ApiError's shape; the execution as Execution answers it (to_dict, field for field).
            return _error(code, result.message, execution=result.record.to_dict())
        if (
            result.record.status == ExecutionStatus.REFUSED
        ):  # rejected: final, counted like a refusal
            metrics.execution_finished(result.record)
        if worker is not None:
            worker.wake()
        return Decision(message=result.message, execution=Execution.from_record(result.record))

    # The refusals are answered as responses; the 200 answer is a Decision.
    @app.post(
        "/api/executions/{execution_id}/approve",
        response_model=Decision,
        responses=decision_refusals,
    )
    async def approve(
        request: Request, execution_id: int, who: str = Depends(access.decider)
    ) -> Decision | Response:
        return await decide(request, execution_id, ApprovalState.APPROVED, who)

    @app.post(
        "/api/executions/{execution_id}/reject",
        response_model=Decision,
        responses=decision_refusals,
    )
    async def reject(
        request: Request, execution_id: int, who: str = Depends(access.decider)
    ) -> Decision | Response:
        return await decide(request, execution_id, ApprovalState.REJECTED, who)

    mount_page(app, store, access, worker, approval_timeout_s=approval_timeout_s)
    return app
