"""Our float32 GEMM (`torch.ops.infercloud.linear_f32`) against the exact product: each output
is a float32 sum of K products, one rounding per multiply-add, so it lies within K * 2^-24 of the
exact value relative to the sum of the products' magnitudes (the usual bound for a float32 dot
product), and it agrees with F.linear (another summation order) to that bound too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.packed_linear import KernelLinear

ops = torch.ops.infercloud
pytestmark = pytest.mark.skipif(
    not (load_kernels() and ops.has_linear_f32()),
    reason=f"no float32 GEMM of ours here: {load_error() or 'CPU without AVX2 or AVX-512'}",
)


def _noise(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 960, 576), (7, 576, 576), (32, 3072, 576), (32, 576, 1536), (13, 50, 37), (513, 48, 64)],
)
def test_matches_the_exact_product_within_float32_rounding(
    rows: int, out_features: int, in_features: int
) -> None:
    """Row counts below, at and past the 4- and 8-row blocks (13, 513); out_features off the
    8- and 16-column tiles (50) and off the 3-tile groups (48 = 6 tiles of 8 = 3 of 16)."""
    x = _noise(rows, in_features, seed=1)
    w = _noise(out_features, in_features, seed=2) * 0.05
    got = ops.linear_f32(x, ops.pack_linear_f32(w), out_features)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = F.linear(x.double(), w.double())
    bound = in_features * 2.0**-24 * F.linear(x.double().abs(), w.double().abs())
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert bool(((got.double() - F.linear(x, w).double()).abs() <= 2 * bound).all())


def test_module_keeps_leading_dimensions_and_the_dtype() -> None:
    w = _noise(64, 32, seed=3)
    layer = KernelLinear(w)
    assert layer.float32 and not layer.use_tiles
    x = _noise(2, 5, 32, seed=4)
    torch.testing.assert_close(layer(x), F.linear(x, w))


def test_bad_input_is_refused() -> None:
    packed = ops.pack_linear_f32(_noise(32, 16, seed=5))
    with pytest.raises(RuntimeError, match="in_features"):
        ops.linear_f32(_noise(4, 18, seed=6), packed, 32)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.linear_f32(_noise(4, 16, seed=6), packed, 64)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_f32(_noise(4, 16, seed=6).to(torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_linear_f32(torch.ones(4, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="rows dense"):
        ops.linear_f32(_noise(16, 4, seed=7).t(), packed, 32)
