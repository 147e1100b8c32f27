"""The decode attention kernel alone: 30 layers of 32 sequences at one context length, their
blocks scattered at random over a pool of the engine's default size (1 GiB), as after a while of
serving; `--hot` reuses one layer's keys (in cache) to show the arithmetic's share; `--tiled`
reads the caches as the tiled layout (csrc/kv_layout.h) instead of the plain one.

    .venv/bin/python benchmarks/decode_attention_kernel.py [--context 160] [--hot] [--tiled]
        [--dtype bfloat16|float32] [--tile-unit]
"""

from __future__ import annotations

import argparse
import time

import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK, SEQS = 30, 3, 9, 64, 16, 32  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--hot", action="store_true")
    parser.add_argument("--tiled", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--tile-unit", action="store_true", help="with --tiled: on the AMX tile unit, if present"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    size = dtype.itemsize
    if not load_kernels():
        raise SystemExit(f"CPU kernels unavailable: {load_error()}")
    torch.manual_seed(0)
    num_blocks = (1 << 30) // (LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * size)
    pool = torch.randn(LAYERS, 2, KV_HEADS * num_blocks, BLOCK, HEAD_DIM, dtype=dtype)
    per_seq = -(-args.context // BLOCK)
    tables = torch.randperm(num_blocks)[: SEQS * per_seq].to(torch.int32).view(SEQS, per_seq)
    lens = torch.full((SEQS,), args.context, dtype=torch.int32)
    q = torch.randn(LAYERS, SEQS, HEADS, HEAD_DIM, dtype=dtype)
    op = torch.ops.infercloud.paged_decode_attention

    def step() -> None:
        for layer in range(LAYERS):
            i = 0 if args.hot else layer
            k, v = pool[i, 0], pool[i, 1]
            op(q[i], k, v, tables, lens, HEAD_DIM**-0.5, num_blocks, args.tiled, args.tile_unit)

    step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    kv_bytes = LAYERS * SEQS * args.context * KV_HEADS * HEAD_DIM * 2 * size
    print(
        f"{args.dtype} context {args.context}{' (hot)' if args.hot else ''}"
        f"{' tiled' if args.tiled else ''}{' on tiles' if args.tile_unit else ''}: "
        f"{median * 1e3:.2f} ms per step "
        f"of {LAYERS} layers, {median / LAYERS * 1e6:.0f} us per layer, "
        f"{kv_bytes / median / 1e9:.1f} GB/s of keys and values"
    )


if __name__ == "__main__":
    main()
