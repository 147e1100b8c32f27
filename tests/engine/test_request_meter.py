"""The engine's per-request meter: step time split by work, recompute told apart, KV held."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.engine.llm import LLM
from infercloud.engine.request_meter import RequestMeter, StepCostWeights, split_step
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import SchedulerConfig
from infercloud.engine.step_meter import StepMeter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@given(
    st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 512)), min_size=1, max_size=40),
    st.floats(0.0, 10.0),
    st.floats(0.0, 0.01),
)
def test_a_steps_shares_add_up_to_its_time(
    chunks: list[tuple[int, int]], step_s: float, pair_tokens: float
) -> None:
    shares = split_step(chunks, step_s, StepCostWeights(pair_tokens))
    assert all(s >= 0 for s in shares)
    assert sum(shares) == pytest.approx(step_s, abs=1e-9)


@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 2)), min_size=1, max_size=12),
    st.lists(st.floats(1e-4, 0.1), min_size=1, max_size=70),
    st.floats(0.0, 0.01),
)
def test_a_decode_run_is_charged_as_its_steps_one_by_one(
    requests: list[tuple[int, int]], steps_s: list[float], pair_tokens: float
) -> None:
    """`StepMeter.charge_decode_run` against `split_step` step by step: each request computes
    one token a step; its table (its blocks for `start` tokens, plus `spare` allocated ahead)
    grows by a block whenever its tokens need one, held from that step on."""
    bs, block_bytes, held_bytes = 16, 1000, 5000.0
    weights = StepCostWeights(pair_tokens)
    meter = StepMeter(KVCacheManager(BlockPool(8), bs), block_bytes, weights)
    starts = [start for start, _ in requests]
    tables = [-(-start // bs) + spare for start, spare in requests]
    run = [SimpleNamespace(meter=RequestMeter()) for _ in requests]
    held = [(r, held_bytes) for r in run]
    meter.charge_decode_run(run, starts, np.array(steps_s), held, tables)  # type: ignore[arg-type]
    expected_compute = [0.0] * len(requests)
    expected_byte_s = [0.0] * len(requests)
    for j, step_s in enumerate(steps_s):
        shares = split_step([(start + j, 1) for start in starts], step_s, weights)
        for i, (start, table) in enumerate(zip(starts, tables, strict=True)):
            expected_compute[i] += shares[i]
            blocks = max(table, -(-(start + j + 1) // bs))
            expected_byte_s[i] += (held_bytes + (blocks - table) * block_bytes) * step_s
    for r, compute_s, byte_s in zip(run, expected_compute, expected_byte_s, strict=True):
        assert r.meter.compute_s == pytest.approx(compute_s, rel=1e-9)
        assert r.meter.kv_byte_s == pytest.approx(byte_s, rel=1e-9)


def test_recompute_is_what_was_computed_before_or_evicted() -> None:
    meter = RequestMeter()
    meter.charge_chunk(0, 100, 1.0)
    assert (meter.compute_s, meter.recompute_s, meter.recomputed_tokens) == (1.0, 0.0, 0)
    meter.charge_chunk(0, 150, 3.0)  # preempted, then recomputed 100 and computed 50 new
    assert meter.recomputed_tokens == 100
    assert meter.recompute_s == pytest.approx(2.0)
    assert meter.compute_s == pytest.approx(2.0)
    evicted = RequestMeter(evicted_prefix_tokens=64)
    evicted.charge_chunk(32, 64, 1.0)  # 32 cached, 32 evicted once, 32 new
    assert evicted.recomputed_tokens == 32
    assert evicted.recompute_s == pytest.approx(0.5)


def test_the_engine_meters_every_step(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(40 + 9 * i)] for i in range(4)]
    started = time.perf_counter()
    outs = llm.generate(prompts, GREEDY)
    wall_s = time.perf_counter() - started
    meters = [o.meter for o in outs]
    assert all(m is not None for m in meters)
    metered = sum(m.compute_s + m.recompute_s for m in meters if m is not None)
    # the steps are most of the wall time and never more than it
    assert 0.5 * wall_s < metered <= wall_s
    for out, m in zip(outs, meters, strict=True):
        assert m is not None
        assert m.recomputed_tokens == 0 and m.recompute_s == 0
        assert m.computed_high_water == len(out.prompt_token_ids) + len(out.token_ids) - 1
        assert m.kv_byte_s > 0
    # a longer prompt costs more compute than a shorter one in the same batch
    assert meters[3].compute_s > meters[0].compute_s  # type: ignore[union-attr]


def test_preemption_and_eviction_are_metered_as_recompute(tiny_model_dir: Path) -> None:
    """A pool of 6 blocks of 16 tokens: two 40-token prompts cannot both grow to 72 tokens, so
    one is preempted and computes its context again; then the first prompt, evicted meanwhile,
    comes back and is recomputed."""
    scheduler = SchedulerConfig(max_num_batched_tokens=128, long_prefill_token_threshold=128)
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=6 * 8192, dtype="float32", scheduler=scheduler)
    assert llm.engine.block_pool.num_blocks == 6
    vocab = llm.engine.model_config.vocab_size
    a = [(5 * j) % (vocab - 3) + 3 for j in range(40)]
    b = [(11 * j + 1) % (vocab - 3) + 3 for j in range(40)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([a, b], params)
    assert llm.engine.stats().num_preemptions >= 1
    assert any(o.meter is not None and o.meter.recomputed_tokens > 0 for o in outs)
    # fill the cache with other prompts so that `a`'s blocks are evicted, then ask for `a`
    others = [[(13 * j + k) % (vocab - 3) + 3 for j in range(60)] for k in range(3)]
    llm.generate(others, GREEDY)
    again = llm.generate([a], GREEDY)[0]
    assert again.meter is not None
    assert again.num_cached_tokens == 0
    assert again.meter.recomputed_tokens == 32  # a's two full blocks were cached once
    assert again.meter.recompute_s > 0
