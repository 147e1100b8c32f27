"""`write_kv_tiled` (csrc/kv_layout.cpp): a step's new keys and values land where the tiled
layout puts them, the same values the plain write puts in [tokens][head_dim] blocks, and a bad
row is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels

from .tiled_kv import tiled_keys, tiled_values

pytestmark = pytest.mark.skipif(not load_kernels(), reason=f"CPU kernels: {load_error()}")

KV_HEADS, NUM_BLOCKS, BLOCK = 3, 20, 16


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_tiled_write_puts_each_value_where_the_plain_write_does(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    shape = (KV_HEADS * NUM_BLOCKS, BLOCK, head_dim)
    k_cache = torch.randn(shape, generator=g).bfloat16()
    v_cache = torch.randn(shape, generator=g).bfloat16()
    tokens = 21
    # k and v as views into a fused projection's output: rows strided, as the engine has them
    qkv = torch.randn(tokens, 5 * KV_HEADS * head_dim, generator=g).bfloat16()
    k = qkv[:, : KV_HEADS * head_dim].view(tokens, KV_HEADS, head_dim)
    v = qkv[:, 2 * KV_HEADS * head_dim : 3 * KV_HEADS * head_dim].view(tokens, KV_HEADS, head_dim)
    rows = torch.randperm(KV_HEADS * NUM_BLOCKS * BLOCK, generator=g)[: KV_HEADS * tokens]
    plain_k, plain_v = k_cache.clone(), v_cache.clone()
    flat = (-1, head_dim)
    plain_k.view(flat).index_copy_(0, rows, k.transpose(0, 1).reshape(flat))
    plain_v.view(flat).index_copy_(0, rows, v.transpose(0, 1).reshape(flat))
    got_k, got_v = tiled_keys(k_cache), tiled_values(v_cache)
    torch.ops.infercloud.write_kv_tiled(got_k, got_v, k, v, rows)
    assert torch.equal(got_k, tiled_keys(plain_k))
    assert torch.equal(got_v, tiled_values(plain_v))


def test_a_row_outside_the_cache_writes_nothing() -> None:
    k_cache = torch.zeros(KV_HEADS * NUM_BLOCKS, BLOCK, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(2, KV_HEADS, 64, dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, 2, 3, 4, KV_HEADS * NUM_BLOCKS * BLOCK], dtype=torch.long)
    with pytest.raises(RuntimeError, match="write row"):
        torch.ops.infercloud.write_kv_tiled(k_cache, v_cache, k, k, rows)
    assert not k_cache.any() and not v_cache.any()
