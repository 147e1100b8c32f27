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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


FRESH = 0
EXTENSION = 1


@dataclass(slots=True)
class BlockStats:
    """Per-block history, indexed by block id: valid while the block is cached, overwritten
    by `record_insert` when the id is cached again."""

    inserted_s: FloatArray
    last_access_s: FloatArray
    num_hits: IntArray
    depth: IntArray
    """Position of the block in its prompt, in blocks (1 = first)."""
    waiting: IntArray
    """Requests waiting in the queue whose prompt matches this block."""
    key: IntArray
    """The block's prefix hash (what Belady's future is keyed by)."""
    origin: IntArray
    """How the block was stored: `FRESH` (by a request that hit nothing) or `EXTENSION` (a
    request that started from a cached prefix and added to it)."""
    origin_stored: IntArray
    """Per origin: blocks stored so far (the outcome counts the value policy learns from)."""
    origin_reused: IntArray
    """Per origin: of those, blocks that were hit at least once."""

    @classmethod
    def empty(cls, num_blocks: int) -> BlockStats:
        return cls(
            inserted_s=np.zeros(num_blocks),
            last_access_s=np.zeros(num_blocks),
            num_hits=np.zeros(num_blocks, dtype=np.int64),
            depth=np.zeros(num_blocks, dtype=np.int64),
            waiting=np.zeros(num_blocks, dtype=np.int64),
            key=np.zeros(num_blocks, dtype=np.int64),
            origin=np.zeros(num_blocks, dtype=np.int64),
            origin_stored=np.zeros(2, dtype=np.int64),
            origin_reused=np.zeros(2, dtype=np.int64),
        )

    def record_insert(self, block: int, depth: int, key: int, origin: int, now_s: float) -> None:
        self._write(block, depth, key, origin, now_s)
        self.origin_stored[origin] += 1

    def record_inserts(
        self, blocks: list[int], depths: list[int], keys: list[int], origin: int, now_s: float
    ) -> None:
        """`record_insert` for each of `blocks` (with its depth and key): one array write per
        field for a long list, scalar writes for a short one (cheaper than building arrays)."""
        if len(blocks) < 8:
            for block, depth, key in zip(blocks, depths, keys, strict=True):
                self._write(block, depth, key, origin, now_s)
        else:
            self._write(np.array(blocks, dtype=np.int64), depths, keys, origin, now_s)
        self.origin_stored[origin] += len(blocks)

    def _write(self, index: Any, depth: Any, key: Any, origin: int, now_s: float) -> None:
        """A fresh history for the block(s) at `index` (an id or an array of ids)."""
        self.inserted_s[index] = now_s
        self.last_access_s[index] = now_s
        self.num_hits[index] = 0
        self.depth[index] = depth
        self.waiting[index] = 0
        self.key[index] = key
        self.origin[index] = origin

    def record_hit(self, block: int, now_s: float) -> None:
        if self.num_hits[block] == 0:
            self.origin_reused[self.origin[block]] += 1
        self.num_hits[block] += 1
        self.last_access_s[block] = now_s


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        """One value per candidate block; the lowest is evicted first."""
        ...


class LRUPolicy:
    name = "lru"
    static_priorities = True
    """A block's priority cannot change while it is idle (only a use changes its last access,
    and a block in use is not a candidate), so the cache may rank candidates once, as they
    become candidates, instead of at every eviction."""

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        # Ties (blocks of one request, stored together) go to the deepest first, so that a
        # shared prefix outlives the private tails that hang from it.
        return stats.last_access_s[candidates] - 1e-9 * stats.depth[candidates]

    def priority(self, stats: BlockStats, block: int) -> float:
        """`priorities` of one block, the very same float (to rank candidates one by one)."""
        return float(stats.last_access_s.item(block) - 1e-9 * stats.depth.item(block))


@dataclass(frozen=True, slots=True)
class ValueAwarePolicy:
    """Keep the blocks with the highest expected saved compute per byte.

    value = reuse_rate x recompute_cost, with
      mean_gap   = (age + `min_interval_s`) / (hits + prior)  [s between uses, counting the gap
                   still open, so a block nobody comes back to cools down steadily]
      prior      = the share of blocks of the same origin that were ever hit, learned online
                   from the cache's own outcomes (Laplace-smoothed, times `prior_hits`): the
                   tails that requests add to an already cached prefix are reused far less
                   often than freshly stored prompts (10% against 34-56% on Mooncake's trace)
      reuse_rate = 1 / max(mean_gap, time since the last use)  [uses per second]
                 + waiting requests / `min_interval_s`  (demand already queued),
      recompute_cost = 1 + `attention_weight` x depth  [relative compute of one block: its
                   linear layers, plus attention over the depth x block_size tokens before it].
    Every block holds the same bytes, so value per byte orders the same as value.
    """

    prior_hits: float = 1.0
    """Scale of the learned prior (a never-hit block counts as `prior_hits` x P(reuse))."""
    min_interval_s: float = 1.0
    attention_weight: float = 0.02
    """Attention's share of a block's compute per block of depth (context / linear FLOPs)."""
    name: str = "value"

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        hits = stats.num_hits[candidates].astype(np.float64)
        age = now_s - stats.inserted_s[candidates]
        reuse_share = (stats.origin_reused + 1.0) / (stats.origin_stored + 2.0)
        prior = self.prior_hits * reuse_share[stats.origin[candidates]]
        mean_gap = (age + self.min_interval_s) / (hits + prior)
        since_last = now_s - stats.last_access_s[candidates]
        rate = 1.0 / np.maximum(mean_gap, since_last)
        rate = rate + stats.waiting[candidates] / self.min_interval_s
        cost = 1.0 + self.attention_weight * stats.depth[candidates]
        return rate * cost


class BeladyPolicy:
    """Evict the block whose next use lies furthest ahead; needs the future (benchmarks only)."""

    name = "belady"

    def __init__(self, future_uses: Mapping[int, Sequence[float]]) -> None:
        """`future_uses[key]`: the times at which the block with prefix hash `key` is needed
        (each request's arrival, for every block of its prompt)."""
        self._keys = np.array(sorted(future_uses), dtype=np.int64)
        pairs = sorted(
            (i, t) for i, key in enumerate(self._keys.tolist()) for t in future_uses[key]
        )
        times = np.array([t for _, t in pairs], dtype=np.float64)
        self._span_s = float(times.max()) + 1.0 if len(times) else 1.0
        # One sorted axis for (key index, time): index + time / span, so that a single
        # searchsorted finds each candidate's next use after `now_s`.
        self._axis = np.array([i for i, _ in pairs], dtype=np.float64) + times / self._span_s
        self._times = times

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        if len(self._axis) == 0:
            return np.full(len(candidates), -np.inf)
        keys = stats.key[candidates]
        index = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        known = self._keys[index] == keys
        pos = np.searchsorted(self._axis, index + now_s / self._span_s, side="right")
        has_next = known & (pos < len(self._axis))
        pos = np.minimum(pos, len(self._axis) - 1)
        has_next &= np.floor(self._axis[pos]) == index
        return np.where(has_next, -self._times[pos], -np.inf)


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
