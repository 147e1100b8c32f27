"""The second tier: a bounded store of KV blocks evicted from the device pool, keyed by prefix.

When the device prefix cache evicts an idle block, the engine can copy its keys and values into
one of `num_slots` host slots instead of dropping them. An entry is named by its block's chain
hash (which names the whole prefix up to and including the block, salt included), and it keeps
the block's salt, parent hash and token ids, so a lookup is verified against all three: a match
never crosses salts, even on a hash collision. A later request whose prefix continues past the
device match looks up the following blocks here and, where copying back pays, the engine loads
them into fresh device blocks instead of recomputing them.

The tier is inclusive: a loaded entry stays here, so a block evicted from the device again costs
no second copy. Entries go in least-recently-used order (stored, loaded or re-offered counts as
use); pinned entries (matched for a load that has not happened yet) are never evicted.

This module decides which slot holds what; the bytes live with the engine (`HostKVStore`).

Invariants:
- `len(self) + num_free_slots == num_slots`; every slot is free or holds exactly one entry;
- a pinned entry is never evicted;
- `lookup` returns an entry only if its salt, parent hash and token ids are those asked for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostEntry:
    block_hash: int
    parent_hash: int
    """The chain hash of the block before (the salt's root hash for a prompt's first block)."""
    key: tuple[int, ...]
    """The block's token ids."""
    salt: str
    slot: int


class HostTier:
    """Which host slot holds which evicted block; LRU among unpinned entries."""

    __slots__ = ("_entries", "_free", "_pins", "num_evicted", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()
        """By block hash, least recently used first."""
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def lookup(
        self, salt: str, parent_hash: int, key: tuple[int, ...], block_hash: int
    ) -> HostEntry | None:
        entry = self._entries.get(block_hash)
        if entry is None or entry.salt != salt or entry.parent_hash != parent_hash:
            return None
        return entry if entry.key == key else None

    def touch(self, block_hash: int) -> None:
        """Mark an entry as just used (no-op for an unknown hash)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def put(
        self, salt: str, parent_hash: int, key: tuple[int, ...], block_hash: int
    ) -> tuple[HostEntry | None, list[HostEntry]]:
        """Reserve a slot for a block about to be copied here; returns (entry, evicted).

        An entry already present is touched and returned as is (`evicted` empty; nothing to
        copy: the caller checks `block_hash in tier` first to skip the copy). Returns
        (None, []) when every slot is pinned: the block is then simply dropped.
        """
        evicted: list[HostEntry] = []
        present = self._entries.get(block_hash)
        if present is not None:
            self._entries.move_to_end(block_hash)
            return present, evicted
        if not self._free:
            victim = next((h for h in self._entries if h not in self._pins), None)
            if victim is None:
                return None, evicted
            gone = self._entries.pop(victim)
            self._free.append(gone.slot)
            self.num_evicted += 1
            evicted.append(gone)
        entry = HostEntry(block_hash, parent_hash, key, salt, self._free.pop())
        self._entries[block_hash] = entry
        return entry, evicted

    def pin(self, entries: list[HostEntry]) -> None:
        for e in entries:
            self._pins[e.block_hash] = self._pins.get(e.block_hash, 0) + 1

    def unpin(self, entries: list[HostEntry]) -> None:
        for e in entries:
            left = self._pins[e.block_hash] - 1
            if left:
                self._pins[e.block_hash] = left
            else:
                del self._pins[e.block_hash]

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        assert len(set(slots)) == len(slots), "two entries share a slot"
        assert not set(slots) & set(self._free), "a slot is both free and held"
        assert len(slots) + len(self._free) == self.num_slots
        assert all(h in self._entries for h in self._pins), "a pinned entry was evicted"
