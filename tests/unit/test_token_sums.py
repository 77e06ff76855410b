"""RunningTokenSums against the sums recomputed from scratch after every change."""

from __future__ import annotations

import random

from vllm_runbook.collector.token_sums import RunningTokenSums

SIZES = (8, 16, 32, 64, 128)


def _blocks(tokens: dict[str, int]) -> list[int]:
    return [sum(-(-t // b) for t in tokens.values()) for b in SIZES]


def test_the_oracle_of_the_issue() -> None:
    sums = RunningTokenSums(SIZES)
    for i, n in enumerate((40, 70, 100)):
        sums.set(f"r{i}", n)
    assert sums.tokens() == 210
    # 5+9+13 blocks of 8, 3+5+7 of 16, 2+3+4 of 32, 1+2+2 of 64, 1+1+1 of 128.
    assert [b * n for b, n in zip(SIZES, sums.blocks, strict=True)] == [216, 240, 288, 320, 384]
    sums.advance_all()  # 41, 71, 101: 41 opens a block of 8 (40 was full), 71/101 none
    assert sums.tokens() == 213 and sums.blocks == [28, 15, 9, 5, 3]
    assert sums.max_tokens() == 101


def test_random_changes_match_a_full_recount() -> None:
    rnd = random.Random(7)
    sums, ref = RunningTokenSums(SIZES), {}
    for step in range(20_000):
        op = rnd.random()
        if op < 0.1:
            rid, tokens = str(rnd.randrange(300)), rnd.randrange(1, 3000)
            sums.set(rid, tokens)
            ref[rid] = tokens
        elif op < 0.15 and ref:
            rid = rnd.choice(sorted(ref))
            sums.discard(rid)
            del ref[rid]
        else:
            sums.advance_all()
            ref = {k: v + 1 for k, v in ref.items()}
        assert len(sums) == len(ref)
        assert sums.tokens() == sum(ref.values()), step
        assert sums.blocks == _blocks(ref), step
        assert sums.max_tokens() == max(ref.values(), default=0), step
    sums.reset([("a", 5)])
    assert (sums.tokens(), sums.blocks, sums.max_tokens()) == (5, [1] * 5, 5)
