"""Per-request block tables over a `BlockPool`.

A request's KV cache is a list of block ids (its block table); token `i` of the request lives in
slot `i % block_size` of block `block_table[i // block_size]`. The manager grows a table as the
request's tokens are computed and frees it when the request finishes or is preempted.

Invariants:
- a request's table holds exactly `ceil(num_tokens / block_size)` blocks for the largest
  `num_tokens` that `allocate_slots` accepted since its last `free`;
- `allocate_slots` is all or nothing: on refusal no block moves.
"""

from __future__ import annotations

from infercloud.cache.block_pool import BlockPool


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows, reads and frees the block table of each request."""

    __slots__ = ("_tables", "block_pool", "block_size")

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table can hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table to hold `num_tokens` tokens; False (and no change) if blocks lack."""
        needed = self.num_new_blocks_needed(request_id, num_tokens)
        if not self.block_pool.can_allocate(needed):
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self.block_pool.allocate(needed))
        return True

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block of the request; a request without blocks is a no-op."""
        table = self._tables.pop(request_id, None)
        if table:
            self.block_pool.release(table)
