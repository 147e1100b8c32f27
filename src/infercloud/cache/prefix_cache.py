"""The prefix cache: a radix tree over full KV blocks, shared across requests, per salt.

Each tree node is one full block of `block_size` tokens; its children are keyed by the next
block's token ids, so a path from a root spells a token prefix at block granularity. There is one
root per salt (the namespace: a tenant, a group of tenants an operator puts together, or a
request's own `cache_salt`), and nothing ever matches across roots: a request cannot hit, and so
cannot time, another namespace's prompts.

The tree holds one reference on the block pool for each node's block, so a cached block is in
use from the pool's point of view. A node is *idle* when the tree's reference is the only one.
Since a request that uses a block also holds every block before it, the idle nodes form whole
subtrees; the idle leaves are the candidates for eviction, ranked by an `EvictionPolicy`, and
evicting a leaf can make its parent a candidate.

Partial blocks are never cached: the last, partly filled block of a request stays private. A
match stops at `max_tokens` (callers pass one less than the prompt, so the last prompt token is
always computed and yields logits), and never returns a block that would be written again.

Invariants (tested with hypothesis):
- `pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks`, and every node's block has a
  reference count >= 1 (the tree's);
- `num_idle` equals the number of nodes whose block's reference count is exactly 1, and each idle
  leaf is in the candidate set;
- a block with two references or more is in the tree (requests share blocks only through it,
  and it gives up only idle blocks), which the ledger's meter relies on;
- `match` returns only nodes under the root of the salt asked for;
- with claims on (`enable_claims`), `claim_lowest` hands a request the lowest ids that nobody
  uses: a free id, or an idle cached one whose node (and history) moves to a free id first;
  so the blocks of running requests stay packed at the start of the pool, as without a cache.
  Which blocks stay cached is still the policy's choice alone: a move changes no node's place
  in the tree, reference count or priority (only the block id, which LRU breaks ties by);
- with a policy that reads demand, each cached block's `BlockStats.waiting` equals the number
  of live `add_demand` tickets that contain its prefix hash (zero otherwise), and its
  `wanted_order` the smallest of their queue orders (inf if none).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import numpy.typing as npt

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import BlockStats, EvictionPolicy, Ghost

EVICTED_HASHES_KEPT = 1 << 16


def salt_hash(salt: str) -> int:
    """A stable 63-bit id for a salt (Python's str hash changes between processes)."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


HASH_MASK = (1 << 63) - 1


def chain_hash(parent_hash: int, key: tuple[int, ...]) -> int:
    """The hash of a block given its parent's: names the whole prefix, not just the block."""
    return hash((parent_hash, key)) & HASH_MASK


@dataclass(eq=False, slots=True)
class CacheNode:
    key: tuple[int, ...]
    """This block's token ids (empty for a root)."""
    block_id: int
    """The pool block holding its keys and values (-1 for a root)."""
    block_hash: int
    parent: CacheNode | None
    depth: int
    """Blocks from the root: 1 for a prompt's first block."""
    salt: str
    children: dict[tuple[int, ...], CacheNode] = field(default_factory=dict)

    @property
    def num_tokens_to(self) -> int:
        """Tokens in the prefix this node ends (depth x block size)."""
        return self.depth * len(self.key)


class RecentlyEvicted:
    """The latest evicted blocks by prefix hash, each with its history (`Ghost`) when the
    policy learns from outcomes, else None: at least the last `capacity` distinct ones and at
    most twice as many. Two generations of dicts, the older dropped whole when the newer holds
    `capacity` (an add and a lookup are each a dict operation, nothing to trim per block); a
    hash added again counts from then."""

    __slots__ = ("_capacity", "_new", "_old")

    def __init__(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._new: dict[int, Ghost | None] = {}
        self._old: dict[int, Ghost | None] = {}

    def add_all(self, hashes: Iterable[int], histories: Iterable[Ghost] | None = None) -> None:
        values: Iterable[Ghost | None] = repeat(None) if histories is None else histories
        new = self._new
        for h, history in zip(hashes, values, strict=False):  # values may be endless
            new[h] = history
            if len(new) >= self._capacity:
                self._old, self._new = new, {}
                new = self._new

    def pop_history(self, block_hash: int) -> Ghost | None:
        """The history of an evicted block, forgotten (its prefix is cached again)."""
        history = self._new.pop(block_hash, None)
        if history is None:
            history = self._old.pop(block_hash, None)
        return history

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._new or block_hash in self._old

    def __bool__(self) -> bool:
        return bool(self._new or self._old)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A change of the cache's contents, for routers (vLLM's BlockStored / BlockRemoved)."""

    kind: str
    """"stored" or "removed"."""
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    salt: str
    time_s: float
    medium: str = "device"
    """Where the blocks are (or were): "device" (the engine's pool) or "host" (the second tier).
    A "stored" event with a parent hash continues that block's chain; the second tier's events
    carry none (their blocks may hang off a chain that is partly on the device)."""

    def as_dict(self) -> dict[str, object]:
        """The wire form (`/kv_events`, vLLM's event names), as `router.kv_index` reads it."""
        return {
            "type": "BlockStored" if self.kind == "stored" else "BlockRemoved",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_hash,
            "salt": self.salt,
            "medium": self.medium,
            "time_s": self.time_s,
        }


@dataclass(frozen=True, slots=True)
class Demand:
    """A waiting request's claim on the prefix it will look up (`PrefixCache.add_demand`):
    its full blocks' token ids and prefix hashes, under its salt, and its place in the queue
    (`order`: smaller is scheduled sooner), to give back with `PrefixCache.drop_demand` when
    it leaves the queue."""

    salt: str
    keys: tuple[tuple[int, ...], ...]
    hashes: tuple[int, ...]
    order: float


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        policy: EvictionPolicy,
        on_event: Callable[[CacheEvent], None] | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self.on_event = on_event
        self._roots: dict[str, CacheNode] = {}
        self._by_block: dict[int, CacheNode] = {}
        self._candidates: set[int] = set()
        """Block ids of idle leaves."""
        self._static = bool(getattr(policy, "static_priorities", False))
        self._priority: Callable[[BlockStats, int], float] | None = getattr(
            policy, "priority", None
        )
        """A static policy's priority of one block (the same float `priorities` gives)."""
        self._ranked: list[tuple[float, int, int]] = []
        """With a static policy: (priority, block, version) of candidates as they became
        candidates, a heap; entries whose block left the candidates since are skipped."""
        self._version = [0] * pool.num_blocks
        self._claimable: list[int] | None = None
        """With claims on: a min-heap of ids that may be free or idle cached (checked when
        popped; an id can appear more than once), from which `claim_lowest` takes."""
        self.stats = BlockStats.empty(pool.num_blocks)
        self.num_idle = 0
        self.num_evicted_blocks = 0
        self.num_moved_blocks = 0
        """Idle cached blocks moved to another id by `claim_lowest`."""
        self.reads_waiting = bool(getattr(policy, "reads_waiting", False))
        """Whether the policy ranks by `BlockStats.waiting`: only then is demand counted."""
        self._demand: dict[int, list[float]] = {}
        """Per prefix hash, the queue orders of the waiting requests whose prompt contains it
        (`add_demand`), cached or not: a block stored later for that prefix starts with them."""
        self._queue_orders: dict[float, int] = {}
        """The queue orders of all live demands (how many at each), for the queue's head."""
        self.recently_evicted = RecentlyEvicted(EVICTED_HASHES_KEPT)
        """The latest evicted blocks (at least the last `EVICTED_HASHES_KEPT`), so that the
        ledger can tell context that is computed again from context never seen and, with a
        policy that learns from outcomes, a block stored again for one of these prefixes
        resumes its history (`BlockStats.record_revival`): the policy learns from the reuses
        it missed as well as from its hits."""

    # -- lookups -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_block)

    def node_of(self, block_id: int) -> CacheNode | None:
        return self._by_block.get(block_id)

    def match(self, salt: str, token_ids: Sequence[int], max_tokens: int) -> list[CacheNode]:
        """The longest cached prefix of `token_ids` under `salt`, at most `max_tokens` long."""
        root = self._roots.get(salt)
        if root is None:
            return []
        bs = self.block_size
        nodes: list[CacheNode] = []
        node = root
        for start in range(0, max(0, max_tokens) // bs * bs, bs):
            child = node.children.get(tuple(token_ids[start : start + bs]))
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def blocks_after(
        self, salt: str, token_ids: Sequence[int], hit: Sequence[CacheNode], max_tokens: int
    ) -> Iterator[tuple[int, tuple[int, ...], int]]:
        """(parent hash, token ids, block hash) of each full block of `token_ids` after the
        prefix `hit`, up to `max_tokens`: the names those blocks have or had in this cache."""
        bs = self.block_size
        parent = hit[-1].block_hash if hit else salt_hash(salt)
        for start in range(len(hit) * bs, max(0, max_tokens) // bs * bs, bs):
            key = tuple(token_ids[start : start + bs])
            block_hash = chain_hash(parent, key)
            yield parent, key, block_hash
            parent = block_hash

    def num_evicted_after(
        self, salt: str, token_ids: Sequence[int], hit: Sequence[CacheNode], max_tokens: int
    ) -> int:
        """Tokens right after the cached prefix `hit` whose blocks this cache held once and
        has evicted (consecutive full blocks whose prefix hash is among the recently evicted)."""
        if not self.recently_evicted:
            return 0
        count = 0
        for _, _, block_hash in self.blocks_after(salt, token_ids, hit, max_tokens):
            if block_hash not in self.recently_evicted:
                break
            count += self.block_size
        return count

    def num_idle_among(self, nodes: Iterable[CacheNode]) -> int:
        return sum(1 for n in nodes if self.pool.ref_count(n.block_id) == 1)

    # -- demand of waiting requests ---------------------------------------------------------

    def add_demand(
        self, salt: str, token_ids: Sequence[int], max_tokens: int, order: float
    ) -> Demand | None:
        """A request joins the queue at place `order` (smaller is scheduled sooner): each full
        block of its first `max_tokens` tokens is wanted by one more waiting request, cached
        now or stored later (`BlockStats.waiting`, `wanted_order`). None when the policy does
        not read demand. Give the result back with `drop_demand` exactly once."""
        if not self.reads_waiting:
            return None
        bs = self.block_size
        keys = tuple(
            tuple(token_ids[start : start + bs])
            for start in range(0, max(0, max_tokens) // bs * bs, bs)
        )
        hashes: list[int] = []
        parent = salt_hash(salt)
        demand = self._demand
        for key in keys:
            parent = chain_hash(parent, key)
            hashes.append(parent)
            demand.setdefault(parent, []).append(order)
        self._queue_orders[order] = self._queue_orders.get(order, 0) + 1
        ticket = Demand(salt, keys, tuple(hashes), order)
        self._refresh_cached(ticket)
        return ticket

    def drop_demand(self, ticket: Demand | None) -> None:
        """The request of `ticket` left the queue (scheduled, finished or aborted)."""
        if ticket is None:
            return
        demand = self._demand
        for h in ticket.hashes:
            orders = demand[h]
            orders.remove(ticket.order)
            if not orders:
                del demand[h]
        left = self._queue_orders[ticket.order] - 1
        if left:
            self._queue_orders[ticket.order] = left
        else:
            del self._queue_orders[ticket.order]
        self._refresh_cached(ticket)

    def _refresh_cached(self, ticket: Demand) -> None:
        """The demand on the ticket's blocks changed: those cached now (a prefix of them: the
        tree is closed under prefixes) take it."""
        node = self._roots.get(ticket.salt)
        for key, block_hash in zip(ticket.keys, ticket.hashes, strict=True):
            if node is None:
                return
            node = node.children.get(key)
            if node is not None:
                self._set_wanted(node.block_id, block_hash)

    def _set_wanted(self, block: int, block_hash: int) -> None:
        """`BlockStats.waiting` and `wanted_order` of a cached block, from the demand."""
        orders = self._demand.get(block_hash)
        self.stats.waiting[block] = len(orders) if orders else 0
        self.stats.wanted_order[block] = min(orders) if orders else np.inf

    # -- references ----------------------------------------------------------------------------

    def acquire(self, nodes: Sequence[CacheNode], now_s: float) -> None:
        """A request starts using these matched blocks: one more reference each, a hit each."""
        for node in nodes:
            block = node.block_id
            if self.pool.ref_count(block) == 1:
                self.num_idle -= 1
                self._candidates.discard(block)
            self.pool.retain(block)
            self.stats.record_hit(block, now_s)

    def release(self, block_ids: Sequence[int]) -> None:
        """A request drops its blocks; cached ones stay in the tree (idle if nobody uses them)."""
        self.pool.release(list(block_ids))
        new: list[int] = []
        for block in block_ids:
            node = self._by_block.get(block)
            if node is not None and self.pool.ref_count(block) == 1:
                self.num_idle += 1
                if not node.children:
                    new.append(block)
        self._add_candidates(new)
        if self._claimable is not None:
            self._offer_claimable(block_ids)

    # -- placement: the lowest unused ids for running requests ---------------------------------

    def enable_claims(self) -> None:
        """Turn on `claim_lowest` (the engine does, on a CPU, where it also copies the blocks)."""
        pool = self.pool
        self._claimable = [b for b in range(pool.num_blocks) if self._is_claimable(b)]

    def _is_claimable(self, block: int) -> bool:
        ref = self.pool.ref_count(block)
        return ref == 0 or (ref == 1 and block in self._by_block)

    def _offer_claimable(self, block_ids: Iterable[int]) -> None:
        heap = self._claimable
        assert heap is not None
        for block in block_ids:
            if self._is_claimable(block):
                heapq.heappush(heap, block)
        if len(heap) > 2 * self.pool.num_blocks + 1024:
            self.enable_claims()  # drop the stale entries

    def claim_lowest(self, num_blocks: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Take `num_blocks` blocks for a request (one reference each): the lowest ids that are
        free or hold an idle cached block. Each idle cached block taken moves first to the
        lowest free id; the moves, (from, to), are returned, and the caller copies those
        blocks' keys and values before anything writes them. No destination is also a source.

        Needs `num_blocks` free blocks (evict first); claims must be on (`enable_claims`).
        Blocks of running requests so stay packed toward the start of the pool, as they do
        without a cache, instead of spreading wherever eviction freed a block: on a CPU, decode
        attention reads blocks that lie next to each other faster (an anchor round with
        shuffled blocks took 14% longer on an AMX Xeon, 5-8% on a Zen 4 EPYC).
        """
        heap = self._claimable
        assert heap is not None, "claims are off"
        pool = self.pool
        if num_blocks > pool.num_free_blocks:
            pool.allocate(num_blocks)  # raises BlockPoolExhaustedError, changing nothing
        taken: list[int] = []
        moves: list[tuple[int, int]] = []
        moved_to: set[int] = set()
        for _ in range(num_blocks):
            free = pool.lowest_free()
            assert free is not None
            while (
                heap and heap[0] < free and (heap[0] in moved_to or not self._is_claimable(heap[0]))
            ):
                heapq.heappop(heap)  # stale (in use now), or moved to in this claim
            if not heap or heap[0] >= free:
                taken.extend(pool.allocate(1))  # the lowest unused id is free
                continue
            block = heapq.heappop(heap)  # an idle cached block below every free id
            (dst,) = pool.allocate(1)
            self._move(block, dst)
            moves.append((block, dst))
            moved_to.add(dst)
            taken.append(block)  # its one reference, the tree's until now, is the request's
        if moves:
            self.num_moved_blocks += len(moves)
            self._offer_claimable([dst for _, dst in moves])  # after: no chained moves
        return taken, moves

    def _move(self, src: int, dst: int) -> None:
        """The idle cached block at `src` now lives at the free (just allocated) id `dst`."""
        node = self._by_block.pop(src)
        node.block_id = dst
        self._by_block[dst] = node
        self.stats.move(src, dst)
        self._version[src] += 1  # rankings of `src` are dead
        if src in self._candidates:
            self._candidates.discard(src)
            self._add_candidates([dst])

    def _add_candidates(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self._candidates.update(blocks)
        if not self._static:
            return
        # static priorities do not depend on the time (`LRUPolicy.static_priorities`)
        ranked = self._ranked
        if self._priority is not None and len(blocks) < 16:
            for block in blocks:
                heapq.heappush(ranked, self._rank(block))
        else:
            ids = np.array(blocks, dtype=np.int64)
            priorities = self.policy.priorities(self.stats, ids, 0.0).tolist()
            version = self._version
            for block, p in zip(blocks, priorities, strict=True):
                version[block] += 1
                heapq.heappush(ranked, (p, block, version[block]))
        if len(ranked) > 4 * len(self._candidates) + 1024:
            self._ranked = [e for e in ranked if self._live(e)]
            heapq.heapify(self._ranked)

    def _rank(self, block: int) -> tuple[float, int, int]:
        """A new ranking entry for a candidate (a static policy with a scalar priority)."""
        assert self._priority is not None
        self._version[block] += 1
        return (self._priority(self.stats, block), block, self._version[block])

    def _live(self, entry: tuple[float, int, int]) -> bool:
        _, block, version = entry
        return block in self._candidates and self._version[block] == version

    def holds(self, node: CacheNode) -> bool:
        """Whether `node` is still in the tree (a node, once removed, never comes back)."""
        if node.block_id < 0:
            return self._roots.get(node.salt) is node
        return self._by_block.get(node.block_id) is node

    def insert_from(
        self,
        node: CacheNode,
        salt: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        now_s: float,
    ) -> tuple[CacheNode, list[tuple[int, int]], list[int]]:
        """Cache the full blocks of a request's computed prefix below `node` (in the tree,
        under `salt`; the root for a whole prompt): `token_ids` and `block_ids` continue the
        prefix `node` ends. Returns the node the walk ended at, to resume from when the
        request's next block fills, the blocks to swap in the request's table, and the blocks
        this call stored (the request's own, to pass to `record_finish` when it finishes).

        `block_ids[i]` holds tokens `i * block_size ..` of `token_ids`; only whole blocks count.
        A block whose prefix another request cached first (both computed it at once) is a
        duplicate: the request takes the tree's block instead (a reference, as a hit would)
        and its own is released; `(i, tree block)` says which entry of its table to swap. So a
        request always holds the tree's blocks of its cached prefix, and the idle nodes stay
        whole subtrees (no idle parent above a block in use).
        """
        bs = self.block_size
        n = min(len(block_ids), len(token_ids) // bs)
        swaps: list[tuple[int, int]] = []
        i = 0
        key: tuple[int, ...] = ()
        # the part of the prefix the tree has already
        while i < n:
            key = tuple(token_ids[i * bs : (i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                break
            if child.block_id != block_ids[i]:
                self.acquire([child], now_s)
                self.pool.release([block_ids[i]])
                if self._claimable is not None:
                    self._offer_claimable([block_ids[i]])
                swaps.append((i, child.block_id))
            node = child
            i += 1
        if i == n:
            return node, swaps, []
        # the rest hangs from `node` as a fresh chain (a new node has no children to look up)
        by_block = self._by_block
        block = block_ids[i]
        if block in by_block:
            return node, swaps, []  # this block caches another prefix: keep the tree as is
        parent_hash = node.block_hash if node.block_id >= 0 else None
        if node.block_id >= 0 and not node.children:
            self._candidates.discard(node.block_id)
        stored: list[int] = []
        blocks: list[int] = []
        depth = node.depth
        parent = node
        while True:
            depth += 1
            block_hash = hash((parent.block_hash, key)) & HASH_MASK  # chain_hash, inlined
            child = CacheNode(key, block, block_hash, parent, depth, salt, {})
            parent.children[key] = child
            by_block[block] = child
            stored.append(block_hash)
            blocks.append(block)
            parent = child
            i += 1
            if i == n:
                break
            block = block_ids[i]
            if block in by_block:
                break
            key = tuple(token_ids[i * bs : (i + 1) * bs])
        for block in blocks:
            self.pool.retain(block)
        depths = list(range(node.depth + 1, node.depth + 1 + len(blocks)))
        stats = self.stats
        stats.record_inserts(blocks, depths, stored, now_s)
        if self._demand:
            for block, block_hash in zip(blocks, stored, strict=True):
                self._set_wanted(block, block_hash)
        if self.policy.learns_outcomes:
            evicted = self.recently_evicted
            for block, block_hash in zip(blocks, stored, strict=True):
                ghost = evicted.pop_history(block_hash)
                if ghost is not None:
                    stats.record_revival(block, ghost, now_s)
        if self.on_event is not None:
            self.on_event(CacheEvent("stored", tuple(stored), parent_hash, salt, now_s))
        return parent, swaps, blocks

    def record_finish(self, blocks: Sequence[int], request: int) -> None:
        """The request that stored `blocks` (`insert_from`) finished, before releasing them:
        they take feature classes from its class (`eviction.request_class`) and their places
        in its chain, which the policy learns from. Blocks no longer in the tree are skipped."""
        if not self.policy.learns_outcomes:
            return
        held = [b for b in blocks if b in self._by_block]
        if held:
            self.stats.record_finish(held, request)

    # -- eviction ------------------------------------------------------------------------------

    def evict(self, num_blocks: int, now_s: float) -> list[CacheNode]:
        """Free `num_blocks` idle blocks (fewer if fewer are idle), lowest priority first.

        The idle leaves are ranked once; a parent that becomes an idle leaf when its last child
        goes is ranked then and competes with the rest, so the order is the policy's greedy one.
        """
        evicted: list[CacheNode] = []
        if num_blocks <= 0 or not self._candidates:
            return evicted
        if self._static:
            self._evict_ranked(num_blocks, evicted)
        else:
            self._evict_ranking(num_blocks, now_s, evicted)
        evicted_hashes = (n.block_hash for n in evicted)
        if self.policy.learns_outcomes and evicted:
            stats = self.stats
            stats.record_eviction([n.block_id for n in evicted], now_s)
            histories = (stats.ghost(n.block_id) for n in evicted)
            self.recently_evicted.add_all(evicted_hashes, histories)
        else:
            self.recently_evicted.add_all(evicted_hashes)
        if self.on_event is not None and evicted:
            by_salt: dict[str, list[int]] = {}
            for n in evicted:
                by_salt.setdefault(n.salt, []).append(n.block_hash)
            for salt, hashes in by_salt.items():
                self.on_event(CacheEvent("removed", tuple(hashes), None, salt, now_s))
        self.num_evicted_blocks += len(evicted)
        return evicted

    def _evict_ranked(self, num_blocks: int, evicted: list[CacheNode]) -> None:
        """Static priorities: pop the standing ranking, the same greedy order as ranking all
        candidates now. A parent left an idle leaf is ranked at once: if its entry would be the
        next one popped it is evicted right away, without entering the candidates or the heap
        (a request's chain of blocks goes leaf to root), else it joins both. The blocks taken
        out are released to the pool together at the end."""
        ranked = self._ranked
        version = self._version
        candidates = self._candidates
        ref_count = self.pool.ref_count
        priority, stats = self._priority, self.stats
        unlinked: list[int] = []  # taken out of the tree, to release to the pool at once
        while ranked and len(evicted) < num_blocks:
            _, block, entry_version = heapq.heappop(ranked)
            if version[block] != entry_version or block not in candidates:
                continue  # the block left the candidates since it was ranked
            node = self._by_block[block]
            if priority is None:
                evicted.append(self._remove(node))
                continue
            while True:
                parent = self._unlink(node)
                evicted.append(node)
                unlinked.append(node.block_id)
                block = parent.block_id
                if block < 0 or parent.children or ref_count(block) != 1:
                    break
                # the parent is an idle leaf now: next in line, or ranked with the rest
                p = priority(stats, block)
                if len(evicted) == num_blocks or (
                    ranked and ranked[0] < (p, block, version[block] + 1)
                ):
                    version[block] += 1  # `_rank`, inlined
                    candidates.add(block)
                    heapq.heappush(ranked, (p, block, version[block]))
                    break
                node = parent  # it would be popped next: evict it now
        self.pool.release(unlinked)

    def _evict_ranking(self, num_blocks: int, now_s: float, evicted: list[CacheNode]) -> None:
        if self._queue_orders:
            self.stats.queue_head_order = min(self._queue_orders)
        candidates = np.fromiter(self._candidates, dtype=np.int64, count=len(self._candidates))
        rank = self._ranking(now_s)
        priorities = rank(candidates)
        heap = list(zip(priorities.tolist(), candidates.tolist(), strict=True))
        heapq.heapify(heap)
        ahead: dict[int, float] = {}
        """Priorities of the idle blocks above a candidate, ranked with its chain at once."""
        while heap and len(evicted) < num_blocks:
            _, block = heapq.heappop(heap)
            node = self._by_block[block]
            parent = node.parent
            evicted.append(self._remove(node))
            if parent is not None and parent.block_id in self._candidates:
                priority = ahead.get(parent.block_id)
                if priority is None:
                    chain = self._idle_chain(parent)
                    ranked = rank(np.array(chain, dtype=np.int64)).tolist()
                    ahead.update(zip(chain, ranked, strict=True))
                    priority = ahead[parent.block_id]
                heapq.heappush(heap, (priority, parent.block_id))

    def _idle_chain(self, node: CacheNode) -> list[int]:
        """`node`'s block and those of its ancestors that would be idle leaves in turn as the
        one below each goes (idle, and that one their only child): the blocks an eviction may
        rank next, in one call to the policy instead of one each."""
        chain = [node.block_id]
        ref_count = self.pool.ref_count
        up = node.parent
        while up is not None and up.block_id >= 0 and len(up.children) == 1:
            if ref_count(up.block_id) != 1:
                break
            chain.append(up.block_id)
            up = up.parent
        return chain

    def _ranking(self, now_s: float) -> Callable[[npt.NDArray[np.int64]], npt.NDArray[np.float64]]:
        """The policy's priorities at `now_s` for this eviction (the stats do not change
        until it is done): its `ranking`, which prepares what all candidates share once,
        where it has one."""
        ranking = getattr(self.policy, "ranking", None)
        if ranking is not None:
            return ranking(self.stats, now_s)  # type: ignore[no-any-return]
        stats, policy = self.stats, self.policy
        return lambda candidates: policy.priorities(stats, candidates, now_s)

    def _remove(self, node: CacheNode) -> CacheNode:
        """Take an idle leaf out of the tree and free its block; a parent left an idle leaf
        becomes a candidate."""
        parent = self._unlink(node)
        self.pool.release([node.block_id])
        block = parent.block_id
        if block >= 0 and not parent.children and self.pool.ref_count(block) == 1:
            self._add_candidates([block])
        return node

    def _unlink(self, node: CacheNode) -> CacheNode:
        """Take an idle leaf out of the tree (its block still to be released by the caller);
        returns its parent. A root left without children goes too."""
        block = node.block_id
        parent = node.parent
        assert parent is not None and not node.children
        siblings = parent.children
        if len(siblings) == 1:  # a chain: no need to hash the key (its ints are cold by now)
            siblings.clear()
        else:
            del siblings[node.key]
        del self._by_block[block]
        self._candidates.discard(block)
        self.num_idle -= 1
        if parent.block_id < 0 and not parent.children:
            del self._roots[node.salt]
        return parent

    def root_of(self, salt: str) -> CacheNode:
        """The root of `salt`'s tree (made if it has none)."""
        root = self._roots.get(salt)
        if root is None:
            root = CacheNode((), -1, salt_hash(salt), None, 0, salt)
            self._roots[salt] = root
        return root

    def check_invariants(self) -> None:
        """Assert the module's invariants (for tests)."""
        pool = self.pool
        pool.check_invariants()
        idle = 0
        for block, node in self._by_block.items():
            ref = pool.ref_count(block)
            assert ref >= 1, f"cached block {block} has no reference"
            if ref == 1:
                idle += 1
                assert not any(pool.ref_count(c.block_id) > 1 for c in node.children.values())
                assert (block in self._candidates) == (not node.children)
            else:
                assert block not in self._candidates
            orders = self._demand.get(node.block_hash, [])
            assert self.stats.waiting[block] == len(orders), "waiting count out of step"
            assert self.stats.wanted_order[block] == min(orders, default=np.inf)
            root = node
            while root.parent is not None:
                root = root.parent
            assert self._roots.get(node.salt) is root
        assert idle == self.num_idle
        assert (self.stats.state_reused <= self.stats.state_entered).all()
        shared = (b for b in range(pool.num_blocks) if pool.ref_count(b) >= 2)
        assert all(b in self._by_block for b in shared), "a block shared outside the tree"
