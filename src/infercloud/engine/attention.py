"""Attention over a paged KV cache, in plain torch.

Keys and values of every layer live in flat slot arrays `[num_slots, num_kv_heads, head_dim]`
(slot = block_id * block_size + offset). A step writes its new keys and values to their slots,
then each query reads the slots of its own request's block table.

Queries are grouped as the model runner lays them out: all single-token (decode) rows first,
batched into one call, then each multi-token chunk (prefill) with its own causal mask. Grouped-
query attention needs no copies of the KV heads: the query heads that share a KV head are folded
into the query-length axis of `scaled_dot_product_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeBatch:
    """`num_seqs` single-token queries in rows `0 .. num_seqs - 1` of the step."""

    num_seqs: int
    gather_slots: torch.Tensor
    """[num_seqs * max_context] slot indices, padded with slot 0."""
    max_context: int
    mask: torch.Tensor
    """[num_seqs, 1, 1, max_context] bool: True where a key may be attended."""


@dataclass(slots=True)
class PrefillChunk:
    """A chunk of `num_query` tokens in rows `row_start ..` over `context` keys."""

    row_start: int
    num_query: int
    gather_slots: torch.Tensor
    """[context] slots of the request's tokens 0 .. context - 1 (prefix and this chunk)."""
    mask: torch.Tensor
    """[num_query * group, context] bool causal mask, rows repeated per grouped head."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] slot where each new token's key and value are written."""
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


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
    group = num_heads // num_kv_heads
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(num_tokens, num_heads * head_dim)

    decode = meta.decode
    if decode is not None:
        n = decode.num_seqs
        qd = q[:n].view(n, num_kv_heads, group, head_dim)
        kd = k_cache.index_select(0, decode.gather_slots).view(
            n, decode.max_context, num_kv_heads, head_dim
        )
        vd = v_cache.index_select(0, decode.gather_slots).view(
            n, decode.max_context, num_kv_heads, head_dim
        )
        od = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=decode.mask, scale=scale
        )
        out[:n] = od.reshape(n, num_heads * head_dim)

    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_query)
        m = chunk.num_query
        qp = q[rows].view(m, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
        qp = qp.reshape(num_kv_heads, m * group, head_dim)
        kp = k_cache.index_select(0, chunk.gather_slots).transpose(0, 1)
        vp = v_cache.index_select(0, chunk.gather_slots).transpose(0, 1)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale)
        op = op.view(num_kv_heads, m, group, head_dim).permute(1, 0, 2, 3)
        out[rows] = op.reshape(m, num_heads * head_dim)
    return out
