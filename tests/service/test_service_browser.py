"""The on-call page against other sites, in a real browser (Debian's chromium,
headless, through selenium): `runbook serve` on loopback with one execution
awaiting approval, the on-call's browser holding the page, and a page of
another origin (another loopback address, or another port of the same one)
that tries to approve it: a form that submits itself, the page in an iframe
(clickjacking), the page under a name that resolves to loopback (DNS
rebinding). None may approve; the journal says so, and the screenshots (in
the test's tmp dir) show what the browser showed."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.service.chromium import chromium, wait_until
from tests.service.processes import RunbookServe
from tests.service.test_service_webhooks import payload

TOKEN = "browser-webhook-token"
REBOUND = "rebind.example"  # an attacker's name the browser resolves to 127.0.0.1
APPROVE_GREEN = "rgba(34, 170, 119, 1)"  # .approve in page.css: #2a7


class Site:
    """Another origin: one HTML page at http://HOST:PORT/ (the attacker's)."""

    def __init__(self, host: str, html: str) -> None:
        body = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def site(host: str, html: str) -> Iterator[Site]:
    s = Site(host, html)
    try:
        yield s
    finally:
        s.close()


@contextlib.contextmanager
def service(tmp_path: Path) -> Iterator[tuple[RunbookServe, int]]:
    """`runbook serve` on loopback (no worker: an approval is recorded, nothing
    runs) with one oom-pressure execution awaiting approval."""
    (tmp_path / "webhook.token").write_text(TOKEN + "\n")
    config = {
        "database": f"sqlite:///{tmp_path / 'runbook.db'}",
        "engines": [
            {
                "name": "cpu-0",
                "agent": "http://127.0.0.1:9",
                "labels": {"instance": "10.1.2.3:8000"},
            }
        ],
        "automation": {"oom-pressure": "approve"},
        "webhook": {"token_file": str(tmp_path / "webhook.token")},
    }
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with RunbookServe.run(cfg, tmp_path / "serve.log", "--no-rules", "--no-worker") as svc:
        request = urllib.request.Request(
            svc.url + "/webhooks/alertmanager",
            json.dumps(payload()).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            [created] = json.loads(response.read())["executions"]
        assert created["mode"] == "approve"
        yield svc, created["id"]


def journal(svc: RunbookServe, ex: int) -> tuple[str, str | None, str | None]:
    """(status, decision, decided_by) of execution `ex`, as the journal has it."""
    [record] = [r for r in svc.get("/api/executions") if r["id"] == ex]
    return record["status"], record["decision"], record["decided_by"]


def token_of(html: str) -> str:
    found = re.search(r'name="token" value="([^"]+)"', html)
    assert found is not None, html
    return found[1]


def self_submitting_form(action: str, token: str) -> str:
    return f"""<!doctype html><title>GPU prices</title>
<form id="f" method="post" action="{action}">
<input name="token" value="{token}"><input name="note" value="from another site">
<input name="by" value="mallory"></form>
<script>document.getElementById("f").submit()</script>"""


def body_text(browser: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.TAG_NAME, "body").text)


def test_a_form_on_another_origin_cannot_approve(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with service(tmp_path) as (svc, ex), chromium() as browser:
        # The on-call has the page open (its session cookie is in the browser).
        browser.get(svc.url + "/")
        button = browser.find_element(By.ID, f"approve-{ex}")
        assert button.value_of_css_property("background-color") == APPROVE_GREEN  # page.css loads
        browser.save_screenshot(str(tmp_path / "page.png"))
        # The attacker loaded the page once too, and carries the token it was given.
        token = token_of(httpx.get(svc.url + "/", timeout=10).text)
        action = f"{svc.url}/ui/executions/{ex}/approve"
        port = svc.url.rsplit(":", 1)[1]
        # Another loopback address (cross-site), and another port of the service's
        # own address (same site, another origin: SameSite cookies are still sent).
        for name, host in (("other-address", "127.0.0.2"), ("other-port", "127.0.0.1")):
            with site(host, self_submitting_form(action, token)) as attacker:
                assert not attacker.url.endswith(f":{port}/")
                browser.get(attacker.url)
                wait_until(
                    "the form submitted itself",
                    lambda: browser.current_url.startswith(svc.url),
                    30,
                )
                browser.save_screenshot(str(tmp_path / f"cross-site-form-{name}.png"))
                assert journal(svc, ex) == ("pending", None, None)
                assert body_text(browser) == (
                    "cross-site request refused: this service answers state changes only "
                    "from its own pages"
                )
        assert [p["id"] for p in svc.get("/api/pending")] == [ex]


def test_the_page_in_another_sites_frame_shows_nothing_to_click(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with service(tmp_path) as (svc, ex), chromium() as browser:
        browser.get(svc.url + "/")  # the on-call's session, as in a real visit
        framing = f"""<!doctype html><title>team dashboard</title><h1>Team dashboard</h1>
<iframe id="frame" src="{svc.url}/" width="1200" height="800"></iframe>"""
        with site("127.0.0.2", framing) as attacker:
            browser.get(attacker.url)  # returns after the load event: the frame's too
            browser.switch_to.frame(browser.find_element(By.ID, "frame"))
            buttons = browser.find_elements(By.ID, f"approve-{ex}")
            framed_title = browser.title
            if buttons:  # what a visitor tricked into clicking would do
                buttons[0].click()
            browser.switch_to.default_content()
            browser.save_screenshot(str(tmp_path / "framed.png"))
        assert buttons == []
        assert framed_title != "vllm-runbook on call"
        assert journal(svc, ex) == ("pending", None, None)


class RebindingSite:
    """DNS rebinding, as the service sees it: the attacker's name first served
    the attacker's page (/attack), then resolves to the service, so the page's
    own-origin requests reach the service under the attacker's Host. Listens on
    127.0.0.2 with the service's port; the browser maps the name here."""

    def __init__(self, service_port: int, html: str) -> None:
        page = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                if self.path == "/attack":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.send_header("Content-Length", str(len(page)))
                    self.end_headers()
                    self.wfile.write(page)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn = http.client.HTTPConnection("127.0.0.1", service_port, timeout=30)
                conn.request(self.command, self.path, body, headers)  # Host unchanged
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.2", service_port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_name_rebound_to_loopback_reads_nothing_and_approves_nothing(tmp_path: Path) -> None:
    """The attacker's script runs on its own origin (rebind.example:PORT) and
    asks the service for the page, the journal, and an approval."""
    from selenium.webdriver.common.by import By

    with service(tmp_path) as (svc, ex):
        port = int(svc.url.rsplit(":", 1)[1])
        # The token of a page the attacker loaded directly (as today's fixed one was).
        token = token_of(httpx.get(svc.url + "/", timeout=10).text)
        script = f"""<!doctype html><title>rebinding</title><pre id="out">running</pre>
<script>
(async () => {{
  const page = await fetch("/");
  const pending = await fetch("/api/pending");
  const approve = await fetch("/ui/executions/{ex}/approve", {{method: "POST",
    body: new URLSearchParams({{token: "{token}", note: "rebound"}})}});
  document.getElementById("out").textContent =
    `page ${{page.status}}, pending ${{pending.status}}, approve ${{approve.status}}`;
}})();
</script>"""
        attacker = RebindingSite(port, script)
        try:
            with chromium(f"--host-resolver-rules=MAP {REBOUND} 127.0.0.2") as browser:
                browser.get(f"http://{REBOUND}:{port}/attack")
                out = wait_until(
                    "the attacker's script finished",
                    lambda: (t := browser.find_element(By.ID, "out").text) != "running" and t,
                    30,
                )
                browser.save_screenshot(str(tmp_path / "rebound-script.png"))
                browser.get(f"http://{REBOUND}:{port}/")
                browser.save_screenshot(str(tmp_path / "rebound-page.png"))
                shown = body_text(browser)
        finally:
            attacker.close()
        assert out == "page 400, pending 400, approve 403"
        assert shown == f"unknown Host {REBOUND}:{port}: this service answers to its own names only"
        assert journal(svc, ex) == ("pending", None, None)
