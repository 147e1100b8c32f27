from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infercloud.cache.block_pool import BlockPool, BlockPoolExhaustedError
from infercloud.cache.kv_cache_manager import KVCacheManager, num_blocks_for


def test_allocate_and_release_round_trip() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_free_blocks == 1
    pool.release(blocks)
    assert pool.num_free_blocks == 4


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_freed_blocks_are_reused_lowest_first() -> None:
    """In-use blocks stay packed: after a release, the next allocation fills the lowest holes,
    not the blocks never used yet (a first-in first-out list walks the whole pool)."""
    pool = BlockPool(8)
    first = pool.allocate(6)
    pool.release([first[4], first[1]])
    assert pool.allocate(3) == [1, 4, 6]


def test_shared_block_frees_on_last_release() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.retain(block)
    pool.release([block])
    assert pool.num_free_blocks == 1 and pool.ref_count(block) == 1
    pool.release([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.release([block])


@given(st.lists(st.tuples(st.sampled_from(["alloc", "retain", "release"]), st.integers(0, 5))))
def test_pool_invariants_under_random_operations(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    held: list[int] = []  # one entry per reference we hold
    for op, n in ops:
        if op == "alloc":
            if pool.can_allocate(n):
                free = sorted(set(range(pool.num_blocks)) - set(held))
                got = pool.allocate(n)
                assert got == free[:n]  # the lowest free ids, in order
                held.extend(got)
            else:
                with pytest.raises(BlockPoolExhaustedError):
                    pool.allocate(n)
        elif op == "retain" and held:
            block = held[n % len(held)]
            pool.retain(block)
            held.append(block)
        elif op == "release" and held:
            block = held.pop(n % len(held))
            pool.release([block])
        in_use = set(held)
        assert pool.num_used_blocks == len(in_use)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held.count(block)
        pool.check_invariants()


def test_kv_cache_manager_grows_tables_by_blocks() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=4)
    assert manager.allocate_slots("a", 5)
    assert len(manager.block_table("a")) == 2
    assert manager.allocate_slots("a", 8)  # still two blocks
    assert len(manager.block_table("a")) == 2
    assert not manager.allocate_slots("b", 12)  # needs 3, only 2 free
    assert manager.block_table("b") == []
    manager.free("a")
    assert manager.block_pool.num_free_blocks == 4
    assert num_blocks_for(0, 4) == 0 and num_blocks_for(4, 4) == 1 and num_blocks_for(5, 4) == 2
