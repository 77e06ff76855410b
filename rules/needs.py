"""What each rule needs on an engine, and its variant for engines without the plugin.

Derived from the signals a rule's condition reads (`Signal.source`), never
written by hand:

    vllm    vLLM's own /metrics: a stock engine, nothing installed
    plugin  the collector: vllm-runbook installed into the engine's environment
    nvml    the collector's NVML poller: the plugin and an NVIDIA GPU

A leaf needs what its signal's series needs. A collector signal that vLLM
measures too names vLLM's series as its stand-in (`Signal.vllm`, or
`Signal.vllm_ratio` for a ratio gauge read as is): that leaf works without
the plugin. The variant of a rule for engines without the plugin keeps
- a comparison whose leaves all work without the plugin, each reading the
  collector's series where the engine has them and vLLM's otherwise
  (`Fallback`, PromQL's `or`);
- `all` of terms that are all kept;
- `any` of the terms that are kept, the others dropped (`partial`): it
  watches less than the rule, e.g. VllmOOMPressure without its GPU-memory
  branch.
A rule with nothing kept needs the plugin (or NVML): it is not in the
``without-plugin`` group and the embedded evaluator does not evaluate it on
an engine without the plugin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from vllm_runbook.rules import condition as C
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.signals import COLLECTOR_WINDOW_SECONDS, SIGNALS, Signal, Source

WITHOUT_PLUGIN_GROUP: Final = "without-plugin"

_ORDER: Final[dict[Source, int]] = {"vllm": 0, "plugin": 1, "nvml": 2}
NEEDS_TEXT: Final[dict[Source, str]] = {
    "vllm": "vLLM only",
    "plugin": "the plugin",
    "nvml": "the plugin + NVML",
}


@dataclass(frozen=True)
class RuleNeeds:
    """What one rule needs, and what is left of it without the plugin."""

    full: Source  # all of the rule: the most any of its leaves needs
    without_plugin: C.Condition | None  # the variant; None: the rule needs `full`
    partial: bool = False  # the variant dropped terms of an `any`

    @property
    def needs(self) -> Source:
        """The least an engine must run for the rule (or part of it) to be evaluated."""
        return "vllm" if self.without_plugin is not None else self.full

    @property
    def text(self) -> str:
        """For tables: 'vLLM only', 'the plugin', 'the plugin + NVML', or
        'vLLM only (partly; all of it: the plugin + NVML)'."""
        if self.partial:
            return f"{NEEDS_TEXT['vllm']} (partly; all of it: {NEEDS_TEXT[self.full]})"
        return NEEDS_TEXT[self.needs]


def needs(rule: Rule) -> RuleNeeds:
    full = _most(_leaf_source(leaf) for leaf, _ in C.leaves(rule.condition))
    variant, partial = _condition(rule.condition)
    return RuleNeeds(full, variant, partial)


def without_plugin(rules: Iterable[Rule]) -> list[Rule]:
    """The rules that work on an engine without the plugin, each as its variant
    (group ``without-plugin``), in order."""
    out: list[Rule] = []
    for rule in rules:
        variant = needs(rule).without_plugin
        if variant is not None:
            out.append(dataclasses.replace(rule, condition=variant, group=WITHOUT_PLUGIN_GROUP))
    return out


def _most(sources: Iterable[Source]) -> Source:
    return max(sources, key=_ORDER.__getitem__, default="vllm")


def _leaf_source(leaf: C.Leaf) -> Source:
    source = leaf.sel.signal.source
    assert source is not None, leaf  # the parser selects only signals that are series
    return source


def _condition(cond: C.Condition) -> tuple[C.Condition | None, bool]:
    """The condition without the plugin (None: nothing is left), and whether terms were dropped."""
    match cond:
        case C.Compare(expr, op, value):
            measure = _expr(expr)
            return (C.Compare(measure, op, value) if measure is not None else None), False
        case C.AllOf(terms):
            parts = [_condition(t) for t in terms]
            if any(p is None for p, _ in parts):
                return None, False
            return C.AllOf(tuple(p for p, _ in parts if p is not None)), any(x for _, x in parts)
        case C.AnyOf(terms):
            parts = [_condition(t) for t in terms]
            kept = [p for p, _ in parts if p is not None]
            if not kept:
                return None, False
            partial = len(kept) < len(terms) or any(x for _, x in parts)
            return (kept[0] if len(kept) == 1 else C.AnyOf(tuple(kept))), partial
        case C.Unless(kept_cond, excluded_cond):
            kept_part, partial = _condition(kept_cond)
            # An exclusion that cannot be read without the plugin would let the
            # rule fire where the full rule does not: no variant then.
            excluded_part, excluded_partial = _condition(excluded_cond)
            if kept_part is None or excluded_part is None or excluded_partial:
                return None, False
            return C.Unless(kept_part, excluded_part), partial
    raise TypeError(cond)


def _expr(expr: C.Expr) -> C.Expr | None:
    match expr:
        case C.Ratio(num, den):
            n, d = _expr(num), _expr(den)
            return C.Ratio(n, d) if n is not None and d is not None else None
        case C.Difference(left, right):
            lk, rk = _expr(left), _expr(right)
            return C.Difference(lk, rk) if lk is not None and rk is not None else None
        case C.Reduce(fn, over, of):
            kept = _expr(of)
            return C.Reduce(fn, over, kept) if kept is not None else None
        case C.Offset(of, by):
            kept = _expr(of)
            return C.Offset(kept, by) if kept is not None else None
        case C.Fallback():
            return expr
        case C.Instant() | C.Rate() | C.OverTime() | C.Quantile() | C.TimeSince():
            return _leaf(expr)
    raise TypeError(expr)


def _leaf(leaf: C.Leaf) -> C.Expr | None:
    signal = leaf.sel.signal
    if signal.source == "vllm":
        return leaf
    if signal.vllm is not None:
        standin = C.Selector(_as_vllm(signal), leaf.sel.matchers)
        return C.Fallback(leaf, dataclasses.replace(leaf, sel=standin))
    if signal.vllm_ratio is not None and isinstance(leaf, C.Instant):
        num, den = (C.Selector(_as_vllm(SIGNALS[name])) for name in signal.vllm_ratio)
        window = COLLECTOR_WINDOW_SECONDS
        return C.Fallback(leaf, C.Ratio(C.Rate(num, window), C.Rate(den, window)))
    return None


def _as_vllm(signal: Signal) -> Signal:
    """The signal read from its stand-in among vLLM's series."""
    assert signal.vllm is not None, signal.name
    return dataclasses.replace(signal, metric=signal.vllm, vllm=None)


def vllm_series(cond: C.Condition) -> list[str]:
    """The series a variant reads on an engine without the plugin (vLLM's), in order."""
    out: list[str] = []
    for leaf in _read_without_plugin(cond):
        name = leaf.sel.metric + ("_bucket" if isinstance(leaf, C.Quantile) else "")
        if name not in out:
            out.append(name)
    return out


def _read_without_plugin(node: C.Expr | C.Condition) -> Iterable[C.Leaf]:
    match node:
        case C.Compare(expr, _, _):
            yield from _read_without_plugin(expr)
        case C.AllOf(terms) | C.AnyOf(terms):
            for t in terms:
                yield from _read_without_plugin(t)
        case C.Unless(kept, excluded):
            yield from _read_without_plugin(kept)
            yield from _read_without_plugin(excluded)
        case C.Fallback(_, second):  # the collector's side is absent there
            yield from _read_without_plugin(second)
        case C.Ratio(num, den) | C.Difference(num, den):
            yield from _read_without_plugin(num)
            yield from _read_without_plugin(den)
        case C.Reduce(_, _, of) | C.Offset(of, _):
            yield from _read_without_plugin(of)
        case _:
            yield node
