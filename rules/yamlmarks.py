"""YAML with line marks, and validation errors located by them: the one loader and the
one error mapper of the rule catalog, the runbook catalog and the configuration file.

    doc = load(text, "runbooks/catalog/oom-pressure.yaml")  # MarkedDict / MarkedList / scalars
    try:
        Runbook.model_validate(doc)
    except ValidationError as exc:
        problems = validation_problems(exc, doc, file, runbook="oom-pressure")
        # [Problem: "runbooks/catalog/oom-pressure.yaml:41: runbook oom-pressure:
        #            guardrails.cooldown_seconds: Input should be greater than or equal to 0"]

Every mapping and sequence remembers its line and the line of each key or
item, so a pydantic error location (``("steps", 0, "params", "factor")``)
maps back to the line it came from: `locate` walks the document along it.
A missing key is reported at the line of the mapping that lacks it; a
problem with a mapping's contents at the mapping's first line.

Wording: pydantic's own message after the path (``steps: Field required``),
or, with ``wording="schema"``, sentences built from the model
(``unknown key databse (allowed: database, engines, ...)``, ``engines[2].name
is required``). Validators may raise ``PydanticCustomError`` whose type says
how the message joins the path: ``phrase`` → ``PATH message``, ``detail`` →
``PATH: message``, ``whole`` → ``message`` (it names its place itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from vllm_runbook.rules.errors import Problem, SyntaxProblem
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

Loc = tuple[str | int, ...]
Wording = Literal["pydantic", "schema"]


class MarkedDict(dict):
    """A mapping with the line of itself and of each key (1-based)."""

    line: int = 0
    key_lines: dict[object, int]

    def line_of(self, key: object) -> int:
        return self.key_lines.get(key, self.line)


class MarkedList(list):
    """A sequence with the line of itself and of each item (1-based)."""

    line: int = 0
    item_lines: list[int]

    def line_of(self, index: int) -> int:
        return self.item_lines[index] if 0 <= index < len(self.item_lines) else self.line


def line_of(value: object, default: int | None = None) -> int | None:
    return getattr(value, "line", None) or default


def load(text: str, file: str) -> object:
    """Parse one YAML document into MarkedDict/MarkedList/scalars (None when empty).

    Raises SyntaxProblem located at `file` and the line YAML noticed the
    mistake at; duplicate keys and merge keys (``<<``) are mistakes too."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SyntaxProblem(f"invalid YAML: {problem}", file=file, line=line) from None
    if node is None:
        return None
    return _build(node, yaml.SafeLoader(""), file)


def _build(node: Node, constructor: yaml.SafeLoader, file: str) -> object:
    if isinstance(node, MappingNode):
        out = MarkedDict()
        out.line = node.start_mark.line + 1
        out.key_lines = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SyntaxProblem("YAML merge keys (<<) are not supported", file=file, line=line)
            if not isinstance(key_node, ScalarNode):
                kind = "mapping" if isinstance(key_node, MappingNode) else "sequence"
                raise SyntaxProblem(
                    f"a mapping key must be a string or a number, not a {kind}",
                    file=file,
                    line=line,
                )
            key = constructor.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float):
                raise SyntaxProblem(
                    f"mapping key {key_node.value or 'null'!r} must be a string or a number",
                    file=file,
                    line=line,
                )
            if key in out:
                raise SyntaxProblem(f"duplicate key {key!r}", file=file, line=line)
            out[key] = _build(value_node, constructor, file)
            out.key_lines[key] = line
        return out
    if isinstance(node, SequenceNode):
        seq = MarkedList(_build(n, constructor, file) for n in node.value)
        seq.line = node.start_mark.line + 1
        seq.item_lines = [n.start_mark.line + 1 for n in node.value]
        return seq
    assert isinstance(node, ScalarNode)
    return constructor.construct_object(node, deep=True)


# --- locating a validation error -----------------------------------------------------


def locate(doc: object, loc: Loc) -> tuple[str, int, object]:
    """The dotted path of `loc`, the line of its deepest part found in `doc` and the
    node there (None when the last part is not in the file: a missing key)."""
    where, line = "", line_of(doc, 1) or 1
    node: object = doc
    for part in loc:
        if isinstance(node, MarkedList) and isinstance(part, int) and part < len(node):
            where, line, node = f"{where}[{part}]", node.line_of(part), node[part]
            continue
        where = f"{where}.{part}" if where else str(part)
        if isinstance(node, MarkedDict) and part in node:
            line, node = node.line_of(part), node[part]
        else:
            node = None  # not in the file (a missing key): the enclosing line
    return where, line, node


# Errors about the value's own type: located at its key even when it is a mapping.
_TYPE_ERRORS = {"list_type", "tuple_type", "dict_type", "model_type", "model_attributes_type"}


def validation_problems(
    exc: ValidationError,
    doc: object,
    file: str,
    *,
    at: Loc = (),
    prefix: str = "",
    wording: Wording = "pydantic",
    model: type[BaseModel] | None = None,
    rule: str | None = None,
    runbook: str | None = None,
) -> list[Problem]:
    """Each error of `exc` as one ``file:line: ...`` SyntaxProblem.

    `doc` is the marked document the validated value came from and `at` the
    value's place in it (a step's params: ``("steps", 0, "params")``);
    `prefix` goes before each message. With ``wording="schema"``, `model`
    (the model validated at `at`) gives the allowed keys of an unknown one."""
    return [
        _problem(err, doc, file, at, prefix, wording, model, rule, runbook) for err in exc.errors()
    ]


def _problem(
    err: ErrorDetails,
    doc: object,
    file: str,
    at: Loc,
    prefix: str,
    wording: Wording,
    model: type[BaseModel] | None,
    rule: str | None,
    runbook: str | None,
) -> Problem:
    inner = tuple(p for p in err["loc"] if p != "[key]")  # a bad mapping key: at that key
    where, line, node = locate(doc, (*at, *inner))
    kind, msg = err["type"], err["msg"]
    if kind == "phrase":
        text = f"{where} {msg}"
    elif kind == "detail":
        text = f"{where}: {msg}"
    elif kind == "whole":
        text = msg
    elif wording == "schema" and kind in _SCHEMA_WORDS:
        text = _SCHEMA_WORDS[kind](where, _model_at(model, inner[:-1]), _model_at(model, inner))
    else:  # pydantic's own wording, located
        text = f"{where}: {msg}" if where else msg
    if kind not in _TYPE_ERRORS and isinstance(node, MarkedDict):
        line = node.line  # a problem with a mapping's contents: its first line
    return SyntaxProblem(prefix + text, file=file, line=line, rule=rule, runbook=runbook)


def _keys(model: type[BaseModel] | None, *, required: bool = False) -> list[str]:
    if model is None:
        return []
    return [
        file_key(name, field)
        for name, field in model.model_fields.items()
        if field.is_required() or not required
    ]


def file_key(name: str, field: FieldInfo) -> str:
    """A field's key in the file: its validation alias (`for` for `for_`), else its name."""
    alias = field.validation_alias
    return alias if isinstance(alias, str) else field.alias or name


def _unknown_key(where: str, parent: type[BaseModel] | None, _: type[BaseModel] | None) -> str:
    allowed = f" (allowed: {', '.join(_keys(parent))})" if parent is not None else ""
    return f"unknown key {where}{allowed}"


def _missing(where: str, _: type[BaseModel] | None, __: type[BaseModel] | None) -> str:
    return f"{where} is required"


def _not_a_list(where: str, _: type[BaseModel] | None, item: type[BaseModel] | None) -> str:
    if item is None:
        return f"{where} must be a list"
    return f"{where} must be a list of {{{', '.join(_keys(item))}}}"


def _not_a_mapping(where: str, _: type[BaseModel] | None, value: type[BaseModel] | None) -> str:
    needed = _keys(value, required=True) if where.endswith("]") else []
    if not needed:
        return f"{where} must be a mapping"
    listed = needed[0] if len(needed) == 1 else f"{', '.join(needed[:-1])} and {needed[-1]}"
    return f"{where} must be a mapping with {listed}"


# (the path, the model that holds the key, the model of the value) -> the sentence
_Words = Callable[[str, type[BaseModel] | None, type[BaseModel] | None], str]
_SCHEMA_WORDS: dict[str, _Words] = {
    "extra_forbidden": _unknown_key,
    "missing": _missing,
    "list_type": _not_a_list,
    "tuple_type": _not_a_list,
    "dict_type": _not_a_mapping,
    "model_type": _not_a_mapping,
    "model_attributes_type": _not_a_mapping,
}


def _model_at(model: type[BaseModel] | None, path: Loc) -> type[BaseModel] | None:
    """The model whose fields are valid at `path` under `model` (list indexes skipped)."""
    for part in path:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = next(
            (f for name, f in model.model_fields.items() if part in (name, file_key(name, f))), None
        )
        model = None if field is None else _model_in(field.annotation)
    return model


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
