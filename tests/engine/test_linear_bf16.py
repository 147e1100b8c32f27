"""Our bfloat16 GEMM (`torch.ops.infercloud.linear_bf16`) against float32 arithmetic on the same
bfloat16 inputs: each output is the float32 sum rounded once to bfloat16, so it may differ from
the exactly rounded value by one unit in the last place (the float32 sum runs in another
order), never by more. Every path: vdpbf16ps, float32 multiply-adds on the weights widened in
registers (`set_linear_bf16_fma`), and the AMX tile unit where this CPU has one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.llama import MLP
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.packed_linear import KernelGateUpSilu, KernelLinear, pack_linears

ops = torch.ops.infercloud
pytestmark = pytest.mark.skipif(
    not (load_kernels() and ops.has_linear_bf16()),
    reason=f"no AVX512-BF16 linear kernel here: {load_error() or 'CPU without AVX512-BF16'}",
)


@pytest.fixture(params=[False, True], ids=["vdpbf16ps", "fma"])
def fma(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The vector path's way to multiply, switched for the test and back after it."""
    was = ops.set_linear_bf16_fma(request.param)
    yield bool(request.param)
    ops.set_linear_bf16_fma(was)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 960, 576), (7, 576, 576), (32, 3072, 576), (32, 576, 1536), (13, 50, 37), (513, 48, 64)],
)
def test_matches_float32_arithmetic_to_one_ulp(
    rows: int, out_features: int, in_features: int, fma: bool
) -> None:
    """Row counts below, at and past the 8-row blocks; odd in_features (a lone last k);
    out_features off the 16-column tiles (50) and off the 3-tile groups (48)."""
    _check(rows, out_features, in_features, use_tiles=False)


@pytest.mark.skipif(not (load_kernels() and ops.has_linear_tiles()), reason="no AMX tile unit")
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 960, 576),
        (7, 576, 576),
        (32, 3072, 576),
        (32, 576, 1536),
        (33, 50, 64),  # a full 32-row block and one padded row; 4 column tiles, the last partial
        (513, 48, 64),  # 3 column tiles: the last pair of tiles is a single one
        (13, 50, 37),  # k not a multiple of 32: the vdpbf16ps path serves it
    ],
)
def test_tile_path_matches_float32_arithmetic_to_one_ulp(
    rows: int, out_features: int, in_features: int
) -> None:
    _check(rows, out_features, in_features, use_tiles=True)


def _check(rows: int, out_features: int, in_features: int, use_tiles: bool) -> None:
    x = _bf16(rows, in_features, seed=1)
    w = _bf16(out_features, in_features, seed=2) * 0.05
    got = ops.linear_bf16(x, ops.pack_linear_bf16(w), out_features, use_tiles)
    exact = F.linear(x.double(), w.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert bool(((got.double() - exact).abs() <= ulp + 1e-6).all())


def test_module_keeps_leading_dimensions() -> None:
    w = _bf16(64, 32, seed=3)
    layer = KernelLinear(w)
    x = _bf16(2, 5, 32, seed=4)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2)


def test_bad_input_is_refused() -> None:
    packed = ops.pack_linear_bf16(_bf16(32, 16, seed=5))
    with pytest.raises(RuntimeError, match="in_features"):
        ops.linear_bf16(_bf16(4, 18, seed=6), packed, 32)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.linear_bf16(_bf16(4, 16, seed=6), packed, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_bf16(torch.ones(4, 16), packed, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_linear_bf16(torch.ones(4, 16))


@pytest.mark.parametrize("use_tiles", [False, True])
@pytest.mark.parametrize(
    ("rows", "intermediate", "in_features"),
    [
        (1, 1536, 576),  # SmolLM2's MLP, one decode row
        (7, 64, 96),  # below one 8-row block
        (32, 1536, 576),
        (33, 32, 64),  # a full 32-row tile block and one padded row
        (77, 48, 37),  # odd in_features: the vdpbf16ps path with a lone last k
        (512, 1536, 576),  # a prefill step's rows
    ],
)
def test_gate_up_silu_is_silu_and_mul_of_the_plain_gemm_bit_for_bit(
    rows: int, intermediate: int, in_features: int, use_tiles: bool, fma: bool
) -> None:
    """The fused epilogue does silu_and_mul's arithmetic on what linear_bf16 would have stored,
    and interleaving the tiles does not change any column's sum, so the bits are the same."""
    if use_tiles and not ops.has_linear_tiles():
        pytest.skip("no AMX tile unit")
    if use_tiles and fma:
        pytest.skip("the switch is for the vector path only")
    w = _bf16(2 * intermediate, in_features, seed=7) * 0.05
    x = _bf16(rows, in_features, seed=8)
    packed = ops.pack_linear_bf16(w)
    want = ops.silu_and_mul(ops.linear_bf16(x, packed, 2 * intermediate, use_tiles))
    got = ops.linear_silu_bf16(x, ops.interleave_gate_up(packed), intermediate, use_tiles)
    assert got.shape == (rows, intermediate)
    assert torch.equal(got, want)
    # and both are silu(gate) * up to bfloat16 precision
    gate, up = F.linear(x.float(), w.float()).split(intermediate, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_gate_up_silu_module_and_bad_input() -> None:
    w = _bf16(64, 32, seed=9)
    fused = KernelGateUpSilu(KernelLinear(w))
    x = _bf16(2, 5, 32, seed=10)
    gate, up = F.linear(x.float(), w.float()).split(32, dim=-1)
    torch.testing.assert_close(fused(x).float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)
    packed = ops.interleave_gate_up(ops.pack_linear_bf16(w))
    with pytest.raises(RuntimeError, match="intermediate_size"):
        ops.linear_silu_bf16(_bf16(4, 32, seed=11), packed, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.interleave_gate_up(ops.pack_linear_bf16(_bf16(48, 32, seed=12)))
    with pytest.raises(ValueError, match="16-column tiles"):
        KernelGateUpSilu(KernelLinear(_bf16(48, 32, seed=13)))


@pytest.mark.parametrize(("intermediate", "fused"), [(32, True), (24, False)])
def test_an_mlp_fuses_gate_up_silu_only_over_whole_tiles(intermediate: int, fused: bool) -> None:
    """An intermediate size off the 16-column tiles keeps gate_up and silu_and_mul apart (and
    the model runner then keeps the Python layer loop, which handles both), with the same
    output either way."""
    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=intermediate,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_ids=(0,),
        bos_token_id=None,
    )
    mlp = MLP(config).to(torch.bfloat16)
    x = _bf16(3, 32, seed=14)
    with torch.no_grad():
        want = mlp(x)
        pack_linears(mlp, kernel=True)
        mlp.fused = True
        assert mlp.fuse_gate_up_silu() is fused
        assert isinstance(mlp.gate_up_proj, KernelGateUpSilu if fused else KernelLinear)
        torch.testing.assert_close(mlp(x).float(), want.float(), rtol=2e-2, atol=2e-2)
