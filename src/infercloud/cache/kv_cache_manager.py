"""Per-request block tables over a `BlockPool`, with an optional prefix cache in front.

A request's KV cache is a list of block ids (its block table); token `i` of the request lives in
slot `i % block_size` of block `block_table[i // block_size]`. The manager grows a table as the
request's tokens are computed and frees it when the request finishes or is preempted.

With a `PrefixCache`, a new request's table starts with the cached blocks of its longest cached
prefix (`match` then `allocate_slots(..., cached=...)`), each full block a request computes is
offered to the cache (`cache_blocks`), and when the pool runs short, idle cached blocks are
evicted to make room before a request is refused.

With a `SecondTier` as well, evicted blocks are copied to the host tier instead of vanishing,
and a match continues past the device prefix into the host tier for as long as copying each
block back is cheaper than recomputing it, or its shallow blocks are cheap but the deeper ones
make up for them (`TransferCostModel.blocks_worth_loading`); `allocate_slots` then loads those
blocks into fresh device blocks. The copies run synchronously through a `BlockMover`:
a block is saved while it is evicted, before anything can write to it again, and loaded before
the step that reads it is scheduled. A match is a prefix: from the first host block that is
missing, or past the loaded part, the rest is recomputed.

Invariants:
- a request's table holds exactly `ceil(num_tokens / block_size)` blocks for the largest
  `num_tokens` that `allocate_slots` accepted since its last `free`;
- `allocate_slots` is all or nothing: on refusal no block moves and nothing is evicted;
- host entries matched for a load are pinned until it is done, so saving evicted blocks in the
  same call cannot overwrite them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import RequestShape, request_class
from infercloud.cache.host_tier import HostEntry, HostTier
from infercloud.cache.prefix_cache import CacheEvent, CacheNode, Demand, PrefixCache, salt_hash
from infercloud.cache.transfer_cost import TransferCostModel


class BlockMover(Protocol):
    """Copies KV blocks between the device pool and host slots (the engine's tensors)."""

    def save(self, device_blocks: list[int], host_slots: list[int]) -> None: ...

    def load(self, host_slots: list[int], device_blocks: list[int]) -> None: ...


@dataclass(slots=True)
class SecondTier:
    tier: HostTier
    mover: BlockMover
    cost: TransferCostModel
    always_load: bool = False
    """Load every host hit without asking `cost` (an operator's override, and for tests: a
    tiny model recomputes a block faster than a page fault copies it)."""
    num_saved_blocks: int = 0
    """Device-to-host copies (migrations out)."""
    num_loaded_blocks: int = 0
    """Host-to-device copies (migrations back)."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A new request's cached prefix: device blocks, then host blocks to load after them."""

    device: list[CacheNode] = field(default_factory=list)
    host: list[HostEntry] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


NO_HIT = PrefixHit()


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows, reads and frees the block table of each request."""

    __slots__ = (
        "_cache_tail",
        "_cached_upto",
        "_demand",
        "_hit",
        "_stored",
        "_tables",
        "block_copier",
        "block_pool",
        "block_size",
        "prefix_cache",
        "second_tier",
    )

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        second_tier: SecondTier | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if prefix_cache is not None and prefix_cache.pool is not block_pool:
            raise ValueError("the prefix cache must share the manager's block pool")
        if second_tier is not None and prefix_cache is None:
            raise ValueError("a second tier needs a prefix cache in front of it")
        self.block_pool = block_pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.second_tier = second_tier
        self.block_copier: Callable[[list[int], list[int]], None] | None = None
        self._tables: dict[str, list[int]] = {}
        self._cached_upto: dict[str, int] = {}
        """Blocks of each table already offered to the prefix cache."""
        self._hit: set[str] = set()
        """Requests that started from a cached prefix."""
        self._cache_tail: dict[str, CacheNode] = {}
        """Where each request's walk down the prefix cache ended, to resume there."""
        self._stored: dict[str, list[int]] = {}
        """Blocks each request stored in the prefix cache (classified when it finishes)."""
        self._demand: dict[str, Demand] = {}
        """The prefix claim of each waiting request (`note_waiting`), with a policy that reads
        demand."""

    def use_block_copier(self, copier: Callable[[list[int], list[int]], None]) -> None:
        """`copier(src, dst)` copies the keys and values of blocks `src[i]` to `dst[i]`. With
        it and a prefix cache, a request's new blocks are the lowest ids nobody uses
        (`PrefixCache.claim_lowest`), idle cached blocks moving out of their way; without a
        prefix cache the pool's lowest free ids are that already."""
        if self.prefix_cache is None:
            return
        self.block_copier = copier
        self.prefix_cache.enable_claims()

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus idle cached ones (which eviction can free)."""
        idle = self.prefix_cache.num_idle if self.prefix_cache is not None else 0
        return self.block_pool.num_free_blocks + idle

    def match(self, salt: str, token_ids: Sequence[int]) -> PrefixHit:
        """Cached blocks a new request could start from (none without a prefix cache).

        At most `len(token_ids) - 1` tokens: the last one is always computed, for its logits.
        """
        if self.prefix_cache is None:
            return NO_HIT
        max_tokens = len(token_ids) - 1
        device = self.prefix_cache.match(salt, token_ids, max_tokens)
        second = self.second_tier
        if second is None or not len(second.tier):
            return PrefixHit(device)
        host: list[HostEntry] = []
        for parent, key, block_hash in self.prefix_cache.blocks_after(
            salt, token_ids, device, max_tokens
        ):
            entry = second.tier.lookup(salt, parent, key, block_hash)
            if entry is None:
                break
            host.append(entry)
        if host and not second.always_load:
            first = len(device) * self.block_size
            del host[second.cost.blocks_worth_loading(first, len(host)) :]
        return PrefixHit(device, host)

    @property
    def tracks_demand(self) -> bool:
        """Whether waiting requests' claims are counted (a prefix cache whose policy reads
        them); `note_waiting` is a no-op otherwise."""
        return self.prefix_cache is not None and self.prefix_cache.reads_waiting

    def note_waiting(
        self, request_id: str, salt: str, token_ids: Sequence[int], order: float
    ) -> None:
        """The request (re)joins the queue at place `order` (smaller is scheduled sooner): the
        blocks it will match count as wanted, so that a policy reading demand keeps them, the
        soonest needed first, until it is scheduled (`drop_waiting`)."""
        if self.prefix_cache is None or request_id in self._demand:
            return
        ticket = self.prefix_cache.add_demand(salt, token_ids, len(token_ids) - 1, order)
        if ticket is not None:
            self._demand[request_id] = ticket

    def drop_waiting(self, request_id: str) -> None:
        """The request left the queue (scheduled, finished or aborted); a no-op if it had no
        claim."""
        ticket = self._demand.pop(request_id, None)
        if ticket is not None and self.prefix_cache is not None:
            self.prefix_cache.drop_demand(ticket)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table can hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        now_s: float = 0.0,
        hit: PrefixHit = NO_HIT,
    ) -> bool:
        """Grow the table to hold `num_tokens` tokens; False (and no change) if blocks lack.

        `hit`, for a request without a table yet, is the matched prefix it starts from; its
        host blocks are loaded into the first new blocks, so `num_tokens` must cover them.
        """
        table = self._tables.get(request_id)
        if not hit.num_blocks and table is not None and len(table) * self.block_size >= num_tokens:
            return True  # a decode step inside its last block: nothing to add
        cached = hit.device
        if hit.num_blocks and table is not None:
            raise ValueError(f"request {request_id!r} already has blocks; cannot start from cache")
        if num_blocks_for(num_tokens, self.block_size) < hit.num_blocks:
            raise ValueError("num_tokens must cover the matched prefix")
        needed = max(0, self.num_new_blocks_needed(request_id, num_tokens) - len(cached))
        cache = self.prefix_cache
        if cache is None:
            if not self.block_pool.can_allocate(needed):
                return False
        else:
            # Matched blocks that are idle now stop being evictable once this request takes them.
            available = self.num_available_blocks - cache.num_idle_among(cached)
            if needed > available:
                return False
            if cached:
                cache.acquire(cached, now_s)
            shortfall = needed - self.block_pool.num_free_blocks
            if shortfall > 0:
                self._evict(shortfall, now_s, pinned=hit.host)
        table = self._tables.setdefault(request_id, [])
        table.extend(n.block_id for n in cached)
        if hit.num_blocks:
            self._cached_upto[request_id] = len(cached)
            self._hit.add(request_id)
        if cache is not None and self.block_copier is not None:
            new_blocks, moves = cache.claim_lowest(needed)
            if moves:
                self.block_copier([m[0] for m in moves], [m[1] for m in moves])
        else:
            new_blocks = self.block_pool.allocate(needed)
        if hit.host:
            self._load(hit.host, new_blocks[: len(hit.host)])
        table.extend(new_blocks)
        return True

    def _evict(self, num_blocks: int, now_s: float, pinned: list[HostEntry]) -> None:
        """Evict idle device blocks; with a second tier, save them there first."""
        assert self.prefix_cache is not None
        evicted = self.prefix_cache.evict(num_blocks, now_s)
        second = self.second_tier
        if second is None or not evicted:
            return
        tier = second.tier
        tier.pin(pinned)
        try:
            blocks: list[int] = []
            slots: list[int] = []
            stored: list[tuple[str, int]] = []
            dropped: list[tuple[str, int]] = []
            for node in evicted:
                assert node.parent is not None
                if node.block_hash in tier:
                    tier.touch(node.block_hash)
                    continue
                entry, gone = tier.put(node.salt, node.parent.block_hash, node.key, node.block_hash)
                dropped.extend((e.salt, e.block_hash) for e in gone)
                if entry is not None:
                    blocks.append(node.block_id)
                    slots.append(entry.slot)
                    stored.append((node.salt, node.block_hash))
        finally:
            tier.unpin(pinned)
        if blocks:
            second.mover.save(blocks, slots)
            second.num_saved_blocks += len(blocks)
        on_event = self.prefix_cache.on_event
        if on_event is not None:
            for kind, pairs in (("removed", dropped), ("stored", stored)):
                for salt in dict.fromkeys(s for s, _ in pairs):
                    hashes = tuple(h for s, h in pairs if s == salt)
                    on_event(CacheEvent(kind, hashes, None, salt, now_s, medium="host"))

    def _load(self, entries: list[HostEntry], device_blocks: list[int]) -> None:
        second = self.second_tier
        assert second is not None
        second.mover.load([e.slot for e in entries], device_blocks)
        second.num_loaded_blocks += len(entries)
        for e in entries:
            second.tier.touch(e.block_hash)

    def cache_blocks(
        self,
        request_id: str,
        salt: str,
        token_ids: Callable[[int, int], Sequence[int]],
        num_computed: int,
        now_s: float,
    ) -> None:
        """Offer the request's full, computed blocks to the prefix cache (no-op without one).

        `token_ids(start, end)` gives the request's tokens; it is called only when a block has
        filled since the last offer, so calling this every step costs nothing in between.
        """
        cache = self.prefix_cache
        if cache is None:
            return
        full = num_computed // self.block_size
        if full <= self._cached_upto.get(request_id, 0):
            return
        table = self._tables.get(request_id, [])
        tail = self._cache_tail.get(request_id)
        if tail is None or not cache.holds(tail) or tail.depth > full:
            tail = cache.root_of(salt)
        bs = self.block_size
        self._cache_tail[request_id], swaps, stored = cache.insert_from(
            tail, salt, token_ids(tail.depth * bs, full * bs), table[tail.depth : full], now_s
        )
        if stored and cache.policy.learns_outcomes:
            self._stored.setdefault(request_id, []).extend(stored)
        for i, block in swaps:  # blocks another request cached first: share the tree's
            table[tail.depth + i] = block
        self._cached_upto[request_id] = full

    def cached_tail_hash(self, request_id: str, salt: str) -> int:
        """The block hash the request's next cached block will hang from: its last block in the
        prefix cache (the root of `salt` if none). A running request's cached blocks are in
        use, so that node is still in the tree."""
        tail = self._cache_tail.get(request_id)
        if tail is None or self.prefix_cache is None or not self.prefix_cache.holds(tail):
            return salt_hash(salt)
        return tail.block_hash

    def check_invariants(self) -> None:
        """Assert the invariants (for tests): the pool's and the prefix cache's own, and that
        every block's reference count is exactly the block tables holding it plus one if the
        prefix cache holds it: no block is used by nobody, none is lost, none double-freed."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        else:
            self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for table in self._tables.values():
            for block in table:
                holders[block] += 1
        if self.prefix_cache is not None:
            for block in range(self.block_pool.num_blocks):
                if self.prefix_cache.node_of(block) is not None:
                    holders[block] += 1
        for block, count in enumerate(holders):
            refs = self.block_pool.ref_count(block)
            assert refs == count, f"block {block}: {refs} refs, {count} holders"

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str, finished: RequestShape | None = None) -> None:
        """Release every block of the request; a request without blocks is a no-op.

        Blocks the prefix cache holds stay cached (idle if nobody else uses them). `finished`:
        the request is done and this was its shape; the blocks it stored take its feature class
        (`eviction.feature_class`: whether it hit, its prompt and output lengths, the block's
        place in its chain), which the
        value policy learns reuse odds by. None (preempted, or the caller does not say): they
        stay `PENDING`.
        """
        table = self._tables.pop(request_id, None)
        self._cached_upto.pop(request_id, None)
        self._cache_tail.pop(request_id, None)
        hit = request_id in self._hit
        self._hit.discard(request_id)
        stored = self._stored.pop(request_id, None)
        if stored and finished is not None and self.prefix_cache is not None:
            request = request_class(hit, finished.prompt_tokens, finished.output_tokens)
            self.prefix_cache.record_finish(stored, request)
        if not table:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.release(table)
        else:
            self.block_pool.release(table)
