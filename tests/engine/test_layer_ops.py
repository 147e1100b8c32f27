"""Our fused element-wise CPU operators against the plain-torch layer code they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.llama import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not load_kernels(), reason=f"CPU kernels: {load_error()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.4e-7, torch.bfloat16: 7.9e-3, torch.float16: 9.8e-4}
"""The spacing of each dtype just above 1: a relative tolerance of two of these."""
ops = torch.ops.infercloud


def _noise(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm(width: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _noise(width, dtype=torch.float32, seed=9))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 576), (64, 576), (5, 42)])
def test_rms_norm_matches_the_module(dtype: torch.dtype, rows: int, width: int) -> None:
    """Width 42: vectors (16 or 8 lanes) and a scalar tail (10 or 2)."""
    x = _noise(rows, width, dtype=dtype)
    norm = _norm(width, dtype)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    want = norm(x)
    assert got.dtype == dtype
    # The mean of squares may sum in another order: a unit in the last place here and there.
    torch.testing.assert_close(got, want, rtol=2 * ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 42])
def test_add_rms_norm_adds_in_place_as_torch_rounds(dtype: torch.dtype, width: int) -> None:
    residual = _noise(9, width, dtype=dtype, seed=1)
    delta = _noise(9, width, dtype=dtype, seed=2)
    norm = _norm(width, dtype)
    summed = residual + delta
    got = ops.add_rms_norm(residual, delta, norm.weight, norm.eps)
    assert torch.equal(residual, summed)  # the residual now holds the sum, rounded alike
    torch.testing.assert_close(got, norm(summed), rtol=2 * ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_in_place_equals_the_module(dtype: torch.dtype, head_dim: int) -> None:
    """On strided views of a fused qkv row, as the attention layer calls it: bit for bit (head
    size 40: vectors of 16 or 8 lanes and a tail of 4 per half)."""
    tokens, heads, kv_heads = 11, 9, 3
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0)
    qkv = _noise(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 15, 16, 100, 7, 2047, 3, 3, 500])
    want_q, want_k = rotary(positions, q, k)
    untouched = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.rotary_embedding_(q, k, positions, rotary.cos, rotary.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], untouched)  # v is not written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 42])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, width: int) -> None:
    """Widths that are and are not a multiple of 16 (vector and scalar tails)."""
    gate_up = _noise(5, 2 * width, dtype=dtype, seed=4) * 4
    gate, up = gate_up.split(width, dim=-1)
    got = ops.silu_and_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up)


def test_the_vector_path_is_the_widest_this_cpu_has() -> None:
    """16 lanes with AVX-512, 8 with AVX2 (and FMA, F16C), else the scalar loops; a build that
    silently fell back to scalar code on a vector CPU would fail here. Widths in the tests above
    (42 = 2 x 16 + 10 = 5 x 8 + 2) leave a scalar tail at either width."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    flags = set(next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split())
    want = 16 if "avx512f" in flags else 8 if {"avx2", "fma", "f16c"} <= flags else 0
    assert ops.vector_lanes() == want


def test_silu_of_extreme_inputs_is_finite() -> None:
    gate_up = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 2.0, 3.0, 4.0, 5.0, 6.0]])
    got = ops.silu_and_mul(gate_up.repeat(1, 4))  # width 20: one vector and a tail
    want = F.silu(gate_up.repeat(1, 2)) * gate_up.repeat(1, 2)
    torch.testing.assert_close(got, want)


def test_bad_input_is_refused() -> None:
    rotary = RotaryEmbedding(64, 16, 10000.0)
    q = torch.zeros(2, 9, 64)
    k = torch.zeros(2, 3, 64)
    with pytest.raises(RuntimeError, match="position 16 is not in"):
        ops.rotary_embedding_(q, k, torch.tensor([0, 16]), rotary.cos, rotary.sin)
    with pytest.raises(RuntimeError, match="width must be even"):
        ops.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))
