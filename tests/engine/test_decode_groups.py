"""Decode groups: contiguous, covering, and the least padded work plus overhead."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infercloud.engine.decode_groups import decode_groups


def cost(num_blocks: list[int], groups: list[range], overhead: float) -> float:
    return sum(overhead + len(g) * num_blocks[g.stop - 1] for g in groups)


def brute_force(num_blocks: list[int], overhead: float) -> float:
    n = len(num_blocks)
    best = float("inf")
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            groups = [range(a, b) for a, b in itertools.pairwise(bounds)]
            best = min(best, cost(num_blocks, groups, overhead))
    return best


@given(
    st.lists(st.integers(1, 80), min_size=1, max_size=9).map(sorted),
    st.floats(0, 200),
)
def test_groups_cover_in_order_and_are_optimal(num_blocks: list[int], overhead: float) -> None:
    groups = decode_groups(num_blocks, overhead)
    assert [i for g in groups for i in g] == list(range(len(num_blocks)))
    assert all(len(g) > 0 for g in groups)
    assert cost(num_blocks, groups, overhead) == pytest.approx(brute_force(num_blocks, overhead))


@given(st.lists(st.integers(1, 500), min_size=1, max_size=300).map(sorted), st.floats(0, 100))
def test_many_lengths_stay_covered_with_thinned_boundaries(
    num_blocks: list[int], overhead: float
) -> None:
    groups = decode_groups(num_blocks, overhead, max_candidates=8)
    assert [i for g in groups for i in g] == list(range(len(num_blocks)))
    assert len(groups) <= 8


def test_equal_lengths_or_a_large_overhead_make_one_group() -> None:
    assert decode_groups([5, 5, 5], 0) == [range(0, 3)]
    assert decode_groups([1, 2, 70], 10_000) == [range(0, 3)]
    # a short and a long context: two groups when a group costs less than the padding
    assert decode_groups([6, 6, 6, 69, 69], 64) == [range(0, 3), range(3, 5)]
    assert decode_groups([], 64) == []
    with pytest.raises(ValueError, match="ascending"):
        decode_groups([3, 1], 0)
