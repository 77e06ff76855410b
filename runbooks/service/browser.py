"""What `runbook serve` requires of a browser: the on-call page acts on live
engines, so another site must not be able to act through a visitor's browser.

- Host: the page, and every read served without credentials (loopback), answers
  only to its own names: loopback names and addresses, the bind address, the
  host of `notifications.page_url`, and `page.hosts`. A name that merely
  resolves to 127.0.0.1 (DNS rebinding) gets 400.
- Origin: a state-changing request (any method but GET/HEAD/OPTIONS, on every
  route) that a browser marks as coming from another origin is refused:
  `Sec-Fetch-Site` other than `same-origin`, or an `Origin` that is neither
  this request's own (`scheme://Host`, the Host allowed) nor page_url's.
  Alertmanager and curl send neither header; the page's forms must send one.
- Session: the page sets a random session cookie (HttpOnly, SameSite=Strict,
  Secure over https or behind an https page_url) and each form carries a token
  bound to that session that expires. Both are signed with a key derived from
  the webhook's credentials, so every replica checks what any replica issued.
- Framing and content: every answer carries X-Frame-Options DENY and a CSP
  with `frame-ancestors 'none'` and no inline script or style.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm_runbook.collector.auth import is_loopback

SESSION_LIFETIME_S: Final = 12 * 3600
FORM_TOKEN_LIFETIME_S: Final = 30 * 60
SESSION_COOKIE: Final = "runbook-session"
# A Secure cookie with this prefix cannot be set by a sibling host or over http.
SECURE_SESSION_COOKIE: Final = "__Host-runbook-session"
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# The page needs its own stylesheet and its own forms, nothing else: no script.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS: Final = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    # same-origin: a same-origin form still sends its Origin (no-referrer would send "null").
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
CROSS_SITE: Final = (
    "cross-site request refused: this service answers state changes only from its own pages"
)
WILDCARD_BINDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})


def host_name(host_header: str | None) -> str | None:
    """The name in a Host header, lowercased, without port or IPv6 brackets."""
    if not host_header:
        return None
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _origin(url: str) -> str | None:
    """`scheme://host[:port]` as a browser writes an Origin (no default port), or None."""
    parts = urlsplit(url.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default = {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")


@dataclass(frozen=True)
class BrowserPolicy:
    """The names the service answers to, and the signer of its page sessions."""

    key: bytes
    hosts: frozenset[str] = frozenset()  # beyond loopback: lowercase names, no port
    page_origin: str | None = None  # scheme://host[:port] of notifications.page_url
    clock: Callable[[], float] = field(default=time.time, compare=False)

    @classmethod
    def build(
        cls,
        secret: str,
        *,
        page_url: str | None = None,
        hosts: Iterable[str] = (),
        bind_host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> BrowserPolicy:
        """`secret`: the webhook's token or password (the same on every replica)."""
        key = hmac.new(secret.encode(), b"vllm-runbook page sessions v1", hashlib.sha256).digest()
        names = {h.strip().lower() for h in hosts if h.strip()}
        origin = _origin(page_url) if page_url else None
        if origin is not None and (name := urlsplit(origin).hostname):
            names.add(name)
        if bind_host is not None and bind_host not in WILDCARD_BINDS:
            names.add(bind_host.strip("[]").lower())
        return cls(key, frozenset(names), origin, clock)

    # --- Host and Origin -------------------------------------------------------------

    def host_allowed(self, host_header: str | None) -> bool:
        name = host_name(host_header)
        return name is not None and (is_loopback(name) or name in self.hosts)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """`origin` is this request's own origin (or page_url's)."""
        own = _origin(origin)
        if own is None:  # "null" (a sandboxed frame, a data: URL) or garbage
            return False
        if own == self.page_origin:
            return True
        netloc = urlsplit(own).netloc
        own_host = (host_header or "").strip().lower()
        return netloc == own_host and self.host_allowed(host_header)

    def cross_site(self, headers: Headers, *, browser_form: bool) -> bool:
        """A state-changing request from another origin, as the browser tells it.
        `browser_form`: the page's own routes, which a browser always marks."""
        site = headers.get("sec-fetch-site")
        origin = headers.get("origin")
        if site is not None and site != "same-origin":
            return True
        if origin is not None and not self.origin_allowed(origin, headers.get("host")):
            return True
        return browser_form and site is None and origin is None

    def secure(self, scheme: str, host_header: str | None) -> bool:
        """Whether the browser reached the page over https: directly, or through
        the https page_url (a proxy in front; loopback stays plain http)."""
        if scheme == "https":
            return True
        name = host_name(host_header)
        https_page = self.page_origin is not None and self.page_origin.startswith("https:")
        return https_page and name is not None and not is_loopback(name)

    # --- sessions and form tokens ----------------------------------------------------

    def _mac(self, *parts: str) -> str:
        return hmac.new(self.key, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def _signed(self, mac: str, *parts: str) -> bool:
        # Bytes: compare_digest refuses str with non-ASCII (a client's cookie or form).
        return hmac.compare_digest(mac.encode(), self._mac(*parts).encode())

    def new_session(self) -> str:
        issued, nonce = str(int(self.clock())), secrets.token_urlsafe(24)
        return f"{issued}.{nonce}.{self._mac('session', issued, nonce)}"

    def session_valid(self, session: str | None) -> bool:
        try:
            issued, nonce, mac = (session or "").split(".")
            age = self.clock() - int(issued)
        except ValueError:
            return False
        return self._signed(mac, "session", issued, nonce) and 0 <= age < SESSION_LIFETIME_S

    def form_token(self, session: str) -> str:
        expires, nonce = str(int(self.clock()) + FORM_TOKEN_LIFETIME_S), secrets.token_urlsafe(16)
        return f"{expires}.{nonce}.{self._mac('form', session, expires, nonce)}"

    def token_problem(self, session: str | None, token: str) -> str | None:
        """Why `token` does not answer for this session (None: it does)."""
        if not self.session_valid(session):
            return "no page session (or it expired): reload the page; it needs its cookie"
        assert session is not None
        try:
            expires, nonce, mac = token.split(".")
            left = int(expires) - self.clock()
        except ValueError:
            return "stale or foreign form: reload the page"
        if not self._signed(mac, "form", session, expires, nonce):
            return "stale or foreign form: reload the page"
        if left <= 0:
            return "the form expired: reload the page"
        return None


def unknown_host(host_header: str | None) -> PlainTextResponse:
    """400 for a Host the service does not answer to (`host_allowed` said no)."""
    host = (host_header or "(none)")[:200]
    return PlainTextResponse(
        f"unknown Host {host}: this service answers to its own names only\n", status_code=400
    )


class BrowserGuard:
    """ASGI middleware: refuses cross-site state changes (all routes), and adds
    the framing/content headers to every answer."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy, form_prefix: str = "/ui/") -> None:
        self.app = app
        self.policy = policy
        self.form_prefix = form_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(n, v) for n, v in SECURITY_HEADERS if n not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if scope["method"] not in SAFE_METHODS:
            headers = Headers(scope=scope)
            form = str(scope.get("path", "")).startswith(self.form_prefix)
            if self.policy.cross_site(headers, browser_form=form):
                response: Any = PlainTextResponse(CROSS_SITE + "\n", status_code=403)
                await response(scope, receive, send_with_headers)
                return
        await self.app(scope, receive, send_with_headers)
