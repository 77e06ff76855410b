"""The `runbook serve` ASGI app.

POST /webhooks/alertmanager   Alertmanager webhook v4 (bearer or basic auth)
GET  /healthz                 liveness, and whether the store answers
GET  /metrics                 the service's own metrics
GET  /openapi.json            the API's schema (no Swagger UI: it would load a CDN's script)
GET  /api/executions          the journal (JSON)
GET  /api/incidents           incidents recorded by the rule evaluator (JSON)
GET  /api/pending             executions awaiting approval (JSON)
POST /api/executions/{id}/approve|reject   a person's answer (the webhook's
                              credentials, which name who answered; JSON body {"note": ...})
GET  /                        the on-call page (service/page.py)

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
import base64
import hmac
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from vllm_runbook.rules.config import LimitsConfig
from vllm_runbook.runbooks.service import telemetry as T
from vllm_runbook.runbooks.service.alertmanager import WebhookPayload, unstorable_text
from vllm_runbook.runbooks.service.browser import BrowserGuard, BrowserPolicy, unknown_host
from vllm_runbook.runbooks.service.limits import BODY_TOO_LARGE, WEBHOOK_PATH, RequestLimits
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.service.webhooks import GroupCommitter, Router
from vllm_runbook.runbooks.service.worker import Worker
from vllm_runbook.runbooks.store import (
    ExecutionNotFound,
    InvalidInput,
    Store,
    StoreError,
    StoreUnavailable,
)
from vllm_runbook.runbooks.store.approvals import DEFAULT_APPROVAL_TIMEOUT_S, TOO_LATE
from vllm_runbook.runbooks.store.models import ApprovalState, ExecutionStatus

log = logging.getLogger("vllm_runbook.service")

_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


@dataclass(frozen=True)
class Credentials:
    """What Alertmanager's http_config sends: a bearer token or basic auth.
    `name`: who a decision made with the token is recorded as (basic auth
    records its user name)."""

    token: str | None = None
    username: str | None = None
    password: str | None = None
    name: str = "webhook token"

    @property
    def secret(self) -> str:
        return self.token or self.password or ""

    def check(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self.token:
            return hmac.compare_digest(value.encode(), self.token.encode())
        if scheme.lower() == "basic" and self.username is not None and self.password:
            try:
                user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
            return hmac.compare_digest(user.encode(), self.username.encode()) & hmac.compare_digest(
                password.encode(), self.password.encode()
            )
        return False

    def identity(self, header: str | None) -> str | None:
        """Who these credentials say is asking: the basic-auth user name or the
        token's configured name, once `check` accepted the header; else None."""
        if not self.check(header):
            return None
        scheme = (header or "").partition(" ")[0].lower()
        return self.name if scheme == "bearer" else self.username


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def create_app(
    store: Store,
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
) -> FastAPI:
    """The app; `status` adds to /healthz (e.g. whether this replica leads the rules).
    `protect_reads`: the reads and the page need `credentials` or
    `read_credentials` (`runbook serve` sets it when bound off loopback).
    `approval_timeout_s`: how long an execution awaits approval.
    `browser`: the names the service answers to and its page sessions
    (default: loopback names only, sessions signed with `credentials`).
    `limits`: the webhook's body limit and the body-read timeout (the
    configuration's `limits`; the rest of it is uvicorn's, set by serve)."""
    if not credentials.token and not credentials.password:
        raise ValueError("the webhook needs a token or basic-auth credentials")
    browser = browser or BrowserPolicy.build(credentials.secret)

    def read_refusal(request: Request) -> Response | None:
        """None when `request` may read; else the answer that says why not."""
        header = request.headers.get("authorization")
        if credentials.check(header) or (
            read_credentials is not None and read_credentials.check(header)
        ):
            return None
        if protect_reads:
            return unauthorized()
        # Open on loopback, but only under the service's own names: a DNS name
        # rebound to 127.0.0.1 would let another site's script read it.
        if not browser.host_allowed(request.headers.get("host")):
            return unknown_host(request.headers.get("host"))
        return None

    def unauthorized() -> JSONResponse:
        return JSONResponse(
            {"error": "unauthorized"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="vllm-runbook"'},
        )

    metrics = metrics or ServiceMetrics()
    committer = GroupCommitter(store, router)
    # No Swagger UI or ReDoc (they load a CDN's script); the schema is a guarded read.
    app = FastAPI(
        title="vllm-runbook", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(BrowserGuard, policy=browser)
    app.router.on_shutdown.append(committer.close)

    def refused(path: str, reason: str) -> None:
        metrics.requests_refused.labels(reason).inc()
        if path == WEBHOOK_PATH and reason == BODY_TOO_LARGE:
            metrics.webhooks_rejected.labels(T.REJECT_MALFORMED).inc()

    app.add_middleware(RequestLimits, limits=limits or LimitsConfig(), on_refused=refused)
    app.state.refused = refused  # the server's header timeout counts there too

    def rejected(reason: str, status_code: int, message: str, **extra: Any) -> JSONResponse:
        metrics.webhooks_rejected.labels(reason).inc()
        return _error(status_code, message, **extra)

    @app.post(WEBHOOK_PATH)
    async def alertmanager(request: Request) -> Response:
        if not credentials.check(request.headers.get("authorization")):
            metrics.webhooks_rejected.labels(T.REJECT_AUTH).inc()
            return JSONResponse(
                {"error": "unauthorized"},
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="vllm-runbook"'},
            )
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
            # Off the event loop: the writer thread commits, then we answer.
            outcome = await asyncio.wrap_future(committer.submit(payload, raw, len(body)))
        except StoreUnavailable as exc:
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
        try:
            store.probe_write()
        except StoreError as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse({"status": "ok", **(status() if status else {})})

    @app.get("/metrics")
    def prometheus_metrics(request: Request) -> Response:
        if (refusal := read_refusal(request)) is not None:
            return refusal
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(request: Request) -> Response:
        if (refusal := read_refusal(request)) is not None:
            return refusal
        return JSONResponse(app.openapi())

    @app.get("/api/executions")
    def executions(request: Request, engine: str | None = None, limit: int = 50) -> Response:
        if (refusal := read_refusal(request)) is not None:
            return refusal
        try:
            rows = store.list_executions(engine, limit=max(1, min(limit, 1000)))
        except StoreError as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse([r.to_dict() for r in rows])

    @app.get("/api/incidents")
    def incidents(request: Request, open_only: bool = False) -> Response:
        if (refusal := read_refusal(request)) is not None:
            return refusal
        try:
            rows = store.list_incidents(open_only=open_only)
        except StoreError as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse([r.to_dict() for r in rows])

    @app.get("/api/pending")
    def pending(request: Request) -> Response:
        if (refusal := read_refusal(request)) is not None:
            return refusal
        try:
            rows = store.pending_approvals()
        except StoreError as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse([r.to_dict() for r in rows])

    async def decide(request: Request, execution_id: int, decision: str) -> Response:
        # Who answered is who the credentials say (never a name the body claims).
        who = credentials.identity(request.headers.get("authorization"))
        if who is None:
            return unauthorized()
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
        try:
            result = await asyncio.to_thread(
                store.decide,
                execution_id,
                decision,
                who[:256],
                body.get("note"),
                timeout_s=approval_timeout_s,
            )
        except ExecutionNotFound as exc:
            return _error(404, str(exc))
        except InvalidInput as exc:
            return _error(422, str(exc))
        except StoreError as exc:
            return _error(503, f"store unavailable: {exc}")
        if not result.ok:
            code = 410 if result.outcome == TOO_LATE else 409
            return _error(code, result.message, execution=result.record.to_dict())
        if (
            result.record.status == ExecutionStatus.REFUSED
        ):  # rejected: final, counted like a refusal
            metrics.execution_finished(result.record)
        if worker is not None:
            worker.wake()
        return JSONResponse({"message": result.message, "execution": result.record.to_dict()})

    @app.post("/api/executions/{execution_id}/approve")
    async def approve(request: Request, execution_id: int) -> Response:
        return await decide(request, execution_id, ApprovalState.APPROVED)

    @app.post("/api/executions/{execution_id}/reject")
    async def reject(request: Request, execution_id: int) -> Response:
        return await decide(request, execution_id, ApprovalState.REJECTED)

    from vllm_runbook.runbooks.service.page import mount_page

    mount_page(
        app,
        store,
        credentials,
        worker,
        browser,
        approval_timeout_s=approval_timeout_s,
        read_refusal=read_refusal,
        open_on_loopback=not protect_reads,
    )
    return app
