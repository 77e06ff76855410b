"""Token and block sums over the running requests, kept incrementally.

The fragmentation gauges need, after every step, Σ tokens over the running
requests and Σ ceil(tokens / b) for the engine's block size and the what-if
sizes. Re-reading every running request each step costs O(running) in the
engine's step; here only the requests whose token count changed irregularly
are touched. Each request's token count is stored as a key relative to a
shared `shift`: a step in which every tracked request gained exactly one
token (a pure decode step, the common one) only advances `shift`, and the
requests that open a new block at size b are exactly those whose count was a
multiple of b, counted per residue class — O(number of sizes), whatever the
number of running requests.
"""

from __future__ import annotations

from collections.abc import Iterable


class RunningTokenSums:
    """Σ tokens, Σ ceil(tokens / b) per size, and the longest, over tracked requests.
    Engine thread only."""

    def __init__(self, sizes: Iterable[int]) -> None:
        self.sizes = tuple(sizes)
        self.clear()

    def clear(self) -> None:
        self.shift = 0  # tokens of request r = key[r] + shift
        self.keys: dict[str, int] = {}
        self.key_sum = 0
        self._key_counts: dict[int, int] = {}
        self._max_key: int | None = None
        # Per size b: how many keys fall in each residue class mod b, and Σ ceil(tokens / b).
        self.residues = [[0] * b for b in self.sizes]
        self.blocks = [0] * len(self.sizes)

    def __len__(self) -> int:
        return len(self.keys)

    def tokens(self) -> int:
        return self.key_sum + self.shift * len(self.keys)

    def max_tokens(self) -> int:
        if self._max_key is None and self._key_counts:
            self._max_key = max(self._key_counts)
        return 0 if self._max_key is None else self._max_key + self.shift

    def set(self, request_id: str, tokens: int) -> None:
        """Track `request_id` at `tokens` (added, or its count replaced)."""
        old = self.keys.get(request_id)
        if old is not None:
            if old + self.shift == tokens:
                return
            self._drop(old)
        key = tokens - self.shift
        self.keys[request_id] = key
        self.key_sum += key
        counts = self._key_counts
        counts[key] = counts.get(key, 0) + 1
        # An unknown max (None after its key left) stays unknown unless this key is alone.
        max_key = self._max_key
        if (max_key is not None and key > max_key) or (max_key is None and len(counts) == 1):
            self._max_key = key
        residues, blocks = self.residues, self.blocks
        for i, b in enumerate(self.sizes):
            residues[i][key % b] += 1
            blocks[i] -= tokens // -b  # ceil(tokens / b)

    def discard(self, request_id: str) -> None:
        key = self.keys.pop(request_id, None)
        if key is not None:
            self._drop(key)

    def _drop(self, key: int) -> None:
        tokens = key + self.shift
        self.key_sum -= key
        counts = self._key_counts
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
            if key == self._max_key:
                self._max_key = None  # found again when asked
        residues, blocks = self.residues, self.blocks
        for i, b in enumerate(self.sizes):
            residues[i][key % b] -= 1
            blocks[i] += tokens // -b  # minus ceil(tokens / b)

    def advance_all(self) -> None:
        """Every tracked request gained exactly one token."""
        residue_of_full = -self.shift  # tokens ≡ 0 (mod b) ⇔ key ≡ −shift (mod b)
        blocks, residues = self.blocks, self.residues
        for i, b in enumerate(self.sizes):
            blocks[i] += residues[i][residue_of_full % b]
        self.shift += 1

    def reset(self, counts: Iterable[tuple[str, int]]) -> None:
        """Track exactly these (request id, tokens)."""
        self.clear()
        for request_id, tokens in counts:
            self.set(request_id, tokens)
