"""The agent's HTTP endpoint: /metrics and the control routes, on one port per
engine (VLLM_RUNBOOK_PORT + the DP rank).

    GET  /v1/state     effective and startup knobs, bounds, live stats;
                       ?since_step=N adds `since`: what happened from the step a
                       change took effect from (counter deltas, finished requests);
                       ?episode_seconds=S widens `episode` (the checks' gauges,
                       peak and mean) from the collector's window to S seconds
    POST /v1/knobs     new knob values (bearer token)
    POST /v1/restore   every knob back to its startup value (bearer token)

The requests and answers are the models of agent_api.py (its JSON Schema is
docs/agent-api.schema.json). Answers: 200 with before/after and the step
from which the change applies; 400 malformed; 401 missing or wrong token;
422 out of bounds (the message names the bound and why); 503 collector
disabled; 504 the engine did not reach a step boundary in time.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from vllm_runbook.collector.agent_api import AgentState, ErrorAnswer
from vllm_runbook.collector.auth import TokenError, check_bearer, generate_token
from vllm_runbook.collector.control import ControlError, EngineControl, parse_command
from vllm_runbook.collector.server import AgentServer, Request, Response
from vllm_runbook.collector.settings import CollectorSettings, agent_token


class Served(Protocol):
    """What the agent serves of a collector (collector/engine_collector.py's
    EngineCollector): its state, its live-change path, whether it is up."""

    enabled: bool
    error: str | None
    control: EngineControl

    @property
    def dp_rank(self) -> int: ...

    def engine_idle(self) -> bool: ...

    def state(
        self, since_step: int | None = None, episode_seconds: float | None = None
    ) -> AgentState: ...


logger = logging.getLogger("vllm_runbook.collector")


def answer(status: int, model: BaseModel) -> Response:
    return Response(status, model.model_dump_json(exclude_none=status >= 300).encode() + b"\n")


def refusal(status: int, message: str, **details: Any) -> Response:
    return answer(status, ErrorAnswer(error=message, **details))


def start_agent(
    settings: CollectorSettings, dp_rank: int, registry: CollectorRegistry, collector: Served
) -> tuple[AgentServer | None, str | None]:
    """The agent's server, serving (None when it cannot), and where its generated
    token is stored (None when the token is configured)."""
    host = settings.host
    port = settings.port + dp_rank if settings.port else 0
    try:
        token = agent_token(host)
    except TokenError as exc:
        logger.error("vllm-runbook: agent not started: %s", exc)
        return None, None
    try:
        server = AgentServer(host, port, registry, limits=settings.server_limits)
    except OSError as exc:
        logger.warning(
            "vllm-runbook: cannot serve on %s:%d (%s); set VLLM_RUNBOOK_PORT", host, port, exc
        )
        return None, None
    token_path = None
    if token is None:
        try:
            token, path = generate_token(server.port)
            token_path = str(path)
        except (OSError, TokenError) as exc:
            # Without a stored token nobody can write: serve reads only.
            logger.warning(
                "vllm-runbook: cannot store the agent token (%s); "
                "set VLLM_RUNBOOK_TOKEN to enable control",
                exc,
            )
            token = secrets.token_urlsafe(32)
    install_routes(server, collector, token)
    logger.info("vllm-runbook: engine %d agent at %s", dp_rank, server.url)
    return server.start(), token_path


def install_routes(server: AgentServer, collector: Served, token: str) -> None:
    def state(request: Request) -> Response:
        since = request.query.get("since_step")
        step = None
        if since is not None:
            try:
                step = int(since[0])
            except ValueError:
                return refusal(400, f"since_step must be an integer, not {since[0]!r}")
        asked = request.query.get("episode_seconds")
        seconds = None
        if asked is not None:
            try:
                seconds = float(asked[0])
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and seconds >= 0):
                return refusal(
                    400, f"episode_seconds must be a number of seconds >= 0, not {asked[0]!r}"
                )
        return answer(200, collector.state(since_step=step, episode_seconds=seconds))

    def bearer(request: Request) -> Response | None:
        # Checked on the request line and headers, before the body is read.
        if check_bearer(request.headers.get("authorization"), token):
            return None
        response = refusal(401, "missing or wrong bearer token")
        response.headers = {"WWW-Authenticate": 'Bearer realm="vllm-runbook"'}
        return response

    def write(restore: bool) -> Callable[[Request], Response]:
        def handler(request: Request) -> Response:
            if not collector.enabled:
                return refusal(503, f"collector disabled: {collector.error}")
            try:
                body = request.json()
            except json.JSONDecodeError as exc:
                return refusal(400, f"request body is not JSON: {exc.msg}")
            except (ValueError, RecursionError):  # not UTF-8; nested beyond reason
                return refusal(400, "request body is not JSON")
            try:
                command = parse_command(body, restore=restore)
                result = collector.control.submit(command, idle=collector.engine_idle)
            except ControlError as exc:
                return refusal(exc.status, str(exc), **exc.details)
            if result.changes and not result.dry_run:
                logger.info(
                    "vllm-runbook: engine %d knobs changed from step %d: %s",
                    collector.dp_rank,
                    result.effective_from_step,
                    ", ".join(f"{c.knob} {c.before}→{c.after}" for c in result.changes),
                )
            return answer(200, result)

        return handler

    server.routes[("GET", "/v1/state")] = state
    server.routes[("POST", "/v1/knobs")] = write(restore=False)
    server.routes[("POST", "/v1/restore")] = write(restore=True)
    for route in (("POST", "/v1/knobs"), ("POST", "/v1/restore")):
        server.guards[route] = bearer
