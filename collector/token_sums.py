"""The running requests' token counts, kept for the fragmentation gauges.

The gauges need Σ tokens over the running requests, Σ ceil(tokens / b) for
the engine's block size and the what-if sizes, and the longest. The engine's
step only keeps each request's count, as a key relative to a shared `shift`:
a step in which every tracked request gained exactly one token (a pure
decode step, the common one) only advances `shift`, whatever the number of
running requests; a request admitted, resumed or chunk-prefilled sets its own
key. The sums are computed when read (`totals`, O(requests × sizes), a few
times a minute on the scraping thread), not kept per step: keeping them cost
the step a loop over the sizes and their residue counts, cold in the CPU's
caches after the model's forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import floordiv, sub

# (Σ tokens, Σ ceil(tokens / b) per size, the longest) over a set of requests.
Totals = tuple[int, tuple[int, ...], int]


def totals(keys: Sequence[int], shift: int, sizes: Sequence[int]) -> Totals:
    """The sums over requests of `key + shift` tokens each."""
    n = len(keys)
    if not n:
        return 0, (0,) * len(sizes), 0
    # ceil(tokens / b) = -(-tokens // b), summed in C (map) over -tokens.
    negated = list(map(sub, repeat(-shift, n), keys))
    return (
        sum(keys) + shift * n,
        tuple(-sum(map(floordiv, negated, repeat(b, n))) for b in sizes),
        max(keys) + shift,
    )


class RunningTokenSums:
    """Each tracked request's tokens as `keys[request] + shift`. Written by the
    engine thread only; a reader on another thread copies `shift` and the keys
    (StepStats does, between two steps) and calls `totals`."""

    def __init__(self, sizes: Iterable[int]) -> None:
        self.sizes = tuple(sizes)
        self.shift = 0
        self.keys: dict[str, int] = {}

    def clear(self) -> None:
        self.keys.clear()
        self.shift = 0

    def __len__(self) -> int:
        return len(self.keys)

    def set(self, request_id: str, tokens: int) -> None:
        """Track `request_id` at `tokens` (added, or its count replaced)."""
        self.keys[request_id] = tokens - self.shift

    def discard(self, request_id: str) -> None:
        self.keys.pop(request_id, None)

    def advance_all(self) -> None:
        """Every tracked request gained exactly one token."""
        self.shift += 1

    def reset(self, counts: Iterable[tuple[str, int]]) -> None:
        """Track exactly these (request id, tokens)."""
        self.keys = {request_id: tokens for request_id, tokens in counts}
        self.shift = 0

    def totals(self) -> Totals:
        """(Σ tokens, Σ blocks per size, longest) now (the engine thread's view)."""
        return totals(list(self.keys.values()), self.shift, self.sizes)

    # The sums one at a time (tests, the engine thread).
    def tokens(self) -> int:
        return self.totals()[0]

    @property
    def blocks(self) -> list[int]:
        return list(self.totals()[1])

    def max_tokens(self) -> int:
        return self.totals()[2]
