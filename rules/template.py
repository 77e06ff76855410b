"""Annotation templates: the subset of Prometheus' Go templates both backends render.

Allowed actions: ``{{ $labels.NAME }}``, ``{{ $value }}``,
``{{ printf "%.2f" $value }}`` (one f/g/e verb) and ``{{ $params.NAME }}``.
``$params`` is replaced by the bound parameter value before export, so
Prometheus only ever sees the first three, which it renders itself; the
in-service evaluator renders them here the way Go would.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal

from vllm_runbook.rules.errors import TemplateError

_ACTION = re.compile(r"\{\{(.*?)\}\}", re.S)
_LABEL = re.compile(r"^\$labels\.([A-Za-z_][A-Za-z0-9_]*)$")
_PARAM = re.compile(r"^\$params\.([A-Za-z_][A-Za-z0-9_]*)$")
_PRINTF = re.compile(r'^printf\s+"(%\.\d+[fge])"\s+\$value$')


def check(template: str, params: Mapping[str, object]) -> None:
    """Raise TemplateError for anything outside the subset or an unknown $params name."""
    if template.count("{{") != template.count("}}"):
        raise TemplateError(f"unbalanced braces in template {template!r}")
    for action in _ACTION.findall(template):
        body = action.strip()
        param = _PARAM.match(body)
        if param and param.group(1) not in params:
            raise TemplateError(f"template names unknown parameter $params.{param.group(1)}")
        if not (param or _LABEL.match(body) or _PRINTF.match(body) or body == "$value"):
            raise TemplateError(
                f"unsupported template action {{{{{action}}}}}: use $labels.NAME, $value, "
                '$params.NAME or printf "%.2f" $value'
            )


def bind_params(template: str, params: Mapping[str, object]) -> str:
    """Replace ``{{ $params.X }}`` by the value (the result is a Prometheus template)."""

    def sub(m: re.Match[str]) -> str:
        param = _PARAM.match(m.group(1).strip())
        return str(params[param.group(1)]) if param else m.group(0)

    return _ACTION.sub(sub, template)


def render(template: str, labels: Mapping[str, str], value: float) -> str:
    """Render a bound template as Prometheus would (missing labels print empty)."""

    def sub(m: re.Match[str]) -> str:
        body = m.group(1).strip()
        if body == "$value":
            return go_float(value)
        label = _LABEL.match(body)
        if label:
            return labels.get(label.group(1), "")
        printf = _PRINTF.match(body)
        if printf:
            return printf.group(1) % value
        return m.group(0)

    return _ACTION.sub(sub, template)


def go_float(value: float) -> str:
    """Go's %v for a float64: shortest digits, exponent form outside 1e-4..1e6."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    sign, digits, exp = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exp, int)
    text = "".join(map(str, digits))
    x = len(digits) + exp - 1  # decimal exponent of the first digit
    minus = "-" if sign else ""
    if x < -4 or x >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{minus}{mantissa}e{'-' if x < 0 else '+'}{abs(x):02d}"
    if exp >= 0:
        return minus + text + "0" * exp
    point = len(text) + exp
    if point > 0:
        return minus + text[:point] + "." + text[point:]
    return minus + "0." + "0" * (-point) + text
