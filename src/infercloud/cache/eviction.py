"""Eviction policies for the prefix cache: which idle cached block to give up first.

One small interface: `priorities(stats, candidates, now_s)` returns one number per candidate
block, and the cache evicts the lowest first. Policies are pure: they read the per-block history
in `BlockStats` and the clock the caller passes, and keep no hidden state (Belady's table of the
future is given to it up front).

- `LRUPolicy`: least recently used first (vLLM's and SGLang's default).
- `ValueAwarePolicy`: expected compute saved per byte held. It estimates each block's rate of
  reuse from its own history (hits and the intervals between them, decayed by the time since it
  was last used; a never-reused block gets a prior), adds the requests already waiting for it,
  and weighs by what recomputing the block would cost, which grows with its depth in the prompt
  (attention over every earlier token).
- `BeladyPolicy`: evicts the block needed furthest in the future (never again: first). It needs
  the future, so it exists for benchmarks only, as the upper bound of what any policy can reach.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(slots=True)
class BlockStats:
    """Per-block history, indexed by block id (valid while the block is cached)."""

    inserted_s: FloatArray
    last_access_s: FloatArray
    num_hits: IntArray
    depth: IntArray
    """Position of the block in its prompt, in blocks (1 = first)."""
    waiting: IntArray
    """Requests waiting in the queue whose prompt matches this block."""
    key: IntArray
    """The block's prefix hash (what Belady's future is keyed by)."""

    @classmethod
    def empty(cls, num_blocks: int) -> BlockStats:
        return cls(
            inserted_s=np.zeros(num_blocks),
            last_access_s=np.zeros(num_blocks),
            num_hits=np.zeros(num_blocks, dtype=np.int64),
            depth=np.zeros(num_blocks, dtype=np.int64),
            waiting=np.zeros(num_blocks, dtype=np.int64),
            key=np.zeros(num_blocks, dtype=np.int64),
        )

    def record_insert(self, block: int, depth: int, key: int, now_s: float) -> None:
        self.inserted_s[block] = now_s
        self.last_access_s[block] = now_s
        self.num_hits[block] = 0
        self.depth[block] = depth
        self.waiting[block] = 0
        self.key[block] = key

    def record_hit(self, block: int, now_s: float) -> None:
        self.num_hits[block] += 1
        self.last_access_s[block] = now_s

    def clear(self, block: int) -> None:
        self.num_hits[block] = 0
        self.waiting[block] = 0


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        """One value per candidate block; the lowest is evicted first."""
        ...


class LRUPolicy:
    name = "lru"

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        # Ties (blocks of one request, stored together) go to the deepest first, so that a
        # shared prefix outlives the private tails that hang from it.
        return stats.last_access_s[candidates] - 1e-9 * stats.depth[candidates]


@dataclass(frozen=True, slots=True)
class ValueAwarePolicy:
    """Keep the blocks with the highest expected saved compute per byte.

    value = reuse_rate x recompute_cost, with
      mean_gap   = (age + `min_interval_s`) / (hits + `prior_hits`)  [s between uses, counting
                   the gap still open, so a block nobody comes back to cools down steadily]
      reuse_rate = 1 / max(mean_gap, time since the last use)  [uses per second]
                 + waiting requests / `min_interval_s`  (demand already queued),
      recompute_cost = 1 + `attention_weight` x depth  [relative compute of one block: its
                   linear layers, plus attention over the depth x block_size tokens before it].
    Every block holds the same bytes, so value per byte orders the same as value.
    """

    prior_hits: float = 0.25
    """What a block never reused yet counts as: most prompt tails are never seen again."""
    min_interval_s: float = 1.0
    attention_weight: float = 0.02
    """Attention's share of a block's compute per block of depth (context / linear FLOPs)."""
    name: str = "value"

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        hits = stats.num_hits[candidates].astype(np.float64)
        age = now_s - stats.inserted_s[candidates]
        mean_gap = (age + self.min_interval_s) / (hits + self.prior_hits)
        since_last = now_s - stats.last_access_s[candidates]
        rate = 1.0 / np.maximum(mean_gap, since_last)
        rate = rate + stats.waiting[candidates] / self.min_interval_s
        cost = 1.0 + self.attention_weight * stats.depth[candidates]
        return rate * cost


class BeladyPolicy:
    """Evict the block whose next use lies furthest ahead; needs the future (benchmarks only)."""

    name = "belady"

    def __init__(self, future_uses: Mapping[int, Sequence[float]]) -> None:
        """`future_uses[key]`: the sorted times at which the block with prefix hash `key` is
        needed (each request's arrival, for every block of its prompt)."""
        self._uses = future_uses

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        out = np.empty(len(candidates))
        for i, key in enumerate(stats.key[candidates].tolist()):
            uses = self._uses.get(key, ())
            j = bisect.bisect_right(uses, now_s)
            out[i] = -uses[j] if j < len(uses) else -np.inf
        return out


def make_policy(
    name: str, future_uses: Mapping[int, Sequence[float]] | None = None
) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "value":
        return ValueAwarePolicy()
    if name == "belady":
        if future_uses is None:
            raise ValueError("the belady policy needs the future: it is for trace replays only")
        return BeladyPolicy(future_uses)
    raise ValueError(f"unknown eviction policy {name!r}; expected lru, value or belady")
