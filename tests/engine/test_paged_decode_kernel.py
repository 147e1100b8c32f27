"""The CPU decode-attention kernel against the plain-torch path, and its checks on bad input.

The reference is `paged_attention` with a padded `DecodeBatch` (gather, matmuls, softmax in
torch): the same softmax(q k^T * scale) v over each sequence's own blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    PagedDecodeBatch,
    paged_attention,
)
from infercloud.engine.cpu_kernels import load_error, load_kernels

from .tiled_kv import tiled_keys, tiled_values

BLOCK_SIZE = 16

pytestmark = pytest.mark.skipif(
    not load_kernels(), reason=f"CPU kernel unavailable: {load_error()}"
)


def _case(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, caches filled with noise, and block tables: each sequence's blocks at random rows."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in lengths)
    num_blocks = len(lengths) * max_blocks + 3
    shape = (num_kv_heads * num_blocks, BLOCK_SIZE, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks]
    return q, k_cache, v_cache, tables.view(len(lengths), max_blocks), num_blocks


def _torch_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[int],
    num_blocks: int,
    scale: float,
) -> torch.Tensor:
    num_kv_heads = k_cache.shape[0] // num_blocks
    n, max_blocks = tables.shape
    heads = torch.arange(num_kv_heads).view(-1, 1)
    rows = (heads * num_blocks + tables.reshape(1, -1)).reshape(-1)
    keys = torch.arange(max_blocks * BLOCK_SIZE)
    mask = keys.view(1, -1) < torch.tensor(lengths).view(-1, 1)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    meta = AttentionMetadata(
        write_rows=torch.empty(0, dtype=torch.long),
        decodes=[DecodeBatch(0, n, rows, max_blocks, bias.view(1, n, 1, -1))],
        prefills=[],
    )
    empty = q.new_empty(0, num_kv_heads, q.shape[2])
    # q's rows are all decodes and nothing is written (no new keys): only the read path runs.
    return paged_attention(q, empty, empty, k_cache, v_cache, meta, scale)


def _kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[int],
    num_blocks: int,
    scale: float,
    tiled: bool = False,
    tile_unit: bool = False,
) -> torch.Tensor:
    """The kernel; with `tiled`, over the same caches rearranged into the tiled layout (and with
    `tile_unit`, its products on the AMX tile unit)."""
    out: torch.Tensor = torch.ops.infercloud.paged_decode_attention(
        q,
        tiled_keys(k_cache) if tiled else k_cache,
        tiled_values(v_cache) if tiled else v_cache,
        tables.to(torch.int32).contiguous(),
        torch.tensor(lengths, dtype=torch.int32),
        scale,
        num_blocks,
        tiled,
        tile_unit,
    )
    return out


def _nan_past_contexts(
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[int],
    num_kv_heads: int,
    num_blocks: int,
) -> None:
    """NaN in every cache slot past each sequence's context (its last block's tail), in place."""
    for kv_head in range(num_kv_heads):
        for seq, n in enumerate(lengths):
            row = kv_head * num_blocks + int(tables[seq, (n - 1) // BLOCK_SIZE])
            k[row, (n - 1) % BLOCK_SIZE + 1 :] = float("nan")
            v[row, (n - 1) % BLOCK_SIZE + 1 :] = float("nan")


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (4, 1, 128), (4, 2, 16), (6, 3, 40)],
    ids=["smollm2", "mha", "head128", "tiny", "odd-head-dim"],
)
def test_kernel_matches_torch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    lengths = [1, 15, 16, 17, 33, 100, 250, 7]
    q, k, v, tables, num_blocks = _case(lengths, num_heads, num_kv_heads, head_dim, dtype, 0)
    scale = head_dim**-0.5
    want = _torch_reference(q.float(), k.float(), v.float(), tables, lengths, num_blocks, scale)
    got = _kernel(q, k, v, tables, lengths, num_blocks, scale)
    assert got.dtype == dtype and got.shape == (len(lengths), num_heads * head_dim)
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


TILED = pytest.mark.skipif(
    not (load_kernels() and torch.ops.infercloud.has_tiled_decode()),
    reason="tiled caches need AVX512-BF16",
)


@TILED
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (4, 1, 128), (16, 2, 64), (5, 5, 32), (6, 3, 128)],
    ids=["smollm2", "mha", "head128", "group8", "head32", "group2-head128"],
)
def test_tiled_caches_give_the_plain_result(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """The same keys and values in the tiled layout: torch's result within bfloat16's error,
    and the plain layout's within one rounding (its probabilities stay float32, the tiled path
    rounds them to bfloat16 as torch does). Odd lengths leave a token pair half outside the
    context: NaN in the slots past a context must not leak into the result."""
    lengths = [1, 2, 15, 16, 17, 33, 100, 250, 7]
    q, k, v, tables, num_blocks = _case(
        lengths, num_heads, num_kv_heads, head_dim, torch.bfloat16, 3
    )
    scale = head_dim**-0.5
    want = _torch_reference(q.float(), k.float(), v.float(), tables, lengths, num_blocks, scale)
    got = _kernel(q, k, v, tables, lengths, num_blocks, scale, tiled=True)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    plain = _kernel(q, k, v, tables, lengths, num_blocks, scale)
    torch.testing.assert_close(got.float(), plain.float(), atol=1.6e-2, rtol=1e-2)
    # NaN in every slot past each context (the last block's tail): nothing changes.
    _nan_past_contexts(k, v, tables, lengths, num_kv_heads, num_blocks)
    assert torch.equal(_kernel(q, k, v, tables, lengths, num_blocks, scale, tiled=True), got)


ON_TILES = pytest.mark.skipif(
    not (
        load_kernels()
        and torch.ops.infercloud.has_tiled_decode()
        and torch.ops.infercloud.has_attention_tiles()
    ),
    reason="needs the AMX tile unit",
)


@ON_TILES
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (4, 1, 128), (32, 2, 64), (5, 5, 32), (6, 3, 128), (17, 1, 64)],
    ids=["smollm2", "mha", "head128", "group16", "head32", "group2-head128", "group17"],
)
def test_tile_unit_gives_the_vector_result(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """On the tile unit: torch's result within bfloat16's error and the vdpbf16ps path's within
    float32 summation order (both round the probabilities to bfloat16). A group of more than 16
    query heads (a tile's rows) takes the vector path. NaN in the slots past each context, keys
    and values, must not leak into the result: the last block's values are zeroed there in a
    copy before they meet the tile unit."""
    lengths = [1, 2, 15, 16, 17, 33, 100, 250, 7]
    q, k, v, tables, num_blocks = _case(
        lengths, num_heads, num_kv_heads, head_dim, torch.bfloat16, 5
    )
    scale = head_dim**-0.5
    want = _torch_reference(q.float(), k.float(), v.float(), tables, lengths, num_blocks, scale)
    got = _kernel(q, k, v, tables, lengths, num_blocks, scale, tiled=True, tile_unit=True)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    vector = _kernel(q, k, v, tables, lengths, num_blocks, scale, tiled=True)
    torch.testing.assert_close(got.float(), vector.float(), atol=8e-3, rtol=8e-3)
    _nan_past_contexts(k, v, tables, lengths, num_kv_heads, num_blocks)
    again = _kernel(q, k, v, tables, lengths, num_blocks, scale, tiled=True, tile_unit=True)
    assert torch.equal(again, got)


@ON_TILES
def test_tile_unit_takes_large_scores() -> None:
    """Scores of ~1e4 (the tile unit sums them in float32, the softmax subtracts the maximum):
    finite, and torch's result."""
    lengths = [40, 3]
    q, k, v, tables, num_blocks = _case(lengths, 9, 3, 64, torch.bfloat16, 3)
    q = q * 300.0
    got = _kernel(q, k, v, tables, lengths, num_blocks, 1.0, tiled=True, tile_unit=True)
    assert torch.isfinite(got.float()).all()
    want = _torch_reference(q.float(), k.float(), v.float(), tables, lengths, num_blocks, 1.0)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@TILED
def test_tiled_caches_are_refused_where_the_layout_does_not_apply() -> None:
    q, k, v, tables, num_blocks = _case([5], 4, 2, 64, torch.float32, 0)
    with pytest.raises(RuntimeError, match="tiled caches"):
        _kernel(q, k, v, tables, [5], num_blocks, 0.125, tiled=True)
    q, k, v, tables, num_blocks = _case([5], 4, 2, 40, torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match="tiled caches"):
        torch.ops.infercloud.paged_decode_attention(
            q, k, v, tables.int(), torch.tensor([5], dtype=torch.int32), 0.1, num_blocks, True
        )


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 80), min_size=1, max_size=9),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_kernel_matches_torch_any_lengths(lengths: list[int], seed: int, threads: int) -> None:
    """Any mix of lengths, split between threads by work: the same result as torch."""
    q, k, v, tables, num_blocks = _case(lengths, 9, 3, 64, torch.float32, seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kernel(q, k, v, tables, lengths, num_blocks, 0.125)
    finally:
        torch.set_num_threads(before)
    want = _torch_reference(q, k, v, tables, lengths, num_blocks, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow() -> None:
    """The softmax subtracts the row's maximum: scores of 1e4 give finite, exact weights."""
    lengths = [40]
    q, k, v, tables, num_blocks = _case(lengths, 9, 3, 64, torch.float32, 3)
    q = q * 300.0
    got = _kernel(q, k, v, tables, lengths, num_blocks, 1.0)
    assert torch.isfinite(got).all()
    want = _torch_reference(q, k, v, tables, lengths, num_blocks, 1.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_no_sequences_gives_an_empty_result() -> None:
    q, k, v, tables, num_blocks = _case([5], 9, 3, 64, torch.float32, 0)
    out = _kernel(q[:0], k, v, tables[:0], [], num_blocks, 0.125)
    assert out.shape == (0, 9 * 64)


@pytest.mark.parametrize(
    ("lengths", "bad_table", "match"),
    [
        ([0], None, "is not in \\[1"),
        ([40], None, "is not in \\[1"),  # 40 keys need 3 blocks, the table has 2
        ([20], [[0, 10_000]], "block 10000 is not in"),
        ([20], [[-1, 0]], "block -1 is not in"),
    ],
    ids=["empty-context", "context-past-table", "block-past-pool", "negative-block"],
)
def test_bad_metadata_is_refused_not_read(
    lengths: list[int], bad_table: list[list[int]] | None, match: str
) -> None:
    q, k, v, _, num_blocks = _case([20], 9, 3, 64, torch.float32, 0)
    tables = torch.tensor(bad_table if bad_table is not None else [[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        _kernel(q, k, v, tables, lengths, num_blocks, 0.125)


def test_paged_attention_uses_the_kernel_for_decodes() -> None:
    """Through `paged_attention` with a `PagedDecodeBatch`: same rows as the padded path."""
    lengths = [3, 40, 17]
    q, k, v, tables, num_blocks = _case(lengths, 9, 3, 64, torch.float32, 5)
    meta = AttentionMetadata(
        write_rows=torch.empty(0, dtype=torch.long),
        decodes=[],
        prefills=[],
        paged_decode=PagedDecodeBatch(
            3, tables.to(torch.int32).contiguous(), torch.tensor(lengths, dtype=torch.int32)
        ),
    )
    empty = q.new_empty(0, 3, 64)
    got = paged_attention(q, empty, empty, k, v, meta, 0.125)
    want = _torch_reference(q, k, v, tables, lengths, num_blocks, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_are_read_in_place(dtype: torch.dtype) -> None:
    """q as a view of a wider row (the fused qkv output): the contiguous copy's result, bit for
    bit; heads that are not contiguous within a row are refused."""
    lengths = [3, 40, 17]
    q, k, v, tables, num_blocks = _case(lengths, 9, 3, 64, dtype, 2)
    wide = torch.randn(len(lengths), 9 * 64 + 100).to(dtype)
    wide[:, : 9 * 64] = q.reshape(len(lengths), -1)
    view = wide[:, : 9 * 64].view(len(lengths), 9, 64)
    assert not view.is_contiguous()
    want = _kernel(q, k, v, tables, lengths, num_blocks, 0.125)
    assert torch.equal(_kernel(view, k, v, tables, lengths, num_blocks, 0.125), want)
    if dtype == torch.bfloat16 and load_kernels() and torch.ops.infercloud.has_tiled_decode():
        for tile_unit in (False, True):  # tile_unit is ignored where the CPU has no AMX
            tiled = _kernel(q, k, v, tables, lengths, num_blocks, 0.125, True, tile_unit)
            strided = _kernel(view, k, v, tables, lengths, num_blocks, 0.125, True, tile_unit)
            assert torch.equal(strided, tiled)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        _kernel(
            q.transpose(1, 2).contiguous().transpose(1, 2), k, v, tables, lengths, num_blocks, 0.1
        )
