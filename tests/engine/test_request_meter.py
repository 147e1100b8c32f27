"""The engine's per-request meter: step time split by work, recompute told apart, KV held."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infercloud.engine.llm import LLM
from infercloud.engine.request_meter import RequestMeter, StepCostWeights, split_step
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import SchedulerConfig

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
