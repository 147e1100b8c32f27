"""Per-request block tables over a `BlockPool`, with an optional prefix cache in front.

A request's KV cache is a list of block ids (its block table); token `i` of the request lives in
slot `i % block_size` of block `block_table[i // block_size]`. The manager grows a table as the
request's tokens are computed and frees it when the request finishes or is preempted.

With a `PrefixCache`, a new request's table starts with the cached blocks of its longest cached
prefix (`match` then `allocate_slots(..., cached=...)`), each full block a request computes is
offered to the cache (`cache_blocks`), and when the pool runs short, idle cached blocks are
evicted to make room before a request is refused.

Invariants:
- a request's table holds exactly `ceil(num_tokens / block_size)` blocks for the largest
  `num_tokens` that `allocate_slots` accepted since its last `free`;
- `allocate_slots` is all or nothing: on refusal no block moves and nothing is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.prefix_cache import CacheNode, PrefixCache


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows, reads and frees the block table of each request."""

    __slots__ = ("_cached_upto", "_hit", "_tables", "block_pool", "block_size", "prefix_cache")

    def __init__(
        self, block_pool: BlockPool, block_size: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if prefix_cache is not None and prefix_cache.pool is not block_pool:
            raise ValueError("the prefix cache must share the manager's block pool")
        self.block_pool = block_pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._tables: dict[str, list[int]] = {}
        self._cached_upto: dict[str, int] = {}
        """Blocks of each table already offered to the prefix cache."""
        self._hit: set[str] = set()
        """Requests that started from a cached prefix."""

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus idle cached ones (which eviction can free)."""
        idle = self.prefix_cache.num_idle if self.prefix_cache is not None else 0
        return self.block_pool.num_free_blocks + idle

    def match(self, salt: str, token_ids: Sequence[int]) -> list[CacheNode]:
        """Cached blocks a new request could start from (none without a prefix cache).

        At most `len(token_ids) - 1` tokens: the last one is always computed, for its logits.
        """
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(salt, token_ids, len(token_ids) - 1)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table can hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        now_s: float = 0.0,
        cached: Sequence[CacheNode] = (),
    ) -> bool:
        """Grow the table to hold `num_tokens` tokens; False (and no change) if blocks lack.

        `cached`, for a request without a table yet, are matched blocks it starts from.
        """
        if cached and request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks; cannot start from cache")
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
                cache.evict(shortfall, now_s)
        table = self._tables.setdefault(request_id, [])
        table.extend(n.block_id for n in cached)
        if cached:
            self._cached_upto[request_id] = len(cached)
            self._hit.add(request_id)
        table.extend(self.block_pool.allocate(needed))
        return True

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
        cache.insert(
            salt,
            token_ids(0, full * self.block_size),
            table[:full],
            now_s,
            extends_hit=request_id in self._hit,
        )
        self._cached_upto[request_id] = full

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block of the request; a request without blocks is a no-op.

        Blocks the prefix cache holds stay cached (idle if nobody else uses them).
        """
        table = self._tables.pop(request_id, None)
        self._cached_upto.pop(request_id, None)
        self._hit.discard(request_id)
        if not table:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.release(table)
        else:
            self.block_pool.release(table)
