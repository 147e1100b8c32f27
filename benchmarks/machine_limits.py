"""This machine's memory bandwidth and GEMM rates, the floors a decode step is measured against.

.venv/bin/python benchmarks/machine_limits.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def gemm_gflops(rows: int, dtype: torch.dtype, repeats: int = 20) -> float:
    weight = torch.randn(3072, 576, dtype=dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    for _ in range(3):
        F.linear(x, weight)
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, weight)
    return 2 * rows * 576 * 3072 * repeats / (time.perf_counter() - start) / 1e9


def read_bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    print(f"threads: {torch.get_num_threads()}")
    print(f"memory read bandwidth: {read_bandwidth_gbs():.1f} GB/s")
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (512, 32):
            print(f"GEMM {rows}x576 @ 576x3072 {dtype}: {gemm_gflops(rows, dtype):.0f} GFLOP/s")


if __name__ == "__main__":
    main()
