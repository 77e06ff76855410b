"""HTTP GETs for the embedded evaluator's scrapes and discovery's calls: aiohttp's client.

Why aiohttp: `python benchmarks/rules_eval.py --engines 1000 --modes concurrent
streams --rounds 3` compares it, side by side in alternated rounds, with the
hand-written HTTP/1.1 client over asyncio streams this module held before
(kept in that script): aiohttp spent 1.25x, 1.34x and 1.57x its CPU per
request in three runs on a loaded machine (docs/benchmarks.md). The rule was:
the library unless it costs more than 1.5x (the median run: 1.34x); a widely
used client (C-accelerated parser, already in every vLLM environment) beats
one we maintain. httpx was ruled out before (10-100x the CPU per response).

One session per Fetcher, created on the loop that first uses it, keeps one
pooled, kept-alive connection per target (as Prometheus does). No redirects,
no decompression (none is asked for), no proxies from the environment; a body
over MAX_BODY is an error, not a scrape.
"""

from __future__ import annotations

import base64
import ssl
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

MAX_BODY = 64 * 2**20  # an exposition larger than this is an error, not a scrape
KEEP_ALIVE_S = 120.0  # an idle connection outlives a scrape interval and a refresh
MAX_URLS = 100_000  # parsed URLs kept (a fleet's targets, filtered and whole)


class FetchError(Exception):
    """The target did not give a usable HTTP response (message: one line)."""


class Fetcher:
    """GETs URLs on one pooled session. Use from one event loop; `aclose` on it."""

    def __init__(
        self,
        user_agent: str = "vllm-runbook-rules",
        *,
        ssl_context: ssl.SSLContext | None = None,
        auth: tuple[str, str] | None = None,
        accept: str = "text/plain;version=0.0.4",
    ) -> None:
        self.user_agent = user_agent
        self.ssl_context = ssl_context
        # Basic auth in UTF-8, as Prometheus' own clients send it (aiohttp's
        # default is latin-1: a non-ASCII password would not match).
        self.authorization = (
            "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            if auth is not None
            else None
        )
        self.accept = accept
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}  # URL text -> parsed, for the URLs asked before

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=0,  # the caller bounds the requests in flight
                limit_per_host=0,
                ssl=self.ssl_context if self.ssl_context is not None else True,
                keepalive_timeout=KEEP_ALIVE_S,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # identity: no compression asked for (aiohttp asks gzip by default),
                # none to undo: the scrape's CPU goes to the parse.
                headers={
                    "User-Agent": self.user_agent,
                    "Accept": self.accept,
                    "Accept-Encoding": "identity",
                    **({"Authorization": self.authorization} if self.authorization else {}),
                },
                auto_decompress=False,
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None),  # the caller's timeout
            )
        return self._session

    async def get(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """(status, body). OSError (connect: refused, unreachable) or FetchError when
        it fails; cancelling it (a timeout) closes the connection."""
        parsed = self._urls.get(url)
        if parsed is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise FetchError(f"not an http(s) URL: {url}")
            if len(self._urls) >= MAX_URLS:
                self._urls.clear()
            # parsed once: a scrape asks the same URLs every cycle (each parse of a
            # filtered one costs ~20 us, 40 ms a cycle at 2,000 targets)
            parsed = self._urls[url] = URL(url)
        try:
            async with self._open().get(parsed, headers=headers, allow_redirects=False) as response:
                length = response.content_length
                if length is not None and length > MAX_BODY:
                    raise FetchError(f"body of {length} bytes (at most {MAX_BODY})")
                chunks: list[bytes] = []
                total = 0
                async for chunk in response.content.iter_chunked(2**16):
                    total += len(chunk)
                    if total > MAX_BODY:
                        raise FetchError(f"body over {MAX_BODY} bytes")
                    chunks.append(chunk)
                return response.status, b"".join(chunks)
        except aiohttp.ClientConnectorError as exc:
            raise exc.os_error from None  # e.g. ConnectionRefusedError, as a socket says it
        except aiohttp.ClientError as exc:
            text = str(exc).strip().splitlines()
            raise FetchError(f"{type(exc).__name__}: {text[0] if text else ''}".strip()) from None

    def forget(self, url: str) -> None:
        """A target that went away: its pooled connection idles out (KEEP_ALIVE_S)."""

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
