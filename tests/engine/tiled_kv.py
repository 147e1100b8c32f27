"""Plain KV blocks ([block rows, 16 tokens, head_dim]) rearranged into the tiled layout of
`csrc/kv_layout.h`, written independently of the C++ code, for the tests that compare the two."""

from __future__ import annotations

import torch


def tiled_keys(plain: torch.Tensor) -> torch.Tensor:
    """Each block as [head_dim / 2][16 tokens][2]: one dimension pair of all 16 tokens."""
    rows, block, head_dim = plain.shape
    pairs = plain.view(rows, block, head_dim // 2, 2).permute(0, 2, 1, 3)
    return pairs.contiguous().view(rows, block, head_dim)


def tiled_values(plain: torch.Tensor) -> torch.Tensor:
    """Each block as [8 token pairs][head_dim][2]: two consecutive tokens' values per dim."""
    rows, block, head_dim = plain.shape
    pairs = plain.view(rows, block // 2, 2, head_dim).permute(0, 1, 3, 2)
    return pairs.contiguous().view(rows, block, head_dim)
