"""YAML loading that remembers line numbers, so errors can say ``file:line``."""

from __future__ import annotations

import yaml
from vllm_runbook.rules.errors import RuleSyntaxError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


class MarkedDict(dict):
    """A mapping with the line of itself and of each key (1-based)."""

    line: int = 0
    key_lines: dict[object, int]

    def line_of(self, key: object) -> int:
        return self.key_lines.get(key, self.line)


class MarkedList(list):
    line: int = 0


def line_of(value: object, default: int | None = None) -> int | None:
    return getattr(value, "line", None) or default


def load(text: str, file: str) -> object:
    """Parse one YAML document into MarkedDict/MarkedList/scalars."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise RuleSyntaxError(f"invalid YAML: {problem}", file=file, line=line) from None
    if node is None:
        return None
    return _build(node, yaml.SafeLoader(""), file)


def _build(node: Node, constructor: yaml.SafeLoader, file: str) -> object:
    if isinstance(node, MappingNode):
        out = MarkedDict()
        out.line = node.start_mark.line + 1
        out.key_lines = {}
        for key_node, value_node in node.value:
            key = _build(key_node, constructor, file)
            line = key_node.start_mark.line + 1
            if key == "<<":
                raise RuleSyntaxError("YAML merge keys are not supported", file=file, line=line)
            if key in out:
                raise RuleSyntaxError(f"duplicate key {key!r}", file=file, line=line)
            out[key] = _build(value_node, constructor, file)
            out.key_lines[key] = line
        return out
    if isinstance(node, SequenceNode):
        seq = MarkedList(_build(n, constructor, file) for n in node.value)
        seq.line = node.start_mark.line + 1
        return seq
    assert isinstance(node, ScalarNode)
    return constructor.construct_object(node, deep=True)
