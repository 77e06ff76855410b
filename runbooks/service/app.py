"""The `runbook serve` ASGI app.

POST /webhooks/alertmanager   Alertmanager webhook v4 (bearer or basic auth)
GET  /healthz                 liveness, and whether the store answers
GET  /metrics                 the service's own metrics
GET  /api/executions          the journal (JSON)
GET  /api/incidents           incidents recorded by the rule evaluator (JSON)
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import ValidationError

from runbooks.service.alertmanager import WebhookPayload
from runbooks.service.webhooks import Router, ingest
from runbooks.service.worker import Worker
from runbooks.store import Store, StoreUnavailable

log = logging.getLogger("vllm_runbook.service")

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Credentials:
    """What Alertmanager's http_config sends: a bearer token or basic auth."""

    token: str | None = None
    username: str | None = None
    password: str | None = None

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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def create_app(
    store: Store, router: Router, credentials: Credentials, worker: Worker | None = None
) -> FastAPI:
    if not credentials.token and not credentials.password:
        raise ValueError("the webhook needs a token or basic-auth credentials")
    registry = CollectorRegistry()
    received = Counter(
        "vllm_runbook_service_webhooks_received",
        "Webhook deliveries accepted.",
        ["status"],
        registry=registry,
    )
    rejected = Counter(
        "vllm_runbook_service_webhooks_rejected",
        "Webhook deliveries refused.",
        ["reason"],
        registry=registry,
    )
    app = FastAPI(title="vllm-runbook", version="0.1.0")

    @app.post("/webhooks/alertmanager")
    async def alertmanager(request: Request) -> Response:
        if not credentials.check(request.headers.get("authorization")):
            rejected.labels("unauthorized").inc()
            return JSONResponse(
                {"error": "unauthorized"},
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="vllm-runbook"'},
            )
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            rejected.labels("too_large").inc()
            return _error(413, f"payload larger than {MAX_BODY_BYTES} bytes")
        try:
            # NaN/Infinity are not JSON; they would not survive the store either.
            raw = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            rejected.labels("not_json").inc()
            return _error(400, f"payload is not JSON: {exc}")
        try:
            payload = WebhookPayload.model_validate(raw)
        except ValidationError as exc:
            rejected.labels("invalid").inc()
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "payload"
            return _error(
                422,
                f"invalid Alertmanager payload: {where}: {first['msg']}",
                problems=exc.error_count(),
            )
        try:
            outcome = ingest(store, router, payload, raw)
        except StoreUnavailable as exc:
            rejected.labels("store_unavailable").inc()
            log.error("webhook: store unavailable, Alertmanager will retry: %s", exc)
            return _error(503, "store unavailable; retry later")
        received.labels(payload.status).inc()
        if worker is not None:
            for item in outcome.resolved:
                worker.resolved.put(item)
            worker.wake()
        return JSONResponse(outcome.as_dict())

    @app.get("/healthz")
    def healthz() -> Response:
        try:
            store.list_executions(limit=1)
        except StoreUnavailable as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/executions")
    def executions(engine: str | None = None, limit: int = 50) -> Response:
        try:
            rows = store.list_executions(engine, limit=max(1, min(limit, 1000)))
        except StoreUnavailable as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse([r.to_dict() for r in rows])

    @app.get("/api/incidents")
    def incidents(open_only: bool = False) -> Response:
        try:
            rows = store.list_incidents(open_only=open_only)
        except StoreUnavailable as exc:
            return _error(503, f"store unavailable: {exc}")
        return JSONResponse([r.to_dict() if hasattr(r, "to_dict") else r for r in rows])

    return app
