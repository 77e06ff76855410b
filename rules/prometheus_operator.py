"""The catalog as a Prometheus Operator ``PrometheusRule`` (monitoring.coreos.com/v1).

The resource's ``spec.groups`` are exactly the groups of the plain rule file
(`vllm_runbook.rules.promql.rule_groups`): same alerts, expressions, labels
and annotations, runbook_url included. Name, namespace and labels are the
caller's, so that the Operator's ``ruleSelector`` (kube-prometheus-stack:
``release: <its release name>``) and ``ruleNamespaceSelector`` pick it up.
Names and labels are checked the way the API server checks them, so a typo
fails here, on one line, not at ``kubectl apply``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from vllm_runbook.rules.errors import ResourceNameError
from vllm_runbook.rules.model import Catalog, Rule
from vllm_runbook.rules.promql import (
    DEFAULT_RUNBOOK_URL_BASE,
    GENERATED_HEADER,
    dump_yaml,
    rule_groups,
)
from vllm_runbook.rules.signals import ENGINE_LABELS

API_VERSION = "monitoring.coreos.com/v1"
KIND = "PrometheusRule"
DEFAULT_NAME = "vllm-runbook"

# Kubernetes' own validation (apimachinery/pkg/util/validation).
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_DNS1123_LABEL_RE = re.compile(rf"^{_DNS1123_LABEL}$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def check_name(name: str) -> str:
    """An object name (DNS-1123 subdomain, at most 253 characters)."""
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        raise ResourceNameError(
            f"invalid name {name!r}: lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return name


def check_namespace(namespace: str) -> str:
    """A namespace (DNS-1123 label, at most 63 characters)."""
    if len(namespace) > 63 or not _DNS1123_LABEL_RE.match(namespace):
        raise ResourceNameError(
            f"invalid namespace {namespace!r}: lower-case letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    return namespace


def parse_label(text: str) -> tuple[str, str]:
    """``key=value`` as Kubernetes accepts it for an object label."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ResourceNameError(f"invalid label {text!r}: expected KEY=VALUE")
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        raise ResourceNameError(f"invalid label key {key!r}: the prefix must be a DNS subdomain")
    if len(name) > 63 or not _QUALIFIED_NAME.match(name):
        raise ResourceNameError(
            f"invalid label key {key!r}: letters, digits, '-', '_' and '.', starting and "
            "ending with a letter or digit, at most 63 characters (after an optional prefix/)"
        )
    if value and (len(value) > 63 or not _QUALIFIED_NAME.match(value)):
        raise ResourceNameError(
            f"invalid label value {value!r} for {key}: letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    return key, value


def prometheus_rule(
    groups: Sequence[Mapping[str, object]],
    *,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The PrometheusRule object (a dict) holding `groups`."""
    metadata: dict[str, object] = {"name": check_name(name)}
    if namespace is not None:
        metadata["namespace"] = check_namespace(namespace)
    if labels:
        metadata["labels"] = dict(parse_label(f"{k}={v}") for k, v in labels.items())
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"groups": list(groups)},
    }


def export_prometheus_rule(
    catalog: Catalog | Iterable[Rule],
    overrides: Mapping[str, Mapping[str, object]] | None = None,
    *,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    runbook_url_base: str = DEFAULT_RUNBOOK_URL_BASE,
    engine_labels: Sequence[str] = ENGINE_LABELS,
) -> str:
    """The PrometheusRule as YAML text (one document)."""
    groups = rule_groups(
        catalog, overrides, runbook_url_base=runbook_url_base, engine_labels=engine_labels
    )
    resource = prometheus_rule(groups, name=name, namespace=namespace, labels=labels)
    return GENERATED_HEADER + dump_yaml(resource)
