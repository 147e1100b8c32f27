"""Our prefill attention kernel (`torch.ops.infercloud.paged_prefill_attention`) against float32
causal attention on the same bfloat16 queries, keys and values, read through block tables:
chunks at the start of a prompt and after earlier tokens, of one token, and longer than a
block, in one call. Its error must be no larger than that of the plain-torch bfloat16 path the
engine uses otherwise (matmuls in bfloat16, softmax rounded to bfloat16). The float32 path
(AVX2 or AVX-512) against float64 attention on the same float32 inputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels

from .tiled_kv import tiled_keys, tiled_values

ops = torch.ops.infercloud
pytestmark = pytest.mark.skipif(not load_kernels(), reason=f"CPU kernels: {load_error()}")
bf16 = pytest.mark.skipif(
    not (load_kernels() and ops.has_linear_bf16()), reason="no AVX512-BF16 on this CPU"
)
f32 = pytest.mark.skipif(
    not (load_kernels() and ops.has_linear_f32()), reason="no AVX2 or AVX-512 on this CPU"
)

KV_HEADS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 3, 9, 64, 16, 256
GROUP = HEADS // KV_HEADS
CHUNKS = [(0, 128), (100, 37), (0, 1), (250, 256), (7, 9)]  # (start, tokens)


def _setup() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(KV_HEADS * NUM_BLOCKS, BLOCK, HEAD_DIM, generator=gen).bfloat16()
    v_cache = torch.randn(KV_HEADS * NUM_BLOCKS, BLOCK, HEAD_DIM, generator=gen).bfloat16()
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(-(-(s + n) // BLOCK) for s, n in CHUNKS)
    tables, used = [], 0
    for start, n in CHUNKS:
        blocks = -(-(start + n) // BLOCK)
        tables.append(perm[used : used + blocks] + [0] * (max_blocks - blocks))
        used += blocks
    q = torch.randn(sum(n for _, n in CHUNKS), HEADS, HEAD_DIM, generator=gen).bfloat16()
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def _keys(cache: torch.Tensor, table: list[int], head: int, ctx: int) -> torch.Tensor:
    blocks = cache.view(KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)[head, table[: -(-ctx // BLOCK)]]
    return blocks.reshape(-1, HEAD_DIM)[:ctx]


def _per_head(
    got: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each (chunk, KV head): the kernel's output rows, the query rows (token-major, the
    group's heads adjacent), the chunk's keys and values so far, and the causal bias."""
    row = 0
    for (start, n), table in zip(CHUNKS, tables.tolist(), strict=True):
        ctx = start + n
        future = (
            torch.arange(ctx)[None, :] > torch.arange(start, ctx).repeat_interleave(GROUP)[:, None]
        )
        bias = torch.zeros(future.shape).masked_fill(future, float("-inf"))
        for h in range(KV_HEADS):
            heads = slice(h * GROUP, (h + 1) * GROUP)
            mine = got[row : row + n].view(n, HEADS, HEAD_DIM)[:, heads].reshape(-1, HEAD_DIM)
            qh = q[row : row + n, heads].reshape(-1, HEAD_DIM)
            k, v = _keys(k_cache, table, h, ctx), _keys(v_cache, table, h, ctx)
            yield mine, qh, k, v, bias
        row += n


on_tiles = pytest.mark.skipif(
    not (load_kernels() and ops.has_linear_bf16() and ops.has_attention_tiles()),
    reason="no AMX tile unit on this CPU",
)
TILE_UNIT = [False, pytest.param(True, marks=on_tiles, id="tile-unit")]


@bf16
@pytest.mark.parametrize("tile_unit", TILE_UNIT)
def test_matches_causal_attention_as_closely_as_the_torch_path(tile_unit: bool) -> None:
    q, k_cache, v_cache, tables = _setup()
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    lens = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    got = ops.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, scale, NUM_BLOCKS, False, tile_unit
    )
    assert got.shape == (q.shape[0], HEADS * HEAD_DIM) and got.dtype == torch.bfloat16
    err_kernel, err_torch = 0.0, 0.0
    for mine, qh, k, v, bias in _per_head(got, q, k_cache, v_cache, tables):
        exact = torch.softmax(qh.float() @ k.float().T * scale + bias, -1) @ v.float()
        plain = torch.softmax(torch.add(bias.bfloat16(), qh @ k.T, alpha=scale), -1) @ v
        err_kernel = max(err_kernel, (mine.float() - exact).abs().max().item())
        err_torch = max(err_torch, (plain.float() - exact).abs().max().item())
    assert err_kernel <= err_torch * 1.25 + 1e-3, (err_kernel, err_torch)


@bf16
@pytest.mark.parametrize("tile_unit", TILE_UNIT)
def test_tiled_caches_give_the_same_bits(tile_unit: bool) -> None:
    """The tiled layout's blocks are the tiles the kernel packs from plain ones: the same
    result, bit for bit, also with NaN in every slot past each chunk's context (the tiled path
    reads those slots and must mask them, the plain one never reads them)."""
    q, k_cache, v_cache, tables = _setup()
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    lens = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    want = ops.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, scale, NUM_BLOCKS, False, tile_unit
    )
    for (start, n), table in zip(CHUNKS, tables.tolist(), strict=True):
        last, used = table[(start + n - 1) // BLOCK], (start + n - 1) % BLOCK + 1
        for h in range(KV_HEADS):
            k_cache[h * NUM_BLOCKS + last, used:] = float("nan")
            v_cache[h * NUM_BLOCKS + last, used:] = float("nan")
    k_tiled, v_tiled = tiled_keys(k_cache), tiled_values(v_cache)
    got = ops.paged_prefill_attention(
        q, k_tiled, v_tiled, tables, starts, lens, scale, NUM_BLOCKS, True, tile_unit
    )
    assert torch.equal(got, want)


@on_tiles
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (9, 3, 64), (4, 1, 128)])
def test_tile_unit_gives_the_vector_result(heads: int, kv_heads: int, head_dim: int) -> None:
    """The tile unit's products against vdpbf16ps's, on the same packed tiles: equal within
    float32 summation order (both round the probabilities to bfloat16), for every head size the
    kernel takes a tile path for; a group of 4 query heads of 128 dimensions needs two passes
    over the values (four output tiles at a time)."""
    gen = torch.Generator().manual_seed(1)
    num_blocks = 64
    chunks = [(0, 70), (33, 5), (0, 1), (200, 48)]
    k_cache = torch.randn(kv_heads * num_blocks, BLOCK, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads * num_blocks, BLOCK, head_dim, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * 16].view(len(chunks), 16)
    q = torch.randn(sum(n for _, n in chunks), heads, head_dim, generator=gen).bfloat16()
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32)
    lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables.int(), starts, lens, head_dim**-0.5, num_blocks, False)
    vector = ops.paged_prefill_attention(*args, False)
    tiles = ops.paged_prefill_attention(*args, True)
    torch.testing.assert_close(tiles.float(), vector.float(), atol=8e-3, rtol=8e-3)


@f32
def test_float32_matches_causal_attention() -> None:
    """Within float32 rounding of float64 attention (the plain-torch float32 path's error, with
    room for another summation order), with NaN in every cache slot past each chunk's context:
    those are never read."""
    q, k_cache, v_cache, tables = (t.float() if t.is_floating_point() else t for t in _setup())
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    lens = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    for (start, n), table in zip(CHUNKS, tables.tolist(), strict=True):
        last, used = table[(start + n - 1) // BLOCK], (start + n - 1) % BLOCK + 1
        for h in range(KV_HEADS):
            k_cache[h * NUM_BLOCKS + last, used:] = float("nan")
            v_cache[h * NUM_BLOCKS + last, used:] = float("nan")
    got = ops.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, NUM_BLOCKS)
    assert got.shape == (q.shape[0], HEADS * HEAD_DIM) and got.dtype == torch.float32
    err_kernel, err_torch = 0.0, 0.0
    for mine, qh, k, v, bias in _per_head(got, q, k_cache, v_cache, tables):
        exact = torch.softmax(qh.double() @ k.double().T * scale + bias.double(), -1) @ v.double()
        plain = torch.softmax(qh @ k.T * scale + bias, -1) @ v
        err_kernel = max(err_kernel, (mine.double() - exact).abs().max().item())
        err_torch = max(err_torch, (plain.double() - exact).abs().max().item())
    assert err_kernel <= err_torch * 2 + 1e-6, (err_kernel, err_torch)


@bf16
def test_bad_input_is_refused() -> None:
    q, k_cache, v_cache, tables = _setup()
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    lens = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="add up"):
        ops.paged_prefill_attention(q[1:], k_cache, v_cache, tables, starts, lens, 0.1, NUM_BLOCKS)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts + 4096, lens, 0.1, NUM_BLOCKS
        )
    bad = tables.clone()
    bad[0, 0] = NUM_BLOCKS
    with pytest.raises(RuntimeError, match="is not in"):
        ops.paged_prefill_attention(q, k_cache, v_cache, bad, starts, lens, 0.1, NUM_BLOCKS)


@f32
def test_float32_bad_input_is_refused() -> None:
    q, k_cache, v_cache, tables = (t.float() if t.is_floating_point() else t for t in _setup())
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    lens = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q's dtype"):
        ops.paged_prefill_attention(
            q, k_cache.bfloat16(), v_cache, tables, starts, lens, 0.1, NUM_BLOCKS
        )
    with pytest.raises(RuntimeError, match="tiled caches are bfloat16"):
        ops.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, 0.1, NUM_BLOCKS, True
        )
    with pytest.raises(RuntimeError, match="add up"):
        ops.paged_prefill_attention(q[1:], k_cache, v_cache, tables, starts, lens, 0.1, NUM_BLOCKS)
