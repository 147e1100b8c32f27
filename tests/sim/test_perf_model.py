"""The performance model, the catalogs, and the fit of efficiency factors."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from infercloud.engine.step_shape import StepShape
from infercloud.sim.hardware import HardwareCatalog
from infercloud.sim.model_specs import load_model_catalog, model_spec
from infercloud.sim.perf_model import Efficiency, PerfModel, fit_efficiency

REQUIRED_HARDWARE = ("h100-sxm", "h200", "a100-80gb", "l40s", "l4", "mi300x", "b200")


def test_model_catalog_parameter_counts_match_the_published_sizes() -> None:
    catalog = load_model_catalog()
    for name in ("smollm2-135m", "llama-3-8b", "llama-3-70b", "qwen3-32b"):
        assert name in catalog
    assert model_spec("SmolLM2-135M").num_params == pytest.approx(134.5e6, rel=0.01)
    assert model_spec("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert model_spec("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert model_spec("qwen3-32b").num_params == pytest.approx(32.8e9, rel=0.02)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (k, v) = 65536 elements per token
    assert model_spec("llama-3-8b").kv_elements_per_token() == 65536


def test_hardware_catalog_has_sourced_specs_and_prices(tmp_path: object) -> None:
    catalog = HardwareCatalog.load()
    for name in REQUIRED_HARDWARE:
        acc = catalog[name]
        assert acc.peak_tflops > 0 and acc.bandwidth_gbps > 0 and acc.memory_gb > 0
        assert acc.source
        assert acc.prices and all(p.source and p.date for p in acc.prices)
    assert catalog["h100-sxm"].price("lambda").usd_per_hour > 0  # type: ignore[union-attr]
    with pytest.raises(KeyError, match="no price"):
        catalog["h100-sxm"].price("nobody")
    with pytest.raises(KeyError, match="unknown accelerator"):
        catalog["tpu-v9"]


def _perf(**kw: object) -> PerfModel:
    acc = HardwareCatalog.load()["h100-sxm"]
    return PerfModel(model_spec("llama-3-8b"), acc, **kw)  # type: ignore[arg-type]


def test_roofline_regimes_and_tensor_parallel() -> None:
    perf = _perf(efficiency=Efficiency(overhead_s=0.0, per_seq_s=0.0))
    decode = StepShape(((1000, 1),), 1)
    prefill = StepShape(((0, 4096),), 1)
    w = perf.work(decode)
    assert w.weight_bytes == perf.weight_bytes and w.kv_bytes > 0
    # decode: bandwidth-bound, prefill: compute-bound (the default overlap is the roofline's)
    e = perf.efficiency
    peak = 989e12
    memory_s = w.weight_bytes / (3.35e12 * e.bandwidth) + w.kv_bytes / (3.35e12 * e.kv_bandwidth)
    assert perf.step_s(decode) == pytest.approx(memory_s)
    p = perf.work(prefill)
    expected = p.linear_flops / (peak * e.compute) + p.attention_flops / (peak * e.attention)
    assert perf.step_s(prefill) == pytest.approx(expected)
    # batching decodes is nearly free until compute catches up
    batch = StepShape(tuple((1000, 1) for _ in range(32)), 32)
    assert perf.step_s(batch) < 2 * perf.step_s(decode)
    # two devices: half the time, plus the all-reduces
    tp2 = _perf(efficiency=perf.efficiency, tensor_parallel=2)
    assert tp2.step_s(prefill) < perf.step_s(prefill)
    assert tp2.work(prefill).comm_bytes > 0


def test_a_prefill_chunk_costs_per_chunk_s_and_a_decode_does_not() -> None:
    base = Efficiency(per_chunk_s=0.0)
    chunked = replace(base, per_chunk_s=0.002)
    four_chunks = StepShape(tuple((0, 64) for _ in range(4)), 4)
    one_chunk = StepShape(((0, 256),), 1)
    decodes = StepShape(tuple((500, 1) for _ in range(8)), 8)
    mixed = StepShape((*decodes.chunks, (0, 64)), 9)
    for shape, prefill_chunks in ((four_chunks, 4), (one_chunk, 1), (decodes, 0), (mixed, 1)):
        extra = _perf(efficiency=chunked).step_s(shape) - _perf(efficiency=base).step_s(shape)
        assert extra == pytest.approx(0.002 * prefill_chunks)
    # a decode run prices its steps as step_s does (no prefill chunk in it)
    perf = _perf(efficiency=chunked)
    starts = [100, 200, 300]
    run = perf.decode_run_s(starts, 3)
    for j in range(3):
        step = StepShape(tuple((s + j, 1) for s in starts), 3)
        assert run[j] == pytest.approx(perf.step_s(step))


def test_padded_decode_groups_read_what_the_builtin_engine_reads() -> None:
    """With the engine's grouping, decodes read their group's longest context (in whole
    blocks) and each group costs `decode_group_overhead_tokens` keys more."""
    plain = _perf(efficiency=Efficiency(), block_size=16)
    padded = _perf(efficiency=Efficiency(decode_group_overhead_tokens=1024), block_size=16)
    per_pair = plain.model.attention_flops_per_pair()

    def extra_keys(shape: StepShape) -> float:
        return (padded.work(shape).attention_flops - plain.work(shape).attention_flops) / per_pair

    equal = StepShape(tuple((159, 1) for _ in range(8)), 8)  # 160 keys each: 10 whole blocks
    assert extra_keys(equal) == pytest.approx(1024)  # one group, no padding
    # 18 at 100 keys and 18 at 1,100: two groups (7 and 69 blocks), padded to 112 and 1,104
    mixed = StepShape(tuple((99, 1) for _ in range(18)) + tuple((1099, 1) for _ in range(18)), 36)
    assert extra_keys(mixed) == pytest.approx(18 * 12 + 18 * 4 + 2 * 1024)
    assert padded.work(mixed).kv_bytes > plain.work(mixed).kv_bytes
    prefill = StepShape(((0, 256),), 1)  # prefill chunks are not padded
    assert extra_keys(prefill) == 0
    # a decode run is priced step by step, as step_s prices each step
    starts = [99] * 3 + [1099] * 3
    run = padded.decode_run_s(starts, 20)
    for j in (0, 7, 19):
        step = StepShape(tuple((s + j, 1) for s in starts), 6)
        assert run[j] == pytest.approx(padded.step_s(step))


def test_fit_recovers_the_factors_that_made_the_measurements() -> None:
    truth = Efficiency(
        compute=0.35,
        attention=0.15,
        bandwidth=0.55,
        kv_bandwidth=0.3,
        overlap=0.5,
        overhead_s=0.004,
        per_seq_s=3e-5,
        per_chunk_s=2e-3,
        source="truth",
    )
    perf = _perf(efficiency=truth)
    rng = random.Random(0)
    shapes = []
    for _ in range(80):
        kind = rng.random()
        if kind < 0.35:
            shapes.append(StepShape(((0, rng.randint(16, 4096)),), 1))
        elif kind < 0.5:
            n = rng.randint(2, 32)
            shapes.append(StepShape(tuple((0, rng.randint(16, 128)) for _ in range(n)), n))
        else:
            b = rng.randint(1, 128)
            shapes.append(StepShape(tuple((rng.randint(16, 4000), 1) for _ in range(b)), b))
    samples = [(s, perf.step_s(s)) for s in shapes]
    start = _perf()  # defaults: the fit must move away from them
    fitted, error = fit_efficiency(start, samples, "test")
    assert error < 0.01
    assert fitted.compute == pytest.approx(truth.compute, rel=0.05)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=0.05)
    assert fitted.overhead_s == pytest.approx(truth.overhead_s, rel=0.1)
    assert fitted.per_chunk_s == pytest.approx(truth.per_chunk_s, rel=0.1)
    assert fitted.source == "test"
    with pytest.raises(ValueError, match="at least"):
        fit_efficiency(start, samples[:3], "test")
    assert replace(fitted, source="x").source == "x"
