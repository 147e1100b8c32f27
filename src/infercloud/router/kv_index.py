"""What each replica holds in its prefix cache, as the router sees it.

Block hashes name whole prefixes: block i's hash is `chain_hash(hash of block i-1, its token
ids)`, starting from `salt_hash(salt)` (the engine's own functions, `cache.prefix_cache`), so a
request's prompt maps to one hash per full block and a replica holds a prefix of k blocks iff
it holds the k-th hash... as long as its view is exact. Two sources:

  - `KVIndex.apply(replica, events)`: a builtin engine's KV events (BlockStored /
    BlockRemoved, device or host tier; `reset` drops the replica's view first). Exact up to
    the polling delay.
  - `KVIndex.learn(replica, hashes, now_s)`: for upstreams that publish no events, the router
    records the blocks of each prompt it sent there, assumed cached for `ttl_s` after their last
    use, at most `max_learned_blocks` per replica (least recently used dropped first).

`cached_prefix_blocks(replica, hashes, now_s)` counts the leading blocks of a prompt the replica
holds (from either source). Pure state; the clock is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from infercloud.cache.prefix_cache import chain_hash, salt_hash


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[int]:
    """The chain hash of each full block of a prompt, as the engine's prefix cache names it."""
    out: list[int] = []
    parent = salt_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        out.append(parent)
    return out


@dataclass(slots=True)
class _ReplicaBlocks:
    device: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)
    learned: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """hash -> expiry time (s), least recently used first."""


@dataclass(slots=True)
class KVIndex:
    ttl_s: float = 120.0
    max_learned_blocks: int = 200_000
    _replicas: dict[str, _ReplicaBlocks] = field(default_factory=dict)

    def _of(self, replica: str) -> _ReplicaBlocks:
        blocks = self._replicas.get(replica)
        if blocks is None:
            blocks = self._replicas[replica] = _ReplicaBlocks()
        return blocks

    def forget(self, replica: str) -> None:
        """Drop all that is known of a replica (it restarted, or was removed)."""
        self._replicas.pop(replica, None)

    def apply(self, replica: str, events: Iterable[dict[str, object]], reset: bool) -> None:
        """Apply KV events in the engine's `/kv_events` format."""
        if reset:
            self.forget(replica)
        for e in events:
            hashes = e.get("block_hashes") or []
            assert isinstance(hashes, list)
            stored = e.get("type") == "BlockStored"
            self.record(replica, stored, [int(h) for h in hashes], e.get("medium") == "host")

    def record(self, replica: str, stored: bool, hashes: Iterable[int], host: bool) -> None:
        """One event, already parsed: `hashes` stored on (or removed from) a tier."""
        blocks = self._of(replica)
        tier = blocks.host if host else blocks.device
        if stored:
            tier.update(hashes)
        else:
            tier.difference_update(hashes)

    def learn(self, replica: str, hashes: Sequence[int], now_s: float) -> None:
        learned = self._of(replica).learned
        expiry = now_s + self.ttl_s
        for h in hashes:
            learned[h] = expiry
            learned.move_to_end(h)
        while len(learned) > self.max_learned_blocks:
            learned.popitem(last=False)

    def cached_prefix_blocks(self, replica: str, hashes: Sequence[int], now_s: float) -> int:
        blocks = self._replicas.get(replica)
        if blocks is None:
            return 0
        n = 0
        for h in hashes:
            if h in blocks.device or h in blocks.host:
                n += 1
                continue
            expiry = blocks.learned.get(h)
            if expiry is None or expiry < now_s:
                break
            n += 1
        return n

    def num_blocks(self, replica: str) -> int:
        blocks = self._replicas.get(replica)
        return 0 if blocks is None else len(blocks.device | blocks.host) + len(blocks.learned)
