"""Eviction policies for the prefix cache: which idle cached block to give up first.

One small interface: `priorities(stats, candidates, now_s)` returns one number per candidate
block, and the cache evicts the lowest first. Policies are pure: they read the per-block history
and the learned outcome counts in `BlockStats` and the clock the caller passes, and keep no hidden
state (Belady's table of the future is given to it up front).

- `LRUPolicy`: least recently used first (vLLM's and SGLang's default).
- `ValueAwarePolicy`: the blocks least likely to be used again within the time a kept block
  has, first. It learns online, per state of a block, how often blocks in that state were used
  again and after how long. A block's state is its feature class (`feature_class`: the class of
  the request that stored it, by `request_class`: whether that request hit, its prompt length
  and, once it finished, its output length; and how many blocks before the end of that
  request's chain it sits) until it is hit, then how many times it was hit.
- `BeladyPolicy`: evicts the block needed furthest in the future (never again: first). It needs
  the future, so it exists for benchmarks only, as the upper bound of what any policy can reach.

Invariants of `BlockStats`' learning (what keeps the value policy honest):
- it counts only what happened before `now_s`: inserts, hits, the finish of the storing request
  (its output length is passed only then, when its blocks can first become idle), evictions,
  and a prefix stored again after its block was evicted (a use the cache missed);
- `state_reused[s] <= state_entered[s]` for every state once every visit's entry is counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


PENDING = 0
"""The state of a never-hit block whose storing request has not finished (or was preempted):
its features are not all known yet."""

OUTPUT_TOKEN_BOUNDS = (4, 16, 64, 256, 1024)
"""Upper bounds of the output-length buckets, in tokens (powers of 4; the last bucket is open)."""
PROMPT_TOKEN_BOUNDS = (1024, 4096, 16384, 65536)
"""Upper bounds of the prompt-length buckets, in tokens (powers of 4)."""
_NUM_OUTPUT = len(OUTPUT_TOKEN_BOUNDS) + 2  # the buckets, plus "unknown"
_NUM_PROMPT = len(PROMPT_TOKEN_BOUNDS) + 2
NUM_REQUEST_CLASSES = 2 * _NUM_OUTPUT * _NUM_PROMPT
"""One class per (hit, output bucket, prompt bucket)."""
TAIL_POSITIONS = 8
"""A block's distance from the end of its request's chain, in blocks: 0 (the last) to 6, and
7 for any further in. On Mooncake's trace, the blocks a prompt stores last (its new tail: the
latest turn) were used again 5%, 17%, 29% and 37% of the time, those 4-11 blocks from the end
about 40%, those further in 49%. With 4 positions instead of 8, the value policy's hit rate at
25% capacity was 51.3% instead of 51.7%; without them, 49.8%."""
NUM_FEATURE_CLASSES = 1 + NUM_REQUEST_CLASSES * TAIL_POSITIONS
"""`PENDING`, then one class per (request class, tail position)."""
HIT_STATES = 4
"""States of blocks hit 1, 2, 3 and 4 or more times (their features no longer matter)."""
NUM_STATES = NUM_FEATURE_CLASSES + HIT_STATES
GAP_BUCKETS = 16
"""Histogram of the seconds between a block's uses: bucket i holds gaps in [2^(i-1), 2^i)
(bucket 0: under 1 s; the last bucket is open)."""


IDLE_AVERAGE_WEIGHT = 0.001
"""Weight of each evicted block in `BlockStats.idle_at_eviction_s` (about the last thousand)."""


def _bucket(value: int | None, bounds: tuple[int, ...]) -> int:
    if value is None:
        return len(bounds) + 1
    for i, bound in enumerate(bounds):
        if value < bound:
            return i
    return len(bounds)


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What a finished request tells the cache about the blocks it stored."""

    prompt_tokens: int | None
    output_tokens: int | None
    """Tokens generated: known only once the request has finished."""


def request_class(hit: bool, prompt_tokens: int | None, output_tokens: int | None) -> int:
    """The class (0 .. `NUM_REQUEST_CLASSES` - 1) of a finished request: whether it started
    from a cached prefix, and its prompt and output lengths in tokens (None: not known)."""
    out = _bucket(output_tokens, OUTPUT_TOKEN_BOUNDS)
    prompt = _bucket(prompt_tokens, PROMPT_TOKEN_BOUNDS)
    return (int(hit) * _NUM_OUTPUT + out) * _NUM_PROMPT + prompt


def feature_class(request: int, blocks_from_end: int) -> int:
    """The feature class of a block that a request of class `request` stored, `blocks_from_end`
    blocks before the end of the chain it stored (0: its last block)."""
    return 1 + request * TAIL_POSITIONS + min(blocks_from_end, TAIL_POSITIONS - 1)


def hit_state(num_hits: int) -> int:
    """The state of a block hit `num_hits` (>= 1) times."""
    return NUM_FEATURE_CLASSES - 1 + min(num_hits, HIT_STATES)


def gap_bucket(gap_s: float) -> int:
    """The `GAP_BUCKETS` index of a gap in seconds."""
    _, exponent = math.frexp(max(0.0, gap_s))
    return min(max(exponent, 0), GAP_BUCKETS - 1)


class Ghost(NamedTuple):
    """An evicted block's history (its prefix hash names it)."""

    feature_class: int
    num_hits: int
    last_access_s: float


@dataclass(slots=True)
class BlockStats:
    """Per-block history, indexed by block id: valid while the block is cached, overwritten
    by `record_insert` when the id is cached again; and the outcome counts the value policy
    learns from, over every block the cache has held so far (nothing about the future).

    A block moves through states: `PENDING` from its insertion until its storing request
    finishes, then its `feature_class` (from that request's), then, once hit, the hit
    states (1, 2, 3, 4+ hits). `state_entered[s]` counts visits to state s, `state_reused[s]`
    those that ended in a use: a hit, or its prefix stored again after the block was evicted
    (`record_revival`: a use the cache missed, so that what the policy evicts early still counts
    as reused). A visit that ends otherwise (eviction with no return, classification) or is
    still open counts as not reused. So `state_reused / state_entered` is the observed chance
    that a block in that state is used again (within the memory of evicted prefixes).
    """

    inserted_s: FloatArray
    last_access_s: FloatArray
    num_hits: IntArray
    depth: IntArray
    """Position of the block in its prompt, in blocks (1 = first)."""
    waiting: IntArray
    """Requests waiting in the engine's queue whose prompt contains this block's prefix: kept
    by `PrefixCache` from its demand (`PrefixCache.add_demand`) for a policy that
    `reads_waiting`, zero otherwise."""
    wanted_order: FloatArray
    """The queue order of the first of those requests (their place in the queue: smaller is
    scheduled sooner), inf if none."""
    key: IntArray
    """The block's prefix hash (what Belady's future is keyed by)."""
    feature_class: IntArray
    """`PENDING` or the block's `feature_class`, set when the request that stored it finished
    (so that its output length is known)."""
    state_entered: IntArray
    """Per state (`NUM_STATES`): visits so far."""
    state_reused: IntArray
    """Per state: of those, visits that ended in a hit."""
    gap_hits: IntArray
    """Per state and `gap_bucket`: uses so far of blocks in that state whose gap since the
    block's previous use (or insertion) fell in that bucket."""
    queue_head_order: float = 0.0
    """The queue order of the request at the head of the queue (set by `PrefixCache` before
    it ranks candidates): `wanted_order` minus this is how far back the first need waits."""
    idle_at_eviction_s: float = 0.0
    """Moving average (`IDLE_AVERAGE_WEIGHT` per block) of how long evicted blocks had been
    idle: how long the cache lately keeps a block nobody uses."""

    @classmethod
    def empty(cls, num_blocks: int) -> BlockStats:
        return cls(
            inserted_s=np.zeros(num_blocks),
            last_access_s=np.zeros(num_blocks),
            num_hits=np.zeros(num_blocks, dtype=np.int64),
            depth=np.zeros(num_blocks, dtype=np.int64),
            waiting=np.zeros(num_blocks, dtype=np.int64),
            wanted_order=np.full(num_blocks, np.inf),
            key=np.zeros(num_blocks, dtype=np.int64),
            feature_class=np.zeros(num_blocks, dtype=np.int64),
            state_entered=np.zeros(NUM_STATES, dtype=np.int64),
            state_reused=np.zeros(NUM_STATES, dtype=np.int64),
            gap_hits=np.zeros((NUM_STATES, GAP_BUCKETS), dtype=np.int64),
        )

    def state(self, blocks: IntArray) -> IntArray:
        """Each block's current state."""
        hits = self.num_hits[blocks]
        hit_state = NUM_FEATURE_CLASSES - 1 + np.minimum(hits, HIT_STATES)
        return np.where(hits == 0, self.feature_class[blocks], hit_state)

    def record_insert(self, block: int, depth: int, key: int, now_s: float) -> None:
        self._write(block, depth, key, now_s)
        self.state_entered[PENDING] += 1

    def record_inserts(
        self, blocks: list[int], depths: list[int], keys: list[int], now_s: float
    ) -> None:
        """`record_insert` for each of `blocks` (with its depth and key): one array write per
        field for a long list, scalar writes for a short one (cheaper than building arrays)."""
        if len(blocks) < 8:
            for block, depth, key in zip(blocks, depths, keys, strict=True):
                self._write(block, depth, key, now_s)
        else:
            self._write(np.array(blocks, dtype=np.int64), depths, keys, now_s)
        self.state_entered[PENDING] += len(blocks)

    def _write(self, index: Any, depth: Any, key: Any, now_s: float) -> None:
        """A fresh history for the block(s) at `index` (an id or an array of ids)."""
        self.inserted_s[index] = now_s
        self.last_access_s[index] = now_s
        self.num_hits[index] = 0
        self.depth[index] = depth
        self.waiting[index] = 0
        self.wanted_order[index] = np.inf
        self.key[index] = key
        self.feature_class[index] = PENDING

    def move(self, src: int, dst: int) -> None:
        """The cached block at id `src` now lives at id `dst` (`PrefixCache.claim_lowest`): its
        history goes with it; the aggregate counts do not change."""
        for field in (
            self.inserted_s,
            self.last_access_s,
            self.num_hits,
            self.depth,
            self.waiting,
            self.wanted_order,
            self.key,
            self.feature_class,
        ):
            field[dst] = field[src]

    def record_finish(self, blocks: list[int], request: int) -> None:
        """The request that stored `blocks` finished, and was of class `request`
        (`request_class`): each takes its `feature_class`, by how far it sits from the deepest
        of them. A block hit meanwhile counts as a reused visit of that class (it is in a hit
        state already)."""
        if not blocks:
            return
        end_depth = int(self.depth[np.array(blocks, dtype=np.int64)].max())
        for block in blocks:
            if self.feature_class[block] != PENDING:
                continue
            cls = feature_class(request, end_depth - int(self.depth[block]))
            self.feature_class[block] = cls
            self.state_entered[cls] += 1
            if self.num_hits[block] > 0:
                self.state_reused[cls] += 1

    def record_hit(self, block: int, now_s: float) -> None:
        hits = int(self.num_hits[block])
        feature_class = int(self.feature_class[block])
        self._count_use(feature_class, hits, float(self.last_access_s[block]), now_s)
        self.num_hits[block] = hits + 1
        self.last_access_s[block] = now_s

    def record_eviction(self, blocks: list[int], now_s: float) -> None:
        """`blocks` are being evicted (their history is still here)."""
        idle_s = now_s - self.last_access_s[np.array(blocks, dtype=np.int64)]
        keep = (1.0 - IDLE_AVERAGE_WEIGHT) ** len(blocks)
        self.idle_at_eviction_s = keep * self.idle_at_eviction_s + (1.0 - keep) * float(
            idle_s.mean()
        )

    def ghost(self, block: int) -> Ghost:
        """What to remember of a block being evicted, in case its prefix is stored again."""
        return Ghost(
            int(self.feature_class[block]),
            int(self.num_hits[block]),
            float(self.last_access_s[block]),
        )

    def record_revival(self, block: int, ghost: Ghost, now_s: float) -> None:
        """`block` was just inserted (`record_insert`) for a prefix the cache had evicted: that
        was a use of the evicted block (a miss that a larger cache would have hit), so it counts
        as one and the new block carries on its history instead of starting `PENDING`."""
        self.state_entered[PENDING] -= 1
        self._count_use(ghost.feature_class, ghost.num_hits, ghost.last_access_s, now_s)
        self.feature_class[block] = ghost.feature_class
        self.num_hits[block] = ghost.num_hits + 1

    def _count_use(self, feature_class: int, hits: int, last_access_s: float, now_s: float) -> None:
        """A block of `feature_class` used `hits` times so far is used again: its visit to its
        state ends in a reuse, it enters the next hit state, and the gap is counted."""
        state = feature_class if hits == 0 else hit_state(hits)
        self.state_reused[state] += 1
        self.state_entered[hit_state(hits + 1)] += 1
        self.gap_hits[state, gap_bucket(now_s - last_access_s)] += 1


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def learns_outcomes(self) -> bool:
        """Whether the policy reads the learned outcome counts of `BlockStats` (the classes of
        finished requests' blocks, revivals of evicted prefixes); when not, the cache skips
        keeping them."""
        ...

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        """One value per candidate block; the lowest is evicted first."""
        ...


class LRUPolicy:
    name = "lru"
    learns_outcomes = False
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
    """Keep the blocks most likely to be used again soon, as learned online from the cache's
    own outcomes so far (`BlockStats`: hits, and misses on blocks it had evicted).

    For a candidate in state s (its request's features, or how often it was hit), idle for
    `age` seconds:
      p         = P(a block in state s is used again): the observed share of visits to s that
                  ended in a use, shrunk toward the share over all states by `prior_visits`;
      S_s(t)    = P(the gap before that use exceeds t): state s's histogram of gaps, shrunk
                  toward all states' (`survival_edges`);
      horizon   = how long idle blocks have lately stayed before eviction (`BlockStats.
                  idle_at_eviction_s`; `min_horizon_s` at least): the time a kept block has;
      priority  = P(used within the horizon | not used for `age`)
                = p (S_s(age) - S_s(age + horizon)) / (p S_s(age) + 1 - p),   in [0, 1];
      value     = priority x (1 + `depth_cost_per_block` x depth): the prefill compute a
                  kept block is expected to save, since recomputing a block costs more the deeper
                  it sits in its prompt (its tokens attend to every key before them);
    and a block that a queued request will match (`BlockStats.waiting`: demand the engine
    sees before the cache does, certain) ranks above all of those, the one needed soonest
    highest, as Belady's rule would over the visible part of the future:
      value     = top + 1 / (1 + how far its first waiting request is behind the queue's head,
                             in queue order: requests under FCFS),
    with `top` above every unwanted block's value (2 + `depth_cost_per_block` x the deepest
    block's depth). How many queued requests want a block
    does not raise it further: evicting it costs one recompute whatever the count, since the
    first of them stores it again for the others.
    Every block holds the same bytes, so a value per block orders as one per byte held.
    The policy reads no clock and no future: only `stats` and the `now_s` it is given.
    """

    prior_visits: float = 20.0
    """Pseudo-visits (and pseudo-gaps) pulling a state with little history to the average."""
    min_horizon_s: float = 1.0
    depth_cost_per_block: float = 0.0
    """The model's extra recompute cost per block of depth (`ModelSpec.depth_cost_per_block`);
    0: every block costs the same."""
    name: str = "value"
    learns_outcomes: bool = True
    reads_waiting: bool = True
    """The cache keeps `BlockStats.waiting` and `wanted_order` for it: a block a queued
    request will match is kept before any block nobody is waiting for."""

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        return self.ranking(stats, now_s)(candidates)

    def ranking(self, stats: BlockStats, now_s: float) -> Callable[[IntArray], FloatArray]:
        """`priorities` at `now_s` with the per-state tables (reuse odds, gap survival) made
        once, for ranking many sets of candidates while `stats` does not change (one eviction:
        each parent left an idle leaf is ranked on its own)."""
        entered = stats.state_entered.astype(np.float64)
        reused = stats.state_reused.astype(np.float64)
        overall = (reused.sum() + 1.0) / (entered.sum() + 2.0)
        p_state = (reused + self.prior_visits * overall) / (entered + self.prior_visits)
        edges_state = survival_edges(stats.gap_hits, self.prior_visits)
        horizon_s = max(self.min_horizon_s, stats.idle_at_eviction_s)

        def rank(candidates: IntArray) -> FloatArray:
            state = stats.state(candidates)
            p = p_state[state]
            edges = edges_state[state]
            age_s = now_s - stats.last_access_s[candidates]
            s_now = survival(edges, age_s)
            s_end = survival(edges, age_s + horizon_s)
            value: FloatArray = p * (s_now - s_end) / (p * s_now + 1.0 - p)
            if self.depth_cost_per_block:
                value *= 1.0 + self.depth_cost_per_block * stats.depth[candidates]
            wanted = stats.waiting[candidates] > 0
            if not wanted.any():
                return value
            # above any unwanted block's value (at most 1 + depth_cost_per_block x depth), the
            # same for every set of candidates (`stats` does not change during a ranking)
            top = 2.0 + self.depth_cost_per_block * float(stats.depth.max(initial=0))
            # unwanted blocks have wanted_order inf: 1 / (1 + inf) = 0, and `value` is taken
            behind = np.maximum(stats.wanted_order[candidates] - stats.queue_head_order, 0.0)
            return np.where(wanted, top + 1.0 / (1.0 + behind), value)

        return rank


def survival_edges(gap_hits: IntArray, prior_hits: float) -> FloatArray:
    """Per state, P(gap >= lower edge of each `gap_bucket`), and a last edge beyond them all:
    from the state's histogram of gaps, shrunk toward all states' by `prior_hits` hits."""
    counts = gap_hits.astype(np.float64)
    overall = counts.sum(axis=0)
    overall = (overall + 1.0 / GAP_BUCKETS) / (overall.sum() + 1.0)
    counts = counts + prior_hits * overall
    at_least: FloatArray = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1]
    at_least /= counts.sum(axis=1, keepdims=True)
    return np.concatenate([at_least, np.zeros((len(counts), 1))], axis=1)


def survival(edges: FloatArray, gap_s: FloatArray) -> FloatArray:
    """P(a gap exceeds `gap_s`), each row of `edges` (`survival_edges`) for its gap,
    interpolated linearly in log2 time inside a bucket."""
    position = np.clip(np.log2(np.maximum(gap_s, 1e-9)) + 1.0, 0.0, GAP_BUCKETS - 1e-9)
    lower = position.astype(np.int64)
    frac = position - lower
    rows = np.arange(len(edges))
    low = edges[rows, lower]
    return low + frac * (edges[rows, lower + 1] - low)


class BeladyPolicy:
    """Evict the block whose next use lies furthest ahead; needs the future (benchmarks only)."""

    name = "belady"
    learns_outcomes = False

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
    name: str,
    future_uses: Mapping[int, Sequence[float]] | None = None,
    depth_cost_per_block: float = 0.0,
) -> EvictionPolicy:
    """`depth_cost_per_block`: the model's (`ModelSpec.depth_cost_per_block`), for the value
    policy's recompute cost; the others ignore it."""
    if name == "lru":
        return LRUPolicy()
    if name == "value":
        return ValueAwarePolicy(depth_cost_per_block=depth_cost_per_block)
    if name == "belady":
        if future_uses is None:
            raise ValueError("the belady policy needs the future: it is for trace replays only")
        return BeladyPolicy(future_uses)
    raise ValueError(f"unknown eviction policy {name!r}; expected lru, value or belady")
