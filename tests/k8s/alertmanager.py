"""An AlertmanagerConfig (monitoring.coreos.com/v1alpha1) as the Prometheus Operator
merges it into Alertmanager's configuration, for amtool to check and route.

Only what our object uses: a route with matchers and group timings, webhook
receivers with bearer authorization from a Secret, inhibit rules. Like the
Operator (alertmanagerConfigMatcherStrategy OnNamespace, its default), names
are prefixed with ``namespace/name/`` and every route and inhibit rule also
matches the object's namespace; the route is a child of the base
configuration's root route, whose receiver here is "null".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

ROOT_RECEIVER = "null"

_ROUTE_TIMINGS = {
    "groupWait": "group_wait",
    "groupInterval": "group_interval",
    "repeatInterval": "repeat_interval",
}


def _matcher(m: Mapping[str, Any]) -> str:
    return f"{m['name']}{m.get('matchType', '=')}{json.dumps(m['value'])}"


def _namespace_matcher(namespace: str) -> str:
    return f"namespace={json.dumps(namespace)}"


def alertmanager_config(
    amc: Mapping[str, Any], secrets: Mapping[tuple[str, str], str]
) -> dict[str, Any]:
    """Alertmanager's configuration holding `amc`; `secrets`: {(secret, key): value}."""
    namespace = amc["metadata"]["namespace"]
    prefix = f"{namespace}/{amc['metadata']['name']}/"
    spec = amc["spec"]
    route = spec["route"]
    child: dict[str, Any] = {
        "receiver": prefix + route["receiver"],
        "matchers": [_matcher(m) for m in route.get("matchers", [])]
        + [_namespace_matcher(namespace)],
        "continue": True,
    }
    if "groupBy" in route:
        child["group_by"] = list(route["groupBy"])
    for ours, theirs in _ROUTE_TIMINGS.items():
        if ours in route:
            child[theirs] = route[ours]
    receivers: list[dict[str, Any]] = [{"name": ROOT_RECEIVER}]
    for receiver in spec.get("receivers", []):
        hooks = []
        for hook in receiver.get("webhookConfigs", []):
            out: dict[str, Any] = {"url": hook["url"]}
            if "sendResolved" in hook:
                out["send_resolved"] = hook["sendResolved"]
            auth = hook.get("httpConfig", {}).get("authorization")
            if auth is not None:
                ref = auth["credentials"]
                out["http_config"] = {
                    "authorization": {
                        "type": auth.get("type", "Bearer"),
                        "credentials": secrets[(ref["name"], ref["key"])],
                    }
                }
            hooks.append(out)
        receivers.append({"name": prefix + receiver["name"], "webhook_configs": hooks})
    inhibit = [
        {
            "source_matchers": [_matcher(m) for m in rule.get("sourceMatch", [])]
            + [_namespace_matcher(namespace)],
            "target_matchers": [_matcher(m) for m in rule.get("targetMatch", [])]
            + [_namespace_matcher(namespace)],
            "equal": list(rule.get("equal", [])),
        }
        for rule in spec.get("inhibitRules", [])
    ]
    return {
        "route": {"receiver": ROOT_RECEIVER, "routes": [child]},
        "receivers": receivers,
        "inhibit_rules": inhibit,
    }
