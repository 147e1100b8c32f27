"""The radix tree and its pool: matches, sharing, salts, eviction, invariants under random use."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import (
    PENDING,
    TAIL_POSITIONS,
    BeladyPolicy,
    BlockStats,
    EvictionPolicy,
    LRUPolicy,
    RequestShape,
    ValueAwarePolicy,
    feature_class,
    request_class,
)
from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.cache.prefix_cache import CacheEvent, PrefixCache
from infercloud.cache.replay import TraceRequest, replay

BS = 4
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def make(
    num_blocks: int = 16, policy: EvictionPolicy | None = None
) -> tuple[KVCacheManager, PrefixCache, list[CacheEvent]]:
    pool = BlockPool(num_blocks)
    events: list[CacheEvent] = []
    cache = PrefixCache(pool, BS, policy or LRUPolicy(), on_event=events.append)
    return KVCacheManager(pool, BS, cache), cache, events


def run(kv: KVCacheManager, rid: str, tokens: list[int], now: float, salt: str = "") -> int:
    """Admit, compute and cache a request's tokens; returns its cached tokens. Keeps it open."""
    cached = kv.match(salt, tokens)
    assert kv.allocate_slots(rid, len(tokens), now, cached)
    kv.cache_blocks(rid, salt, lambda a, b: tokens[a:b], len(tokens), now)
    return cached.num_blocks * BS


def test_match_full_blocks_only_and_never_the_last_token() -> None:
    kv, cache, _ = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert run(kv, "a", prompt, 0.0) == 0
    assert len(cache) == 2  # the partial block stays private
    kv.free("a")
    assert run(kv, "b", prompt, 1.0) == 8
    kv.free("b")
    # exactly 8 tokens: the second block holds the last token, so only one block may hit
    assert run(kv, "c", prompt[:8], 2.0) == 4
    cache.check_invariants()


def test_shared_blocks_are_referenced_by_both_users() -> None:
    kv, cache, _ = make()
    run(kv, "a", list(range(9)), 0.0)
    run(kv, "b", list(range(9)), 1.0)
    shared = kv.block_table("a")[:2]
    assert kv.block_table("b")[:2] == shared
    assert all(cache.pool.ref_count(b) == 3 for b in shared)  # a, b and the tree
    cache.check_invariants()


def test_a_prefix_computed_twice_at_once_is_shared_and_stays_evictable() -> None:
    """Two requests compute the same prompt at once (the second matched before the first
    cached it): the second takes the tree's blocks in place of its duplicates, so that when
    the first is done no idle block sits above one in use, and all of it can be evicted."""
    kv, cache, _ = make(num_blocks=12)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert kv.allocate_slots("a", 13, 0.0) and kv.allocate_slots("b", 13, 0.0)
    assert cache.pool.num_free_blocks == 4
    kv.cache_blocks("a", "", lambda i, j: prompt[i:j], 13, 1.0)
    kv.cache_blocks("b", "", lambda i, j: prompt[i:j], 13, 1.0)
    assert kv.block_table("b")[:3] == kv.block_table("a")[:3]
    assert cache.pool.num_free_blocks == 7  # b's three duplicates are free again
    kv.free("a")
    cache.check_invariants()
    longer = [*prompt, 99, 98, 97, 96]  # b decodes on: its next full block hangs below
    assert kv.allocate_slots("b", 17, 2.0)
    kv.cache_blocks("b", "", lambda i, j: longer[i:j], 17, 2.0)
    cache.check_invariants()
    kv.free("b")
    cache.check_invariants()
    assert kv.num_available_blocks == 12
    assert len(cache.evict(12, 3.0)) == 4 and cache.pool.num_free_blocks == 12


def test_salts_never_share() -> None:
    kv, cache, _ = make()
    prompt = list(range(9))
    run(kv, "a", prompt, 0.0, salt="tenant-a")
    kv.free("a")
    assert run(kv, "b", prompt, 1.0, salt="tenant-b") == 0
    assert run(kv, "c", prompt, 2.0, salt="tenant-a") == 8
    assert {cache.node_of(b).salt for b in kv.block_table("c")[:2]} == {"tenant-a"}  # type: ignore[union-attr]


def test_eviction_frees_idle_leaves_lru_first_and_publishes_events() -> None:
    kv, cache, events = make(num_blocks=6)
    run(kv, "old", [1] * 4 + [2] * 4 + [9], 0.0)  # 2 cached blocks + 1 private
    run(kv, "new", [3] * 4 + [4] * 4 + [9], 5.0)
    kv.free("old")
    kv.free("new")
    assert kv.num_available_blocks == 6 and cache.pool.num_free_blocks == 2
    # 4 new blocks needed, 2 free: the two blocks of "old" go (leaf first, then its parent)
    assert kv.allocate_slots("x", 16, 10.0)
    assert kv.match("", [1] * 4 + [2] * 4 + [0]).num_blocks == 0
    assert kv.match("", [3] * 4 + [4] * 4 + [0]).num_blocks == 2
    stored = [e for e in events if e.kind == "stored"]
    removed = [e for e in events if e.kind == "removed"]
    assert len(stored) == 2 and len(removed) == 1 and len(removed[0].block_hashes) == 2
    assert set(removed[0].block_hashes) == set(stored[0].block_hashes)
    cache.check_invariants()


def test_refused_allocation_changes_nothing() -> None:
    kv, cache, _ = make(num_blocks=4)
    run(kv, "a", list(range(9)), 0.0)  # 3 blocks held
    before = (cache.pool.num_free_blocks, cache.num_idle, len(cache))
    assert not kv.allocate_slots("b", 8, 1.0)
    assert (cache.pool.num_free_blocks, cache.num_idle, len(cache)) == before


def test_policies_rank_as_documented() -> None:
    stats = BlockStats.empty(3)
    for block, (t, key) in enumerate([(0.0, 100), (5.0, 200), (9.0, 300)]):
        stats.record_insert(block, 1, key, t)
    stats.record_hit(0, 9.5)
    stats.record_hit(0, 9.8)
    blocks = np.arange(3)
    assert np.argmin(LRUPolicy().priorities(stats, blocks, 10.0)) == 1
    belady = BeladyPolicy({100: [20.0], 200: [50.0, 90.0], 300: [1.0]})
    got = belady.priorities(stats, blocks, 10.0)
    assert np.argmin(got) == 2  # 300 is never needed again after t=10
    assert got[1] < got[0]  # 200 is needed later (t=50) than 100 (t=20)


def test_value_policy_ranks_a_class_by_its_observed_reuse() -> None:
    """Two blocks alike in all but the class of the request that stored them: the one whose
    class was seldom used again is evicted first, though it is the more recently used."""
    good = request_class(False, 20_000, 10)
    poor = request_class(False, 20_000, 500)
    stats = BlockStats.empty(2)
    for block, request in ((0, good), (1, poor)):  # 40 earlier visits each
        for _ in range(40):
            stats.record_insert(block, 1, 0, 0.0)
            stats.record_finish([block], request)
            if request == good:
                stats.record_hit(block, 30.0)
    stats.record_insert(0, 1, 0, 100.0)
    stats.record_finish([0], good)
    stats.record_insert(1, 1, 0, 101.0)
    stats.record_finish([1], poor)
    stats.record_eviction([0, 1], 200.0)  # kept blocks lately stay about 100 s
    got = ValueAwarePolicy().priorities(stats, np.arange(2), 110.0)
    assert got[1] < got[0]
    assert np.argmin(LRUPolicy().priorities(stats, np.arange(2), 110.0)) == 0


def test_a_finished_request_classifies_only_its_own_blocks() -> None:
    kv, cache, _ = make(policy=ValueAwarePolicy())
    run(kv, "a", list(range(9)), 0.0)  # stores 2 blocks
    run(kv, "b", [*range(8), 50, 51, 52, 53, 54], 1.0)  # hits them, stores 1 more
    own_a, own_b = kv.block_table("a")[:2], kv.block_table("b")[2]
    kv.free("b", RequestShape(13, 7))
    kv.free("a")  # no shape (e.g. preempted): its blocks stay pending
    assert cache.stats.feature_class[own_b] == feature_class(request_class(True, 13, 7), 0)
    assert all(cache.stats.feature_class[b] == PENDING for b in own_a)
    cache.check_invariants()


def test_blocks_take_their_place_in_the_chain_their_request_stored() -> None:
    """A prompt's last blocks (its new tail) are seldom used again, its inner ones often: the
    class tells them apart by distance from the end of the chain the request stored (0, 1, 2,
    and so on up to `TAIL_POSITIONS` - 1 for all further in)."""
    kv, cache, _ = make(num_blocks=32, policy=ValueAwarePolicy())
    run(kv, "a", list(range(12)), 0.0)  # stores 3 blocks
    run(kv, "b", [*range(8), *range(100, 124)], 1.0)  # hits a's first 2, stores 6 more
    table_a, table_b = kv.block_table("a"), kv.block_table("b")
    kv.free("a", RequestShape(12, 2))
    kv.free("b", RequestShape(32, 2))
    a, b = request_class(False, 12, 2), request_class(True, 32, 2)
    stats = cache.stats
    assert [stats.feature_class[x] for x in table_a] == [feature_class(a, n) for n in (2, 1, 0)]
    assert [stats.feature_class[x] for x in table_b[2:]] == [
        feature_class(b, n) for n in (5, 4, 3, 2, 1, 0)
    ]
    last = TAIL_POSITIONS - 1  # all further in share one class
    assert feature_class(b, last) == feature_class(b, last + 50) != feature_class(b, last - 1)
    cache.check_invariants()


def test_a_prefix_stored_again_after_eviction_counts_as_a_use() -> None:
    """A miss on an evicted prefix is a reuse the cache missed: the class learns it, and the
    new block resumes the old one's history (one use more)."""
    kv, cache, _ = make(num_blocks=3, policy=ValueAwarePolicy())
    prompt = list(range(5))  # 1 full block + 1 token
    run(kv, "a", prompt, 0.0)
    kv.free("a", RequestShape(5, 3))
    state = feature_class(request_class(False, 5, 3), 0)
    assert cache.stats.state_reused[state] == 0
    run(kv, "x", list(range(100, 109)), 1.0)  # needs all 3 blocks: evicts a's
    kv.free("x", RequestShape(9, 3))
    run(kv, "b", prompt, 2.0)
    block = kv.block_table("b")[0]
    assert cache.stats.state_reused[state] == 1
    assert cache.stats.num_hits[block] == 1 and cache.stats.feature_class[block] == state
    cache.check_invariants()


class _Recording:
    """A value policy that records what it was asked and answered."""

    name = "value"
    learns_outcomes = True

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[int], list[float]]] = []

    def priorities(self, stats: BlockStats, candidates: IntArray, now_s: float) -> FloatArray:
        got = ValueAwarePolicy().priorities(stats, candidates, now_s)
        self.calls.append((now_s, candidates.tolist(), got.tolist()))
        return got


def test_value_policy_reads_no_future() -> None:
    """Two traces alike until t = 50 s and different after: every priority the value policy
    gave before 50 s is the same in both (nothing it read came from later requests)."""
    rng = np.random.default_rng(0)
    shared = [
        TraceRequest(float(t), 4096, int(rng.integers(1, 400)), tuple(rng.integers(0, 12, 8)))
        for t in range(50)
    ]
    later_a = [TraceRequest(50.0 + t, 4096, 5, (0, 1, 2, 3, 4, 5, 6, 7)) for t in range(30)]
    later_b = [TraceRequest(50.0 + t, 2048, 900, (9, 9, 9, 9)) for t in range(30)]
    runs = []
    for later in (later_a, later_b):
        policy = _Recording()
        replay([*shared, *later], capacity_blocks=12, policy=policy)
        runs.append([c for c in policy.calls if c[0] < 50.0])
    assert runs[0] and runs[0] == runs[1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "free"]),
            st.integers(0, 5),  # which request / which prompt family
            st.integers(1, 14),  # prompt length
            st.sampled_from(["", "t1"]),
        ),
        max_size=40,
    )
)
def test_tree_and_pool_invariants_under_random_traffic(
    ops: list[tuple[str, int, int, str]],
) -> None:
    kv, cache, _ = make(num_blocks=12)
    open_requests: dict[str, tuple[str, list[int]]] = {}
    for step, (op, which, length, salt) in enumerate(ops):
        now = float(step)
        if op == "add":
            rid = f"r{step}"
            tokens = [which * 100 + (i % 7) for i in range(length)]
            cached = kv.match(salt, tokens)
            assert all(n.salt == salt for n in cached.device)
            held = {b for r in open_requests for b in kv.block_table(r)}
            if kv.allocate_slots(rid, length, now, cached):
                if which % 2 == 0:  # else cached later: it computes while others may too
                    kv.cache_blocks(rid, salt, lambda a, b, t=tokens: t[a:b], length, now)
                open_requests[rid] = (salt, tokens)
                # a block this request holds is never also a block another request holds,
                # unless both got it from the tree (shared)
                for b in kv.block_table(rid):
                    if b in held:
                        assert cache.node_of(b) is not None
        elif open_requests:
            rid = sorted(open_requests)[which % len(open_requests)]
            salt, tokens = open_requests.pop(rid)
            kv.cache_blocks(rid, salt, lambda a, b, t=tokens: t[a:b], len(tokens), now)
            kv.check_invariants()
            kv.free(rid)
        kv.check_invariants()  # ref counts = tables + tree; the tree's and the pool's own
        for rid in open_requests:
            for b in kv.block_table(rid):
                assert cache.pool.ref_count(b) >= 1  # no evicted block in use
    for rid in list(open_requests):
        kv.free(rid)
    assert kv.num_available_blocks == cache.pool.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "free", "evict"]),
            st.integers(0, 5),
            st.integers(1, 30),
        ),
        max_size=80,
    )
)
def test_lru_standing_ranking_evicts_as_ranking_everything_each_time(
    ops: list[tuple[str, int, int]],
) -> None:
    """LRU ranks candidates once, as they become candidates (`static_priorities`); the same
    traffic on a cache that ranks every candidate at each eviction evicts the same blocks in
    the same order."""
    caches = [make(num_blocks=14), make(num_blocks=14)]
    caches[1][1]._static = False  # the general path: rank all candidates at every eviction
    open_requests: list[str] = []
    for step, (op, which, length) in enumerate(ops):
        now = float(step)
        evicted = []
        for kv, cache, _ in caches:
            if op == "add":
                tokens = [which * 100 + (i % 5) for i in range(length)]
                cached = kv.match("", tokens)
                ok = kv.allocate_slots(f"r{step}", length, now, cached)
                if ok:
                    kv.cache_blocks(f"r{step}", "", lambda a, b, t=tokens: t[a:b], length, now)
            elif op == "free" and open_requests:
                kv.free(open_requests[which % len(open_requests)])
            elif op == "evict":
                evicted.append([n.block_id for n in cache.evict(which + 1, now)])
            kv.check_invariants()
        if op == "add" and ok:
            open_requests.append(f"r{step}")
        elif op == "free" and open_requests:
            open_requests.pop(which % len(open_requests))
        if evicted:
            assert evicted[0] == evicted[1]
        assert [e.block_hashes for e in caches[0][2]] == [e.block_hashes for e in caches[1][2]]


def test_a_policy_that_learns_nothing_costs_no_outcome_bookkeeping() -> None:
    """With LRU the cache keeps no classes, no evicted histories: the simulator's hot path."""
    kv, cache, events = make(num_blocks=3)
    run(kv, "a", list(range(5)), 0.0)
    kv.free("a", RequestShape(5, 3))
    run(kv, "x", list(range(100, 109)), 1.0)  # evicts a's block
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    assert removed and (cache.stats.feature_class == PENDING).all()
    assert all(cache.recently_evicted.pop_history(h) is None for h in removed)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "free", "wait", "unwait", "evict"]),
            st.integers(0, 5),
            st.integers(1, 20),
        ),
        max_size=60,
    )
)
def test_waiting_counts_follow_the_queue_under_random_traffic(
    ops: list[tuple[str, int, int]],
) -> None:
    """Requests join and leave the queue while others store and evict blocks: every cached
    block's waiting count is the number of queued requests whose prompt holds its prefix
    (`check_invariants`), also for blocks stored after the request joined; none is left
    once the queue is empty."""
    kv, cache, _ = make(num_blocks=12, policy=ValueAwarePolicy())
    open_requests: list[str] = []
    queued: dict[str, list[int]] = {}
    orders: dict[str, float] = {}
    for step, (op, which, length) in enumerate(ops):
        now = float(step)
        tokens = [which * 100 + (i % 3) for i in range(length)]
        if op == "add":
            rid = f"r{step}"
            if kv.allocate_slots(rid, length, now, kv.match("", tokens)):
                kv.cache_blocks(rid, "", lambda a, b, t=tokens: t[a:b], length, now)
                open_requests.append(rid)
        elif op == "free" and open_requests:
            kv.free(open_requests.pop(which % len(open_requests)))
        elif op == "wait":
            queued[f"w{step}"] = tokens
            orders[f"w{step}"] = float(which)
            kv.note_waiting(f"w{step}", "", tokens, float(which))
        elif op == "unwait" and queued:
            rid = sorted(queued)[which % len(queued)]
            kv.drop_waiting(rid)
            del queued[rid]
        elif op == "evict":
            cache.evict(which + 1, now)
        kv.check_invariants()
        for block in range(12):
            node = cache.node_of(block)
            if node is None:
                continue
            wanted = [
                orders[rid] for rid, t in queued.items() if node in cache.match("", t, len(t) - 1)
            ]
            assert cache.stats.waiting[block] == len(wanted)
            assert cache.stats.wanted_order[block] == min(wanted, default=np.inf)
    for rid in list(queued):
        kv.drop_waiting(rid)
    cache.check_invariants()
    assert not cache.stats.waiting.any() or all(
        cache.node_of(b) is None for b in np.flatnonzero(cache.stats.waiting)
    )


def test_value_policy_keeps_queued_demand_first_the_soonest_needed_highest() -> None:
    stats = BlockStats.empty(4)
    for block in range(4):
        stats.record_insert(block, 1, 100 + block, 0.0)
    stats.record_hit(0, 1.0)  # history makes block 0 likely to be used again, but nobody waits
    stats.waiting[1], stats.wanted_order[1] = 1, 7.0  # wanted by the 5th request in line
    stats.waiting[2], stats.wanted_order[2] = 2, 3.0  # by the head
    stats.waiting[3], stats.wanted_order[3] = 1, 4.0
    stats.queue_head_order = 3.0
    p = ValueAwarePolicy().priorities(stats, np.arange(4), 2.0)
    assert p[0] <= 1.0 < 2.0 < p[1] < p[3] < p[2] == 3.0


def test_value_policy_weighs_reuse_by_the_recompute_cost_of_the_blocks_depth() -> None:
    """Two blocks alike but for depth: with a depth cost the deeper (dearer to recompute) is
    kept, by the ratio of their costs; a queued request's block stays above both, also when
    ranked in a call of its own (as an eviction ranks a parent's chain)."""
    stats = BlockStats.empty(3)
    for block, depth in enumerate((1, 200, 2)):
        stats.record_insert(block, depth, 100 + block, 0.0)
        stats.record_finish([block], request_class(False, 20_000, 10))
    stats.record_eviction([0], 50.0)
    flat = ValueAwarePolicy().priorities(stats, np.arange(2), 10.0)
    assert flat[0] == flat[1] > 0
    policy = ValueAwarePolicy(depth_cost_per_block=0.02)
    weighted = policy.priorities(stats, np.arange(2), 10.0)
    assert weighted[1] / weighted[0] == pytest.approx((1 + 0.02 * 200) / (1 + 0.02 * 1))
    stats.waiting[2], stats.wanted_order[2] = 1, 9.0
    stats.queue_head_order = 3.0
    steep = ValueAwarePolicy(depth_cost_per_block=1000.0)
    rank = steep.ranking(stats, 10.0)
    unwanted = rank(np.arange(2))
    assert unwanted.max() > 3.0  # above where a queued request's block ranks without a cost
    assert rank(np.array([2]))[0] > unwanted.max()


class _Memory:
    """Stands in for the KV tensors: what each block id holds (the tokens written there)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, ...]] = {}

    def copy(self, src: list[int], dst: list[int]) -> None:
        assert not set(src) & set(dst)
        data = [self.held.get(s) for s in src]
        for d, value in zip(dst, data, strict=True):
            if value is None:
                self.held.pop(d, None)
            else:
                self.held[d] = value

    def write(self, kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
        """The request computes its whole blocks into its table's blocks (hits excepted)."""
        table = kv.block_table(rid)
        for i in range(len(tokens) // BS):
            self.held.setdefault(table[i], tuple(tokens[i * BS : (i + 1) * BS]))
            if kv.prefix_cache is None or kv.prefix_cache.node_of(table[i]) is None:
                self.held[table[i]] = tuple(tokens[i * BS : (i + 1) * BS])


def test_packing_gives_the_lowest_unused_ids_and_moves_idle_blocks_with_their_keys() -> None:
    kv, cache, _ = make(num_blocks=8)
    memory = _Memory()
    kv.use_block_copier(memory.copy)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two whole blocks and one token
    run(kv, "a", a, 0.0)
    memory.write(kv, "a", a)
    assert kv.block_table("a") == [0, 1, 2]
    kv.free("a")  # blocks 0 and 1 stay cached, idle; 2 is free
    b = [50 + i for i in range(8)]
    assert run(kv, "b", b, 1.0) == 0
    # the lowest unused ids: 0 and 1, whose cached blocks moved to the lowest free ids
    assert kv.block_table("b") == [0, 1]
    hit = kv.match("", a)
    assert [n.block_id for n in hit.device] == [2, 3]
    assert [memory.held[n.block_id] for n in hit.device] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    cache.check_invariants()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "free"]),
            st.integers(0, 5),
            st.integers(1, 14),
        ),
        max_size=50,
    )
)
def test_packing_keeps_every_cached_block_and_its_contents(
    ops: list[tuple[str, int, int]],
) -> None:
    """The same traffic with and without packing: the same hits and the same evictions, every
    cached block's keys where its node says, the pool's and tree's invariants. (LRU breaks
    ties of time by block id, which a move can change; in this traffic no such tie decides.)"""
    plain, packed = make(num_blocks=12), make(num_blocks=12)
    memory = _Memory()
    packed[0].use_block_copier(memory.copy)
    open_requests: list[tuple[str, list[int]]] = []
    for step, (op, which, length) in enumerate(ops):
        now = float(step)
        results = []
        for (kv, cache, _), is_packed in ((plain, False), (packed, True)):
            if op == "add":
                rid = f"r{step}"
                tokens = [which * 100 + (i % 7) for i in range(length)]
                cached = kv.match("", tokens)
                if is_packed:
                    assert all(memory.held[n.block_id] == n.key for n in cached.device)
                ok = kv.allocate_slots(rid, length, now, cached)
                if ok:
                    if is_packed:
                        memory.write(kv, rid, tokens)
                    kv.cache_blocks(rid, "", lambda a, b, t=tokens: t[a:b], length, now)
                results.append((ok, cached.num_blocks))
            elif open_requests:
                kv.free(open_requests[which % len(open_requests)][0], None)
            cache.check_invariants()
        if op == "add":
            assert results[0] == results[1]
            if results[0][0]:
                open_requests.append((f"r{step}", []))
        elif open_requests:
            open_requests.pop(which % len(open_requests))
        assert [e.block_hashes for e in plain[2]] == [e.block_hashes for e in packed[2]]
        for block, node in packed[1]._by_block.items():
            assert memory.held.get(block) == node.key
