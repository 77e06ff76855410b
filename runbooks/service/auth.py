"""Who may do what on `runbook serve`: the credentials and the routes' FastAPI dependencies.

    access = Access(credentials, read_credentials, browser, protect_reads=..., metrics=...)
    @app.get("/api/executions", dependencies=[Depends(access.reader)])
    async def approve(..., who: str = Depends(access.decider))

- `webhook`: Alertmanager's credentials (bearer token or basic auth); a
  refusal is counted in the webhook's rejections.
- `reader`: the reads (/api, /metrics, /openapi.json): the webhook's
  credentials or the read token; bound to loopback (no `protect_reads`)
  open, but only under the service's own names (a rebound DNS name gets 400).
- `decider`: an answer to an approval: the webhook's credentials, and the
  name they record the answer under.
- `page_reader` / `page_actor`: the on-call page (service/page.py): its own
  names only; off loopback the read credentials (an answer: the webhook's).

A dependency refuses by raising `Refusal` with the answer to send (the
bodies and status codes the API documents); the app's handler sends it.
"""

from __future__ import annotations

import base64
import hmac
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from vllm_runbook.runbooks.service import telemetry as T
from vllm_runbook.runbooks.service.browser import BrowserPolicy, unknown_host
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics


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


class Refusal(Exception):
    """Raised by a dependency: `response` is the answer (401, 400, ...)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def send_refusal(_request: Request, exc: Exception) -> Response:
    """The app's handler for `Refusal`."""
    assert isinstance(exc, Refusal)
    return exc.response


def unauthorized() -> JSONResponse:
    return JSONResponse(
        {"error": "unauthorized"},
        status_code=401,
        headers={"WWW-Authenticate": 'Bearer realm="vllm-runbook"'},
    )


@dataclass(frozen=True)
class Access:
    credentials: Credentials
    browser: BrowserPolicy
    metrics: ServiceMetrics
    read_credentials: Credentials | None = None
    protect_reads: bool = False  # off loopback: the reads and the page need credentials

    def read_refusal(self, request: Request) -> Response | None:
        """None when `request` may read; else the answer that says why not."""
        header = request.headers.get("authorization")
        if self.credentials.check(header) or (
            self.read_credentials is not None and self.read_credentials.check(header)
        ):
            return None
        if self.protect_reads:
            return unauthorized()
        # Open on loopback, but only under the service's own names: a DNS name
        # rebound to 127.0.0.1 would let another site's script read it.
        if not self.browser.host_allowed(request.headers.get("host")):
            return unknown_host(request.headers.get("host"))
        return None

    # --- the dependencies ------------------------------------------------------------

    def webhook(self, request: Request) -> None:
        if not self.credentials.check(request.headers.get("authorization")):
            self.metrics.webhooks_rejected.labels(T.REJECT_AUTH).inc()
            raise Refusal(unauthorized())

    def reader(self, request: Request) -> None:
        if (refusal := self.read_refusal(request)) is not None:
            raise Refusal(refusal)

    def decider(self, request: Request) -> str:
        """Who answers: who the credentials say (never a name the body claims)."""
        who = self.credentials.identity(request.headers.get("authorization"))
        if who is None:
            raise Refusal(unauthorized())
        return who

    def page_reader(self, request: Request) -> None:
        self._page_refusal(request, act=False)

    def page_actor(self, request: Request) -> None:
        # Host here; the Origin / Sec-Fetch-Site check ran before (BrowserGuard).
        self._page_refusal(request, act=True)

    def _page_refusal(self, request: Request, *, act: bool) -> None:
        if not self.browser.host_allowed(request.headers.get("host")):
            raise Refusal(unknown_host(request.headers.get("host")))
        if not self.protect_reads:
            return
        header = request.headers.get("authorization")
        if self.credentials.check(header) if act else self.read_refusal(request) is None:
            return
        scheme = "Basic" if self.credentials.password else "Bearer"
        raise Refusal(
            Response(
                "credentials required\n",
                status_code=401,
                headers={"WWW-Authenticate": f'{scheme} realm="vllm-runbook"'},
                media_type="text/plain",
            )
        )
