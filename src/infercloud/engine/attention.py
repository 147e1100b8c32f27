"""Attention over a paged KV cache, in plain torch.

Each layer keeps keys and values as `[num_kv_heads * num_blocks, block_size, head_dim]`: head
major, so that one `index_select` over rows `head * num_blocks + block` yields
`[num_kv_heads, num_seqs, context, head_dim]` directly, contiguous, with no further copy before
the matmuls (gathering along a middle dimension instead was 6x slower here). A step writes its
new keys and values to their slots (slot = block_id * block_size + offset, one slot array per
head), then each query reads the blocks of its own request's block table.

The row indices are built once per step by the model runner and shared by all layers.

Queries are grouped as the model runner lays them out: all single-token (decode) rows first,
then each multi-token chunk (prefill) with its own causal bias. Decodes take one of two paths:
on the CPU, where our kernel builds (`cpu_kernels.py`), one call reads every sequence's blocks
in place, each at its own length (`PagedDecodeBatch`); elsewhere they are gathered into padded
batches of similar context length (`decode_groups`), each batched into one call. Prefill chunks
in bfloat16 on CPUs with AVX512-BF16 go through our prefill kernel in one call
(`PagedPrefillBatch`); elsewhere each is gathered and attends through matmuls.
Grouped-query attention needs no copies of the KV heads: the query heads that share a KV head
are folded into the query-length axis.

Where both kernels serve (and `EngineConfig.kv_layout` is "auto"), each block holds its tokens
in the tiled layout of `csrc/kv_layout.h` instead ([head_dim / 2][16][2] keys, [8][head_dim][2]
values): the operands vdpbf16ps takes. Only the kernels read such a cache, and new keys and
values go in through `write_kv_tiled` (`AttentionMetadata.tiled`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodeBatch:
    """`num_seqs` single-token queries in rows `row_start .. row_start + num_seqs - 1`."""

    row_start: int
    num_seqs: int
    gather_rows: torch.Tensor
    """[num_kv_heads * num_seqs * max_blocks] cache rows (head * num_blocks + block), each
    request's table padded with block 0."""
    max_blocks: int
    bias: torch.Tensor
    """[1, num_seqs, 1, max_blocks * block_size] in the model's dtype: 0 where a key counts,
    -inf elsewhere."""


@dataclass(slots=True)
class PagedDecodeBatch:
    """`num_seqs` single-token queries in rows `0 .. num_seqs - 1`, for the CPU kernel."""

    num_seqs: int
    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks]: each request's blocks; entries past its last are unread."""
    context_lens: torch.Tensor
    """int32 [num_seqs]: keys each query attends to (its own token included)."""


@dataclass(slots=True)
class PagedPrefillBatch:
    """Every prefill chunk of the step, in rows `row_start ..`, for the CPU prefill kernel."""

    row_start: int
    num_rows: int
    block_tables: torch.Tensor
    """int32 [num_chunks, max_blocks]: each chunk's request's blocks (up to the chunk's end)."""
    starts: torch.Tensor
    """int32 [num_chunks]: position of each chunk's first token."""
    lens: torch.Tensor
    """int32 [num_chunks]: tokens of each chunk, in row order."""


@dataclass(slots=True)
class PrefillChunk:
    """A chunk of `num_query` tokens in rows `row_start ..` over the request's first blocks."""

    row_start: int
    num_query: int
    gather_rows: torch.Tensor
    """[num_kv_heads * num_blocks] cache rows of the request's blocks covering tokens 0 .. end
    of this chunk."""
    bias: torch.Tensor
    """[num_query * group, num_blocks * block_size] causal bias in the model's dtype, rows per
    grouped head."""


@dataclass(slots=True)
class AttentionMetadata:
    write_rows: torch.Tensor
    """[num_kv_heads * num_tokens] row of the per-head slot arrays where each new token's key
    and value are written (head * num_slots + slot), head major."""
    decodes: list[DecodeBatch]
    prefills: list[PrefillChunk]
    paged_decode: PagedDecodeBatch | None = None
    """Set instead of `decodes` when the CPU kernel serves the decodes."""
    paged_prefill: PagedPrefillBatch | None = None
    """Set instead of `prefills` when the CPU prefill kernel serves the chunks."""
    tiled: bool = False
    """The caches are in the tiled layout (`csrc/kv_layout.h`): new keys and values go in
    through `write_kv_tiled`, and only the kernels read them (`decodes` and `prefills` are
    empty)."""
    tile_unit: bool = False
    """Both attention kernels run their products on the AMX tile unit (`csrc/paged_attention.cpp`,
    `csrc/prefill_attention.cpp`); decode attention only with `tiled`."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D]; returns [T, H * D]. Writes k, v into the caches."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if meta.tiled:
        if meta.decodes or meta.prefills:
            raise ValueError("a tiled KV cache is read by the attention kernels only")
        torch.ops.infercloud.write_kv_tiled(k_cache, v_cache, k, v, meta.write_rows)
    else:
        flat = (-1, head_dim)
        k_cache.view(flat).index_copy_(0, meta.write_rows, k.transpose(0, 1).reshape(flat))
        v_cache.view(flat).index_copy_(0, meta.write_rows, v.transpose(0, 1).reshape(flat))
    out = q.new_empty(num_tokens, num_heads * head_dim)

    paged = meta.paged_decode
    if paged is not None:
        num_blocks = k_cache.shape[0] // num_kv_heads
        q_rows = q[: paged.num_seqs]
        if q_rows.stride(2) != 1 or q_rows.stride(1) != head_dim:
            q_rows = q_rows.contiguous()  # the kernel reads rows whose heads are contiguous
        out[: paged.num_seqs] = torch.ops.infercloud.paged_decode_attention(
            q_rows,
            k_cache,
            v_cache,
            paged.block_tables,
            paged.context_lens,
            scale,
            num_blocks,
            meta.tiled,
            meta.tile_unit,
        )

    for decode in meta.decodes:
        n = decode.num_seqs
        rows = slice(decode.row_start, decode.row_start + n)
        shape = (num_kv_heads, n, decode.max_blocks * block_size, head_dim)
        kd = k_cache.index_select(0, decode.gather_rows).view(shape)
        vd = v_cache.index_select(0, decode.gather_rows).view(shape)
        qd = q[rows].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
        od = _attend(qd, kd, vd, decode.bias, scale)  # [Hkv, n, group, D]
        out[rows] = od.transpose(0, 1).reshape(n, num_heads * head_dim)

    prefill = meta.paged_prefill
    if prefill is not None:
        num_blocks = k_cache.shape[0] // num_kv_heads
        rows = slice(prefill.row_start, prefill.row_start + prefill.num_rows)
        out[rows] = torch.ops.infercloud.paged_prefill_attention(
            q[rows].contiguous(),
            k_cache,
            v_cache,
            prefill.block_tables,
            prefill.starts,
            prefill.lens,
            scale,
            num_blocks,
            meta.tiled,
            meta.tile_unit,
        )

    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_query)
        m = chunk.num_query
        chunk_shape = (num_kv_heads, -1, head_dim)
        qp = q[rows].view(m, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
        qp = qp.reshape(num_kv_heads, m * group, head_dim)
        kp = k_cache.index_select(0, chunk.gather_rows).view(chunk_shape)
        vp = v_cache.index_select(0, chunk.gather_rows).view(chunk_shape)
        op = _attend(qp, kp, vp, chunk.bias, scale)
        op = op.view(num_kv_heads, m, group, head_dim).permute(1, 0, 2, 3)
        out[rows] = op.reshape(m, num_heads * head_dim)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, all in the model's dtype; torch's softmax accumulates
    in float32 for bfloat16 and float16 inputs and rounds its output, so the probabilities are
    what a float32 softmax rounded to the dtype gives. The scores are the matmul's, already in
    the dtype; scaling them by a power of two (head size 64: 1/8) and adding 0 or -inf is exact,
    so for such head sizes this equals computing the softmax's input in float32. Staying in
    the dtype saves three passes over float32 scores, which dominate a long prefill chunk's
    attention after the matmuls.

    Written out rather than through `scaled_dot_product_attention`: for the few query rows of
    decode, the CPU flash kernel was 2.3x slower here (672 vs 294 us for 32 sequences), and for
    prefill chunks inside the engine it was slower too (see docs/benchmarks.md).
    """
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = torch.add(bias, scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)
