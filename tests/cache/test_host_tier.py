"""The second tier: slot bookkeeping, the copy-or-recompute model, and the manager moving blocks.

`ContentMover` stands in for the engine's tensors: each device block and host slot holds the
token ids written into it, so a test can check that every block a request reads holds exactly
its tokens, whether it was computed, shared from the tree or loaded back from the host.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import LRUPolicy
from infercloud.cache.host_tier import HostTier
from infercloud.cache.kv_cache_manager import KVCacheManager, SecondTier
from infercloud.cache.prefix_cache import CacheEvent, PrefixCache
from infercloud.cache.transfer_cost import TransferCostModel, attention_pairs

BS = 4


class ContentMover:
    def __init__(self) -> None:
        self.device: dict[int, tuple[str | int, ...]] = {}
        """Per device block: the salt and the token ids written into it."""
        self.host: dict[int, tuple[str | int, ...]] = {}
        self.saves = 0
        self.loads = 0

    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        for b, s in zip(device_blocks, host_slots, strict=True):
            self.host[s] = self.device[b]
        self.saves += len(device_blocks)

    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        for s, b in zip(host_slots, device_blocks, strict=True):
            self.device[b] = self.host[s]
        self.loads += len(device_blocks)


def make(
    num_blocks: int, host_slots: int, cost: TransferCostModel | None = None
) -> tuple[KVCacheManager, ContentMover, list[CacheEvent]]:
    pool = BlockPool(num_blocks)
    events: list[CacheEvent] = []
    cache = PrefixCache(pool, BS, LRUPolicy(), on_event=events.append)
    mover = ContentMover()
    second = SecondTier(HostTier(host_slots), mover, cost or TransferCostModel(BS))
    return KVCacheManager(pool, BS, cache, second), mover, events


def run(
    kv: KVCacheManager, mover: ContentMover, rid: str, tokens: list[int], now: float, salt: str = ""
) -> tuple[int, int] | None:
    """Admit and compute a request; returns (device, host) cached blocks, None if refused.
    A block holds its salt with its tokens, so that a block reused across salts, from the
    device or loaded back from the host, fails the check as surely as wrong tokens do."""
    hit = kv.match(salt, tokens)
    if not kv.allocate_slots(rid, len(tokens), now, hit):
        return None
    table = kv.block_table(rid)
    for i in range(hit.num_blocks, len(table)):
        mover.device[table[i]] = (salt, *tokens[i * BS : (i + 1) * BS])
    for i, block in enumerate(table):
        assert mover.device[block] == (salt, *tokens[i * BS : (i + 1) * BS]), f"block {i} wrong"
    kv.cache_blocks(rid, salt, lambda a, b: tokens[a:b], len(tokens), now)
    return len(hit.device), len(hit.host)


def test_host_tier_lookup_is_verified_and_lru() -> None:
    tier = HostTier(2)
    a, _ = tier.put("s", 1, (1, 2), 10)
    b, _ = tier.put("s", 1, (3, 4), 11)
    assert a is not None and b is not None and a.slot != b.slot
    assert tier.lookup("s", 1, (1, 2), 10) == a
    assert tier.lookup("t", 1, (1, 2), 10) is None  # another salt, same hash
    assert tier.lookup("s", 2, (1, 2), 10) is None  # another parent
    assert tier.lookup("s", 1, (9, 9), 10) is None  # another block behind a colliding hash
    tier.touch(10)
    c, gone = tier.put("s", 1, (5, 6), 12)
    assert [e.block_hash for e in gone] == [11] and c is not None and c.slot == b.slot
    tier.pin([a, c])
    d, gone = tier.put("s", 1, (7, 8), 13)
    assert d is None and gone == []  # every slot pinned: the block is dropped
    tier.unpin([a, c])
    tier.check_invariants()


def test_cost_model_fits_step_times_and_decides_by_depth() -> None:
    cost = TransferCostModel(block_size=16)
    assert cost.blocks_worth_loading(0, 5) == 5  # nothing measured yet: load
    overhead, per_token, per_pair = 0.002, 1e-4, 1e-7
    for tokens, start in [(1, 100), (16, 0), (64, 0), (128, 256), (8, 1000), (256, 512)] * 3:
        pairs = attention_pairs(start, tokens)
        cost.observe_step(tokens, pairs, overhead + per_token * tokens + per_pair * pairs)
    coef = cost.coefficients()
    assert coef is not None
    assert abs(coef[1] - per_token) / per_token < 1e-3 and abs(coef[2] - per_pair) / per_pair < 1e-3
    shallow, deep = cost.recompute_s(0), cost.recompute_s(4096)
    assert shallow is not None and deep is not None and deep > shallow
    cost.observe_copy(4, 4 * (shallow + deep) / 2)  # a copy dearer than a shallow recompute
    assert cost.blocks_worth_loading(0, 1) == 0  # a shallow block alone: recompute it
    assert cost.blocks_worth_loading(4096, 1) == 1  # a deep one: copy it back
    # a run from the start to deep blocks: the shallow ones are loaded too, for the deep ones
    assert cost.blocks_worth_loading(0, 400) == 400


def test_evicted_prefix_comes_back_from_the_host_tier() -> None:
    kv, mover, events = make(num_blocks=5, host_slots=8)
    prompt_a = [*range(1, 17), 0]  # 4 full blocks + 1
    assert run(kv, mover, "a", prompt_a, 0.0) == (0, 0)
    kv.free("a")
    prompt_b = [*range(101, 117), 0]
    assert run(kv, mover, "b", prompt_b, 1.0) == (0, 0)  # evicts a's idle blocks to the host
    assert mover.saves == 4
    assert any(e.medium == "host" and e.kind == "stored" for e in events)
    kv.free("b")
    assert run(kv, mover, "a2", prompt_a, 2.0) == (0, 4)  # all four blocks loaded back
    assert mover.loads == 4
    kv.free("a2")
    assert run(kv, mover, "a3", prompt_a, 3.0) == (4, 0)  # the loaded blocks are cached again
    # another salt never sees the host copies
    kv.free("a3")
    assert run(kv, mover, "x", prompt_a, 4.0, salt="other") == (0, 0)
    assert kv.second_tier is not None
    kv.second_tier.tier.check_invariants()


def test_a_load_that_does_not_pay_is_recomputed() -> None:
    cost = TransferCostModel(BS)
    for i in range(10):
        cost.observe_step(BS * (i + 1), attention_pairs(0, BS * (i + 1)), 1e-3 * (i + 1))
    cost.observe_copy(1, 10.0)  # copying one block takes longer than any recompute
    kv, mover, _ = make(num_blocks=5, host_slots=8, cost=cost)
    prompt_a = [1] * 16 + [0]
    run(kv, mover, "a", prompt_a, 0.0)
    kv.free("a")
    run(kv, mover, "b", [2] * 16 + [0], 1.0)
    kv.free("b")
    assert run(kv, mover, "a2", prompt_a, 2.0) == (0, 0)
    assert mover.loads == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "free"]),
            st.integers(0, 5),
            st.integers(1, 20),
            st.sampled_from(["", "t1"]),
        ),
        max_size=50,
    ),
    st.integers(1, 10),
)
def test_blocks_hold_their_tokens_under_random_traffic(
    ops: list[tuple[str, int, int, str]], host_slots: int
) -> None:
    """Whatever is computed, shared, evicted, saved and loaded back, every block a request holds
    has exactly its tokens (`run` checks), and the tree, pool and tier invariants hold."""
    kv, mover, _ = make(num_blocks=12, host_slots=host_slots)
    open_requests: list[str] = []
    for step, (op, which, length, salt) in enumerate(ops):
        if op == "add":
            tokens = [which % 3 * 100 + i for i in range(length)]  # 3 families of prefixes
            if run(kv, mover, f"r{step}", tokens, float(step), salt) is not None:
                open_requests.append(f"r{step}")
        elif open_requests:
            kv.free(open_requests.pop(which % len(open_requests)))
        assert kv.prefix_cache is not None and kv.second_tier is not None
        kv.check_invariants()
        kv.second_tier.tier.check_invariants()
