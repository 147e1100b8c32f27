"""Which decoding requests attend together: groups of similar context length.

The decode queries of a step attend in batched matmuls over a gathered `[seqs, context]` block
of keys and values, so every request in a group pays for the longest context in it (padding,
masked out). One group for all is cheapest in fixed work but pays the most padding when
contexts differ (a 100-token and a 1,100-token request: 1,100 keys each); one group per length
pays no padding but the fixed cost of a gather and two matmuls per group in every layer.

`decode_groups` takes the requests' context lengths in blocks, ascending, and returns the
contiguous ranges that minimise

    sum over groups of (requests in it x its longest context in blocks) + overhead_blocks x groups

by dynamic programming over at most `max_candidates` boundaries (where the length changes;
thinned evenly when there are more), so the cost per step stays small whatever the batch.
Invariants: the ranges are contiguous, in order, non-empty, and cover `0 .. len(num_blocks)`;
with an overhead that large, or lengths all equal, there is one group.

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise


def decode_groups(
    num_blocks: Sequence[int], overhead_blocks: float, max_candidates: int = 32
) -> list[range]:
    """Contiguous groups of `num_blocks` (ascending) with the least padded work plus overhead."""
    n = len(num_blocks)
    if n == 0:
        return []
    if any(a > b for a, b in pairwise(num_blocks)):
        raise ValueError("num_blocks must be in ascending order")
    ends = [i for i in range(1, n) if num_blocks[i - 1] != num_blocks[i]]
    if len(ends) >= max_candidates:
        step = len(ends) / (max_candidates - 1)
        ends = sorted({ends[int(k * step)] for k in range(max_candidates - 1)})
    points = [0, *ends, n]
    best = [0.0] + [math.inf] * (len(points) - 1)
    previous = [0] * len(points)
    for j in range(1, len(points)):
        end = points[j]
        longest = num_blocks[end - 1]
        for i in range(j):
            cost = best[i] + overhead_blocks + (end - points[i]) * longest
            if cost < best[j]:
                best[j], previous[j] = cost, i
    groups: list[range] = []
    j = len(points) - 1
    while j > 0:
        i = previous[j]
        groups.append(range(points[i], points[j]))
        j = i
    groups.reverse()
    return groups
