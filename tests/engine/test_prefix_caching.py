"""Prefix caching in the engine: a hit changes nothing in the output, only what is computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infercloud.engine.llm import LLM
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.outputs import RequestOutput
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import SchedulerConfig
from tests.engine.test_correctness import reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, vocab, (48,), generator=g).tolist()  # 3 full blocks of 16
    suffixes = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (0, 1, 9, 16, 23)]
    return [prefix + s for s in suffixes]


@pytest.mark.parametrize(
    "scheduler",
    [
        SchedulerConfig(),
        SchedulerConfig(max_num_batched_tokens=24, long_prefill_token_threshold=10),
    ],
    ids=["batched", "chunked"],
)
def test_warm_cache_gives_the_same_greedy_output(
    tiny_model_dir: Path, scheduler: SchedulerConfig
) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, scheduler=scheduler)
    prompts = shared_prefix_prompts(llm.engine.model_config.vocab_size)
    cold_llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, enable_prefix_caching=False)
    cold = [o.token_ids for o in cold_llm.generate(prompts, GREEDY)]
    first = llm.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    warm = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in warm] == cold
    # the 48-token prefix is 3 blocks; a prompt of exactly 48 tokens may reuse only 2 (its last
    # token must be computed), longer ones all 3
    assert [o.num_cached_tokens for o in warm] == [32, 48, 48, 48, 48]
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == cold
    assert cold == reference_greedy(tiny_model_dir, prompts, 12)
    stats = llm.engine.stats()
    assert 0 < stats.prefix_cache_hits_tokens < stats.prefix_cache_queries_tokens


def test_cache_survives_eviction_and_preemption(tiny_model_dir: Path) -> None:
    """A pool too small for everything: hits, evictions and preemptions all happen."""
    scheduler = SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=16)
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=96 << 10, scheduler=scheduler)
    prompts = shared_prefix_prompts(llm.engine.model_config.vocab_size) * 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    step = llm.engine.step
    steps = 0

    def checked_step() -> list[RequestOutput]:
        """A step, then every block's ref count = the block tables + the tree holding it."""
        nonlocal steps
        outputs = step()
        llm.engine.kv_cache.check_invariants()
        steps += 1
        return outputs

    llm.engine.step = checked_step  # type: ignore[method-assign]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert steps > 0
    assert llm.engine.stats().prefix_cache_evicted_blocks > 0
    assert llm.engine.scheduler.num_preemptions > 0
    unique = shared_prefix_prompts(llm.engine.model_config.vocab_size)
    assert got == reference_greedy(tiny_model_dir, unique, 24) * 2
    assert llm.engine.prefix_cache is not None
    # requests took the lowest unused ids, moving idle cached blocks (and their keys and
    # values) out of the way, and the hits on moved blocks still gave the reference's tokens
    assert llm.engine.prefix_cache.num_moved_blocks > 0
    llm.engine.kv_cache.check_invariants()
    assert llm.engine.kv_cache.num_available_blocks == llm.engine.block_pool.num_blocks


def test_salts_isolate_offline(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = shared_prefix_prompts(llm.engine.model_config.vocab_size)[2]
    engine = llm.engine

    def cached_tokens(request_id: str, salt: str) -> int:
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        while True:
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    return out.num_cached_tokens

    assert cached_tokens("a1", "tenant-a") == 0
    assert cached_tokens("b1", "tenant-b") == 0
    assert cached_tokens("a2", "tenant-a") == 48


def distinct_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("backing", ["memory", "disk"])
def test_hit_from_the_second_tier_gives_the_same_greedy_output(
    tiny_model_dir: Path, tmp_path: Path, backing: str
) -> None:
    """A device pool of 5 blocks holds one request: the next one evicts the first's prefix to
    the host tier, and the first prompt, sent again, loads it back instead of recomputing.

    Loads are forced: for the tiny model, recomputing a block can be cheaper than copying it
    (the measured decision is tested in tests/cache/test_host_tier.py, and on the real model
    in benchmarks/prefix_cache.py)."""
    config = ModelConfig.from_folder(tiny_model_dir)
    block_bytes = 16 * config.kv_bytes_per_token * 4  # float32
    path = str(tmp_path / "host.kv") if backing == "disk" else None
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_bytes=5 * block_bytes,
        host_cache_bytes=64 * block_bytes,
        host_cache_path=path,
        host_cache_load="always",  # the tiny model may recompute faster than a copy (see below)
    )
    a, b = distinct_prompts(config.vocab_size, 2, 57)  # 3 full blocks reusable (+ 9 tokens)
    cold = reference_greedy(tiny_model_dir, [a, b], 12)
    first = llm.generate([a], GREEDY)[0]
    assert first.token_ids == cold[0] and first.num_cached_tokens == 0
    assert llm.generate([b], GREEDY)[0].token_ids == cold[1]  # evicts a's blocks to the host
    stats = llm.engine.stats()
    assert stats.kv_blocks_saved_to_host >= 3 and stats.host_cache_blocks >= 3
    again = llm.generate([a], GREEDY)[0]
    assert again.token_ids == cold[0]
    assert again.num_cached_tokens == 48
    stats = llm.engine.stats()
    assert stats.host_cache_hits_tokens == 48 and stats.kv_blocks_loaded_from_host == 3
    assert stats.prefix_cache_hits_tokens == 0  # nothing of it was left on the device
    # the loaded blocks are device cache entries again: the next hit needs no copy
    assert llm.generate([a], GREEDY)[0].num_cached_tokens == 48
    assert llm.engine.stats().kv_blocks_loaded_from_host == 3
    if backing == "disk":
        assert (tmp_path / "host.kv").stat().st_size >= 64 * block_bytes


@pytest.mark.slow
def test_real_model_warm_equals_cold(real_model_dir: Path) -> None:
    llm = LLM(str(real_model_dir), kv_cache_bytes=64 << 20)
    system = "You are a careful assistant. Tools: search(query), open(url), summarize(text). " * 3
    prompts = [llm.encode(system + q) for q in ("What is 2+2?", "Name a prime.", "Say hi.")]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    cold = [o.token_ids for o in llm.generate(prompts, params)]
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == cold
    assert all(o.num_cached_tokens >= 48 for o in warm)


def test_copy_blocks_moves_every_layer_and_head_of_a_block(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=96 << 10)
    runner = llm.engine.runner
    kv = runner.kv_cache
    kv.copy_(torch.randn(kv.shape, dtype=kv.dtype))
    before = kv.clone()
    layers, two, rows, bs, hd = kv.shape
    heads = rows // runner.num_blocks
    view = before.view(layers, two, heads, runner.num_blocks, bs, hd)
    runner.copy_blocks([0, 3], [5, 1])
    after = kv.view(layers, two, heads, runner.num_blocks, bs, hd)
    assert torch.equal(after[:, :, :, 5], view[:, :, :, 0])
    assert torch.equal(after[:, :, :, 1], view[:, :, :, 3])
    untouched = [b for b in range(runner.num_blocks) if b not in (1, 5)]
    assert torch.equal(after[:, :, :, untouched], view[:, :, :, untouched])


def test_second_tier_loads_or_recomputes_by_the_measured_speeds(tiny_model_dir: Path) -> None:
    """`host_cache_load="auto"`: the engine feeds its step times and copy times to the cost model
    and asks it, per hit, whether loading from the host beats recomputing. Copies made to look
    slow give a recompute; made to look free, a load; the output is the same either way."""
    config = ModelConfig.from_folder(tiny_model_dir)
    block_bytes = 16 * config.kv_bytes_per_token * 4  # float32
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_bytes=5 * block_bytes,
        host_cache_bytes=64 * block_bytes,
        host_cache_load="auto",
    )
    second = llm.engine.second_tier
    assert second is not None and not second.always_load
    cost = second.cost
    assert cost.copy_s_per_block is not None  # timed at start (HostKVStore.calibrate)
    a, b = distinct_prompts(config.vocab_size, 2, 57)
    cold = reference_greedy(tiny_model_dir, [a, b], 12)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in (a, b)] == cold  # a -> host
    assert cost.coefficients() is not None  # fitted from the steps the engine observed

    cost.observe_copy(1, 1e3)  # copies now look slow: recompute a
    again = llm.generate([a], GREEDY)[0]
    assert again.token_ids == cold[0] and again.num_cached_tokens == 0
    stats = llm.engine.stats()
    assert stats.kv_blocks_loaded_from_host == 0 and stats.host_cache_hits_tokens == 0

    cost.observe_copy(10**12, 0.0)  # and now free: b (pushed to the host by a) is loaded
    measured = cost.copy_s_per_block
    again = llm.generate([b], GREEDY)[0]
    assert again.token_ids == cold[1] and again.num_cached_tokens == 48
    assert llm.engine.stats().kv_blocks_loaded_from_host == 3
    assert cost.copy_s_per_block != measured  # the load's own time was observed


def test_a_full_host_tier_evicts_and_reports_it(tiny_model_dir: Path) -> None:
    """A host tier of 4 blocks cannot keep the prefixes of three prompts: it evicts, counts the
    evictions and publishes `removed` events for the host medium."""
    config = ModelConfig.from_folder(tiny_model_dir)
    block_bytes = 16 * config.kv_bytes_per_token * 4
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_bytes=5 * block_bytes,
        host_cache_bytes=4 * block_bytes,
        host_cache_load="always",
    )
    for prompt in distinct_prompts(config.vocab_size, 3, 57):
        llm.generate([prompt], GREEDY)
    stats = llm.engine.stats()
    assert stats.kv_blocks_saved_to_host >= 6 and stats.host_cache_evicted_blocks >= 2
    assert stats.host_cache_blocks <= 4
    host = [event for _, event in llm.engine.kv_events if event.medium == "host"]
    stored = {h for e in host if e.kind == "stored" for h in e.block_hashes}
    removed = [h for e in host if e.kind == "removed" for h in e.block_hashes]
    assert len(removed) == stats.host_cache_evicted_blocks and set(removed) <= stored
