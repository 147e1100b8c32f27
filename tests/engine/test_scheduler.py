"""The scheduler alone, driven by a fake model that emits a fixed token (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import LRUPolicy, ValueAwarePolicy
from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.cache.prefix_cache import PrefixCache
from infercloud.engine.request import Request, RequestStatus
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0


def make(
    num_blocks: int = 64, block_size: int = 4, **config: object
) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(**config), kv, {EOS}), kv  # type: ignore[arg-type]


def req(
    rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, priority: int = 0
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time_s=arrival,
        priority=priority,
        max_total_tokens=10_000,
    )


def prompt_req(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time_s=0.0,
        max_total_tokens=10_000,
    )


def fake_step(s: Scheduler, now: float = 0.0) -> SchedulerOutput:
    out = s.schedule(now)
    s.update_from_output(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
    return out


def test_new_request_joins_running_batch_at_next_step() -> None:
    s, _ = make()
    s.add_request(req("a", 4, 10))
    fake_step(s)
    s.add_request(req("b", 4, 10))
    out = fake_step(s)
    assert {c.request.request_id for c in out.chunks} == {"a", "b"}
    assert [c.num_tokens for c in out.chunks] == [1, 4]


def test_finished_request_leaves_at_once_and_frees_blocks() -> None:
    s, kv = make()
    s.add_request(req("a", 4, 2))
    fake_step(s)  # prefill + first token
    fake_step(s)  # second token: done
    assert not s.has_unfinished()
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks


def test_token_budget_and_chunked_prefill() -> None:
    s, _ = make(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    s.add_request(req("long", 40, 4))
    s.add_request(req("short", 3, 4))
    out = s.schedule(0.0)
    assert out.num_batched_tokens <= 16
    sizes = {c.request.request_id: c.num_tokens for c in out.chunks}
    assert sizes == {"long": 8, "short": 3}
    assert not out.chunks[0].samples  # a partial prefill samples nothing
    s.update_from_output(out, {"short": 7})
    # decode of "short" runs beside the next chunk of "long"
    out = s.schedule(0.0)
    sizes = {c.request.request_id: c.num_tokens for c in out.chunks}
    assert sizes == {"long": 8, "short": 1}


def test_priority_policy_orders_waiting_requests() -> None:
    s, _ = make(max_num_seqs=1, policy="priority")
    s.add_request(req("late-low", 4, 1, arrival=0.0, priority=5))
    s.add_request(req("high", 4, 1, arrival=1.0, priority=0))
    out = fake_step(s)
    assert [c.request.request_id for c in out.chunks] == ["high"]


def test_fcfs_policy_orders_by_arrival() -> None:
    s, _ = make(max_num_seqs=1)
    s.add_request(req("first", 4, 1, priority=5))
    s.add_request(req("second", 4, 1, priority=0))
    out = fake_step(s)
    assert [c.request.request_id for c in out.chunks] == ["first"]


def test_preemption_by_recompute_when_pool_is_full() -> None:
    # 4 blocks of 4 tokens: two requests of 4 prompt tokens growing to 12 tokens cannot both fit
    s, kv = make(num_blocks=4, block_size=4)
    s.add_request(req("a", 4, 8, arrival=0.0))
    s.add_request(req("b", 4, 8, arrival=1.0))
    finished: list[str] = []
    for _ in range(100):
        out = s.schedule(0.0)
        updates = s.update_from_output(
            out, {c.request.request_id: 7 for c in out.chunks if c.samples}
        )
        finished += [u.request.request_id for u in updates if u.finished]
        assert kv.block_pool.num_used_blocks <= 4
        if not s.has_unfinished():
            break
    assert sorted(finished) == ["a", "b"]
    assert s.num_preemptions >= 1
    assert kv.block_pool.num_free_blocks == 4


def test_finish_request_from_outside_frees_blocks() -> None:
    s, kv = make()
    s.add_request(req("a", 8, 10))
    s.add_request(req("b", 8, 10))
    fake_step(s)
    aborted = s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert kv.block_table("a") == []
    assert s.num_running == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1),
    st.integers(8, 24),
    st.sampled_from(["fcfs", "priority"]),
)
def test_every_request_finishes_with_exact_output_and_no_leak(
    specs: list[tuple[int, int, int]], num_blocks: int, policy: str
) -> None:
    block_size = 4
    s, kv = make(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        max_num_seqs=4,
        policy=policy,
    )
    requests = []
    for i, (prompt, out_len, prio) in enumerate(specs):
        # only requests that fit the pool alone are admitted (the engine enforces this)
        if prompt + out_len > num_blocks * block_size:
            continue
        r = req(str(i), prompt, out_len, arrival=float(i), priority=prio)
        requests.append(r)
        s.add_request(r)
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        out = s.schedule(0.0)
        assert out.num_batched_tokens <= 16
        assert s.num_running <= 4
        assert kv.block_pool.num_free_blocks + kv.block_pool.num_used_blocks == num_blocks
        s.update_from_output(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
    assert not s.has_unfinished()
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert kv.block_pool.num_free_blocks == num_blocks


@pytest.mark.parametrize("wanted", ["p", "q"])
def test_a_prefix_a_waiting_request_will_match_outlives_the_others(wanted: str) -> None:
    """Two idle cached prefixes, room for one: the one a queued request will match stays
    (value policy, which reads demand), whichever it is, and that request starts from it."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, 4, ValueAwarePolicy())
    kv = KVCacheManager(pool, 4, cache)
    s = Scheduler(SchedulerConfig(max_num_seqs=1), kv, {EOS})
    prompts = {"p": list(range(1, 14)), "q": list(range(101, 114))}  # 3 full blocks each
    for name, prompt in prompts.items():
        s.add_request(prompt_req(name, prompt))
        fake_step(s)
    assert len(cache) == 6 and pool.num_free_blocks == 2
    # "c" runs first and needs 5 blocks (3 evicted); "w" waits behind it (one slot)
    s.add_request(prompt_req("c", list(range(201, 218))))
    w_prompt = [*prompts[wanted][:12], 55, 56]
    s.add_request(prompt_req("w", w_prompt))
    cache.check_invariants()
    assert fake_step(s).chunks[0].request.request_id == "c"
    cache.check_invariants()
    out = fake_step(s)
    assert out.chunks[0].request.request_id == "w"
    assert out.chunks[0].request.num_cached_tokens == 12
    cache.check_invariants()
    assert not s.has_unfinished()
    assert all(cache.stats.waiting[b] == 0 for b in range(8) if cache.node_of(b) is not None)


def cached_scheduler(policy: str) -> tuple[Scheduler, list[int]]:
    """A scheduler with one slot, a prefix cache holding the blocks of `warm` (3 full blocks),
    and nothing running."""
    pool = BlockPool(64)
    kv = KVCacheManager(pool, 4, PrefixCache(pool, 4, LRUPolicy()))
    s = Scheduler(SchedulerConfig(max_num_seqs=1, policy=policy), kv, {EOS})  # type: ignore[arg-type]
    warm = list(range(1, 14))
    s.add_request(prompt_req("first", warm))
    fake_step(s)
    assert not s.has_unfinished()
    return s, warm


def admitted(s: Scheduler) -> list[str]:
    """Request ids in the order they were first scheduled, running everything to the end."""
    order: list[str] = []
    while s.has_unfinished():
        for c in fake_step(s).chunks:
            if c.request.request_id not in order:
                order.append(c.request.request_id)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "cache"])
def test_cache_policy_admits_the_longest_cached_prefix_first(policy: str) -> None:
    s, warm = cached_scheduler(policy)
    s.add_request(prompt_req("cold", list(range(100, 113))))
    s.add_request(prompt_req("warm", [*warm[:12], 77]))
    s.add_request(prompt_req("cold2", list(range(200, 213))))
    expected = ["cold", "warm", "cold2"] if policy == "fcfs" else ["warm", "cold", "cold2"]
    assert admitted(s) == expected


def test_cache_policy_overtakes_a_request_a_bounded_number_of_times() -> None:
    from infercloud.engine.scheduler import MAX_OVERTAKES

    s, warm = cached_scheduler("cache")
    s.add_request(prompt_req("cold", list(range(100, 113))))
    for i in range(MAX_OVERTAKES + 3):
        s.add_request(prompt_req(f"warm{i}", [*warm[:12], 50 + i]))
    order = admitted(s)
    assert order.index("cold") == MAX_OVERTAKES  # overtaken exactly MAX_OVERTAKES times
    assert not s._overtaken


def test_an_aborted_waiting_request_gives_its_claim_back() -> None:
    pool = BlockPool(16)
    cache = PrefixCache(pool, 4, ValueAwarePolicy())
    s = Scheduler(SchedulerConfig(max_num_seqs=1), KVCacheManager(pool, 4, cache), {EOS})
    prompt = list(range(1, 14))
    s.add_request(prompt_req("a", prompt))
    fake_step(s)  # its 3 full blocks are cached and idle
    s.add_request(prompt_req("long", list(range(100, 140)), max_tokens=8))
    s.add_request(prompt_req("w", [*prompt[:12], 99]))  # waits behind "long"
    fake_step(s)
    assert s.num_waiting == 1 and cache.stats.waiting.sum() == 3  # a's three blocks, claimed
    cache.check_invariants()
    assert s.finish_request("w", RequestStatus.FINISHED_ABORTED) is not None
    cache.check_invariants()
    assert not cache.stats.waiting.any()
