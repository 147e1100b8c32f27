"""Our bfloat16 GEMM (`torch.ops.infercloud.linear_bf16`) against oneDNN's packed kernel
(`PackedLinear`), on SmolLM2-135M's linear shapes, hot weights, torch's default threads.

    .venv/bin/python benchmarks/linear_kernel.py [--rows 1 8 32 512]

Prints the time per call and GFLOP/s of each, and the largest difference between the two
outputs (they may differ in the last bit: another summation order).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.packed_linear import KernelLinear, PackedLinear

SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "vocab": (49152, 576),
}


def seconds_per_call(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int
) -> float:
    for _ in range(5):
        layer(x)
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    args = parser.parse_args()
    if not (load_kernels() and torch.ops.infercloud.has_linear_bf16()):
        raise SystemExit(f"no AVX512-BF16 linear kernel here: {load_error() or 'CPU lacks it'}")
    print(f"threads {torch.get_num_threads()}")
    for rows in args.rows:
        for name, (out_features, in_features) in SHAPES.items():
            if name == "vocab" and rows > 64:
                continue  # logits are computed for sampled rows only
            weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            onednn, ours = PackedLinear(weight), KernelLinear(weight)
            calls = 20 if name == "vocab" else 200
            t_onednn = seconds_per_call(onednn, x, calls)
            t_ours = seconds_per_call(ours, x, calls)
            flop = 2 * rows * out_features * in_features
            diff = (onednn(x).float() - ours(x).float()).abs().max().item()
            print(
                f"rows {rows:4d} {name:8s} oneDNN {t_onednn * 1e6:8.1f} us "
                f"{flop / t_onednn / 1e9:5.0f} GFLOP/s | ours {t_ours * 1e6:8.1f} us "
                f"{flop / t_ours / 1e9:5.0f} GFLOP/s | max diff {diff:.1e}"
            )


if __name__ == "__main__":
    main()
