"""The agent's control routes, beside /metrics on the same endpoint.

    GET  /v1/state     effective and startup knobs, bounds, live stats (JSON);
                       ?since_step=N adds `since`: what happened from the step a
                       change took effect from (counter deltas, finished requests)
    POST /v1/knobs     {"max_num_batched_tokens"|"scale_max_num_batched_tokens",
                        "max_num_seqs", "policy", "autopilot", "autopilot_target",
                        "clamp", "dry_run"}  (bearer token)
    POST /v1/restore   {"dry_run"}: every knob back to its startup value (bearer token)

Answers: 200 with before/after and the step from which the change applies;
400 malformed; 401 missing or wrong token; 422 out of bounds (the message
names the bound and why); 503 collector disabled; 504 the engine did not
reach a step boundary in time.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector.auth import check_bearer
from vllm_runbook.collector.control import ControlError, parse_command
from vllm_runbook.collector.server import AgentServer, Request, Response

if TYPE_CHECKING:
    from vllm_runbook.collector.hook import EngineCollector

logger = logging.getLogger("vllm_runbook.collector")


def install_routes(server: AgentServer, collector: EngineCollector, token: str) -> None:
    def state(request: Request) -> Response:
        since = request.query.get("since_step")
        if since is None:
            return Response.json(200, collector.state())
        try:
            step = int(since[0])
        except ValueError:
            return Response.json(400, {"error": f"since_step must be an integer, not {since[0]!r}"})
        return Response.json(200, collector.state(since_step=step))

    def bearer(request: Request) -> Response | None:
        # Checked on the request line and headers, before the body is read.
        if check_bearer(request.headers.get("authorization"), token):
            return None
        return Response(
            401,
            b'{"error": "missing or wrong bearer token"}\n',
            headers={"WWW-Authenticate": 'Bearer realm="vllm-runbook"'},
        )

    def write(restore: bool) -> Any:
        def handler(request: Request) -> Response:
            if not collector.enabled:
                return Response.json(503, {"error": f"collector disabled: {collector.error}"})
            try:
                body = request.json()
            except json.JSONDecodeError as exc:
                return Response.json(400, {"error": f"request body is not JSON: {exc.msg}"})
            except (ValueError, RecursionError):  # not UTF-8; nested beyond reason
                return Response.json(400, {"error": "request body is not JSON"})
            try:
                command = parse_command(body, restore=restore)
                result = collector.control.submit(command, idle=collector.engine_idle)
            except ControlError as exc:
                return Response.json(exc.status, {"error": str(exc), **exc.details})
            if result["changes"] and not result["dry_run"]:
                logger.info(
                    "vllm-runbook: engine %d knobs changed from step %d: %s",
                    collector.dp_rank,
                    result["effective_from_step"],
                    ", ".join(f"{c['knob']} {c['before']}→{c['after']}" for c in result["changes"]),
                )
            return Response.json(200, result)

        return handler

    server.routes[("GET", "/v1/state")] = state
    server.routes[("POST", "/v1/knobs")] = write(restore=False)
    server.routes[("POST", "/v1/restore")] = write(restore=True)
    for route in (("POST", "/v1/knobs"), ("POST", "/v1/restore")):
        server.guards[route] = bearer
