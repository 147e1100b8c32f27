"""Which GEMM runs the linear layers on this CPU, chosen by timing both on the model's shapes.

Our bfloat16 GEMM (`KernelLinear`, `vdpbf16ps` on AVX512-BF16) and oneDNN's (`PackedLinear`)
rank differently on different CPUs. On an AMD EPYC with AVX512-BF16 and no AMX, ours was
1.1-2x faster at decode-sized row counts and even at 512 rows. On an Intel Xeon with AMX,
oneDNN runs on the tile unit, and ours, before it had a tile path of its own, was 2-4x slower
at every row count (32-row up-projection: 629 vs 144 us), which took the engine from 449 to
202 output tok/s. With its tile path ours leads there at decode sizes and trails oneDNN at 512
rows on the up-projection. Instruction-set flags do not settle such races, so
`EngineConfig.linear_kernel="auto"` times both, once, at engine start.

The reference mix has as many prefill rows as decode rows: one call of `PREFILL_ROWS` rows
plus `PREFILL_ROWS / DECODE_ROWS` calls of `DECODE_ROWS` rows, through each of a layer's four
projections (qkv, o, gate_up, down). A path's time is the best of `repeats` passes after one
warm-up pass, weights hot in cache. That is about 20-40 ms per pass for SmolLM2-135M.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model_config import ModelConfig
from .packed_linear import KernelLinear, PackedLinear

DECODE_ROWS = 32
PREFILL_ROWS = 512

LinearLayer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LinearTimes:
    """Seconds for one pass of the reference mix through each path."""

    kernel_s: float
    other_s: float

    @property
    def kernel_wins(self) -> bool:
        """Ours where it is at least as fast (it also holds each weight once, in one layout)."""
        return self.kernel_s <= self.other_s


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's projections."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (inter, hidden)]


def _plain(weight: torch.Tensor) -> LinearLayer:
    return lambda x: F.linear(x, weight)


def time_linear_paths(
    shapes: list[tuple[int, int]],
    packed_other: bool,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = 3,
) -> LinearTimes:
    """Time our kernel against the other path (oneDNN packed if `packed_other`, else plain
    `F.linear`) on bfloat16 weights of `shapes`. The caller has loaded the kernels and checked
    `has_linear_bf16()`."""
    generator = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) for shape in shapes
    ]
    inputs = [
        (torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16), calls)
        for shape in shapes
        for rows, calls in ((PREFILL_ROWS, 1), (DECODE_ROWS, PREFILL_ROWS // DECODE_ROWS))
    ]
    kernel: list[LinearLayer] = [KernelLinear(w) for w in weights]
    other: list[LinearLayer] = [PackedLinear(w) if packed_other else _plain(w) for w in weights]

    def one_pass(layers: list[LinearLayer]) -> float:
        start = clock()
        for i, (x, calls) in enumerate(inputs):
            layer = layers[i // 2]
            for _ in range(calls):
                layer(x)
        return clock() - start

    best = {"kernel": float("inf"), "other": float("inf")}
    with torch.inference_mode():
        one_pass(kernel)
        one_pass(other)
        for _ in range(repeats):  # interleaved, so that a slow phase of the machine hits both
            best["kernel"] = min(best["kernel"], one_pass(kernel))
            best["other"] = min(best["other"], one_pass(other))
    return LinearTimes(kernel_s=best["kernel"], other_s=best["other"])
