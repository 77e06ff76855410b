"""The on-call page of `runbook serve`: `/`, server-rendered, refreshing itself.

    GET  /                                   firing incidents, approvals, recent executions
    GET  /page.css                           its stylesheet (the CSP allows no inline style)
    POST /ui/executions/{id}/approve|reject  the page's buttons (a form; 303 back to /)

No front-end build and no script: one Jinja2 template (templates/page.html.j2)
in an autoescaping sandbox (alert labels and notes are untrusted text) and a
meta refresh. Bound off loopback, the page asks for the API's read
credentials (basic auth is what a browser can send) and an answer needs the
webhook's; on loopback it is open like the rest of the service's reads, and
an answer is recorded as "anonymous (loopback)" unless the browser sent the
webhook's credentials. Either way it answers only under the service's own
names, an answer must come from the page's own origin with the session
cookie the page set and a form token bound to it (service/browser.py).
"""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, quote, urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import FileSystemLoader, StrictUndefined, select_autoescape
from jinja2.sandbox import SandboxedEnvironment
from vllm_runbook.runbooks.run.guardrails import format_duration
from vllm_runbook.runbooks.run.render import (
    TEMPLATES_DIR,
    episode_view,
    format_change,
    format_value,
)
from vllm_runbook.runbooks.service.breaker import BREAKER_WHO
from vllm_runbook.runbooks.service.browser import (
    SECURE_SESSION_COOKIE,
    SESSION_COOKIE,
    SESSION_LIFETIME_S,
)
from vllm_runbook.runbooks.service.notify import alert_name
from vllm_runbook.runbooks.store import (
    ExecutionNotFound,
    ExecutionRecord,
    InvalidInput,
    Journal,
)
from vllm_runbook.runbooks.store.models import ApprovalState, utcnow

if TYPE_CHECKING:
    from vllm_runbook.runbooks.service.auth import Access
    from vllm_runbook.runbooks.service.worker import Worker

PAGE_TEMPLATE: Final = "page.html.j2"
PAGE_CSS: Final = TEMPLATES_DIR / "page.css"
# Who an answer from the open loopback page is recorded as: nobody was authenticated.
ANONYMOUS: Final = "anonymous (loopback)"
REFRESH_SECONDS: Final = 10
RECENT: Final = 20
# Executions awaiting approval shown at once, newest first; the rest are counted
# and paged (`?before=ID`), and filtered by engine and runbook.
PENDING_PAGE: Final = 50
# Engine/runbook pairs offered as filters (the most awaiting first).
PENDING_FILTERS: Final = 50
UI_PREFIX: Final = "/ui/"


def is_page(path: str) -> bool:
    """Whether `path` is the page's (its errors are text, not the API's JSON)."""
    return path == "/" or path.startswith(UI_PREFIX)


def _environment() -> SandboxedEnvironment:
    env = SandboxedEnvironment(
        loader=FileSystemLoader(str(TEMPLATES_DIR)),
        autoescape=select_autoescape(default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["value"] = format_value
    env.filters["change"] = format_change
    env.filters["episode_view"] = episode_view
    env.filters["when"] = lambda t: "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%SZ")
    return env


def _view(
    store: Journal,
    timeout_s: float,
    engine: str | None = None,
    runbook: str | None = None,
    before: int | None = None,
) -> dict[str, Any]:
    incidents = store.list_incidents(open_only=True)
    page = store.pending_page(limit=PENDING_PAGE, engine=engine, runbook=runbook, before=before)
    pending = page.records
    filters = {k: v for k, v in (("engine", engine), ("runbook", runbook)) if v}
    recent = store.list_executions(limit=RECENT)
    trips = store.list_executions(who=BREAKER_WHO, limit=RECENT)
    failures = store.notifications([r.id for r in recent], status="failed")
    reverted_by = {r.reverts_id: r.id for r in recent if r.reverts_id is not None}
    now = utcnow()

    def expires(r: ExecutionRecord) -> str:
        left = (r.created_at + timedelta(seconds=timeout_s) - now).total_seconds()
        return format_duration(math.ceil(left)) if left > 0 else "expired"

    return {
        "now": now,
        "refresh": REFRESH_SECONDS,
        "incidents": incidents,
        "pending": [{"e": r, "alert": alert_name(r), "expires": expires(r)} for r in pending],
        "pending_total": page.total,
        "pending_rest": page.rest,
        "pending_next": (
            "/?" + urlencode({**filters, "before": pending[-1].id}) if page.rest else None
        ),
        "pending_filters": filters,
        "pending_pairs": store.pending_counts()[:PENDING_FILTERS],
        "self_url": "/?" + urlencode(filters) if filters else "/",
        "recent": [
            {
                "e": r,
                "alert": alert_name(r),
                "reverted_by": reverted_by.get(r.id),
                "failed_notifications": failures.get(r.id, []),
            }
            for r in recent
        ],
        "open_alerts": {(i.alert, i.engine) for i in incidents},
        "holding": store.holding_executions(),
        "trips": trips,
    }


def mount_page(
    app: FastAPI,
    store: Journal,
    access: Access,
    worker: Worker | None,
    *,
    approval_timeout_s: float,
) -> None:
    """Bound to loopback (no `access.protect_reads`) the page needs no
    credentials; else reading needs the read credentials and an answer the
    webhook's (a read token shows the page, it does not act). The store's
    errors are the app's handler's (503)."""
    env = _environment()
    stylesheet = PAGE_CSS.read_text(encoding="utf-8")
    browser = access.browser
    open_on_loopback = not access.protect_reads

    def session_cookie(request: Request) -> tuple[str, bool]:
        """The session cookie's name for this request, and whether it is Secure."""
        secure = browser.secure(request.url.scheme, request.headers.get("host"))
        return (SECURE_SESSION_COOKIE if secure else SESSION_COOKIE), secure

    def answers_as(request: Request) -> str | None:
        who = access.credentials.identity(request.headers.get("authorization"))
        return who or (ANONYMOUS if open_on_loopback else None)

    @app.get("/page.css", include_in_schema=False)
    def css() -> Response:
        return Response(stylesheet, media_type="text/css", headers={"Cache-Control": "no-cache"})

    @app.get("/", response_class=HTMLResponse, dependencies=[Depends(access.page_reader)])
    def page(
        request: Request,
        msg: str | None = None,
        engine: str | None = None,
        runbook: str | None = None,
        before: int | None = None,
    ) -> Response:
        view = _view(store, approval_timeout_s, engine or None, runbook or None, before)
        name, secure = session_cookie(request)
        cookie = request.cookies.get(name)
        fresh = not browser.session_valid(cookie)
        session = browser.new_session() if fresh or cookie is None else cookie
        html = env.get_template(PAGE_TEMPLATE).render(
            message=msg, token=browser.form_token(session), answer_as=answers_as(request), **view
        )
        # no-store: the page holds a form token; a shared cache must not keep it.
        response = HTMLResponse(html, headers={"Cache-Control": "no-store"})
        if fresh:
            response.set_cookie(
                name,
                session,
                max_age=SESSION_LIFETIME_S,
                path="/",
                secure=secure,
                httponly=True,
                samesite="strict",
            )
        return response

    async def answer(request: Request) -> tuple[dict[str, str], str] | Response:
        """The form and who answers, or the refusal (token, credentials)."""
        body = await request.body()  # at most 64 KiB: RequestLimits (service/limits.py)
        form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
        name, _ = session_cookie(request)
        problem = browser.token_problem(request.cookies.get(name), form.get("token", ""))
        if problem is not None:
            return Response(problem + "\n", status_code=403, media_type="text/plain")
        who = answers_as(request)  # off loopback `page_actor` required an identity
        if who is None:
            return Response("credentials required\n", status_code=401, media_type="text/plain")
        return form, who

    async def decide(request: Request, execution_id: int, decision: str) -> Response:
        answered = await answer(request)
        if isinstance(answered, Response):
            return answered
        form, who = answered
        try:
            result = await asyncio.to_thread(
                store.decide,
                execution_id,
                decision,
                who[:256],
                form.get("note", "").strip() or None,
                timeout_s=approval_timeout_s,
            )
        except ExecutionNotFound as exc:
            message = str(exc)
        except InvalidInput as exc:
            return Response(f"{exc}\n", status_code=422, media_type="text/plain")
        else:
            message = result.message
            if result.ok and worker is not None:
                worker.wake()
        return RedirectResponse(f"/?msg={quote(message)}", status_code=303)

    act = [Depends(access.page_actor)]

    @app.post(UI_PREFIX + "executions/{execution_id}/approve", dependencies=act)
    async def approve(request: Request, execution_id: int) -> Response:
        return await decide(request, execution_id, ApprovalState.APPROVED)

    @app.post(UI_PREFIX + "executions/{execution_id}/reject", dependencies=act)
    async def reject(request: Request, execution_id: int) -> Response:
        return await decide(request, execution_id, ApprovalState.REJECTED)

    @app.post(UI_PREFIX + "executions/{execution_id}/release", dependencies=act)
    async def release(request: Request, execution_id: int) -> Response:
        """A person releases a holding execution: its revert starts now (in the
        background: a stepwise revert waits between its stages)."""
        answered = await answer(request)
        if isinstance(answered, Response):
            return answered
        _, who = answered
        if worker is None:
            return Response("no worker: release with `runbook revert N`\n", status_code=409)
        try:
            record = await asyncio.to_thread(store.get_execution, execution_id)
        except ExecutionNotFound as exc:
            return RedirectResponse(f"/?msg={quote(str(exc))}", status_code=303)
        if not record.holding:
            message = f"execution #{execution_id} is not holding ({record.display_status})"
            return RedirectResponse(f"/?msg={quote(message)}", status_code=303)
        worker.release(execution_id, who[:256])
        message = f"execution #{execution_id}: revert started, released by {who[:256]}"
        return RedirectResponse(f"/?msg={quote(message)}", status_code=303)
