"""Which GEMM runs the linear layers on this CPU, chosen by timing both on the model's shapes.

Our bfloat16 GEMM (`KernelLinear`, `vdpbf16ps` on AVX512-BF16) and oneDNN's (`PackedLinear`)
rank differently on different CPUs. On an AMD EPYC with AVX512-BF16 and no AMX, ours was
1.1-2x faster at decode-sized row counts and even at 512 rows. On an Intel Xeon with AMX,
oneDNN runs on the tile unit, and ours, before it had a tile path of its own, was 2-4x slower
at every row count (32-row up-projection: 629 vs 144 us), which took the engine from 449 to
202 output tok/s. With its tile path ours leads there at decode sizes and trails oneDNN at 512
rows on the up-projection. In float32 on an AVX2-only EPYC (Zen 3), ours (`linear_f32`) ran
134-176 GFLOP/s at 32 rows against oneDNN's 97-132, and 183-190 against 151-161 at 512 rows
(`benchmarks/linear_kernel.py --dtype float32`). Instruction-set flags do not settle such races, so
`EngineConfig.linear_kernel="auto"` times both, once, at engine start.

The timing runs on the model's own weights, those of its first `LAYERS_TIMED` layers: enough
that they come from memory or the last-level cache, as a step's weights do (each is read once
per step), not from L2. Timed on SmolLM2's shapes with hot weights instead, oneDNN won on the
Xeon by 6.7 against 7.3 ms while a decode step's linear layers took it 23.6 ms against ours'
16.4. A pass is one sweep of `PREFILL_ROWS` rows through every timed weight plus
`PREFILL_ROWS / DECODE_ROWS` sweeps of `DECODE_ROWS` rows (timed once and counted that many
times): as many prefill rows as decode rows. A path's time is its best of `repeats` passes,
interleaved with the other's, after a warm-up pass of each; about 1 s in all for
SmolLM2-135M on the AMX Xeon (a pass: ~100 ms ours, ~130 ms oneDNN's).

Ours has two ways to multiply bfloat16 where the tile unit does not run: `vdpbf16ps`, and
float32 multiply-adds on the weights widened in registers (`set_linear_bf16_fma`). On the
EPYC, vdpbf16ps issues two a cycle and does twice the work of a multiply-add; on an Intel Xeon
whose AMX is hidden from its VM it issues one every other cycle, so the multiply-adds do
twice as much (70-84 against 151-175 GFLOP/s per core, `benchmarks/isa_throughput.cpp`). With
`fma`, both ways are timed as well, and ours counts at its faster one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packed_linear import KernelLinear, PackedLinear

DECODE_ROWS = 32
PREFILL_ROWS = 512
LAYERS_TIMED = 8

LinearLayer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LinearTimes:
    """Seconds for one pass of the reference mix through each path."""

    kernel_s: float
    """Ours, on vdpbf16ps (or the tile unit, or float32 multiply-adds for float32 weights)."""
    other_s: float
    kernel_fma_s: float | None = None
    """Ours on float32 multiply-adds over bfloat16 weights; None where not timed."""

    @property
    def fma_wins(self) -> bool:
        """Whether ours runs faster on float32 multiply-adds than on vdpbf16ps."""
        return self.kernel_fma_s is not None and self.kernel_fma_s < self.kernel_s

    @property
    def best_kernel_s(self) -> float:
        """Ours at its faster way to multiply."""
        if self.kernel_fma_s is not None and self.fma_wins:
            return self.kernel_fma_s
        return self.kernel_s

    @property
    def kernel_wins(self) -> bool:
        """Ours where it is at least as fast (it also holds each weight once, in one layout)."""
        return self.best_kernel_s <= self.other_s


def _plain(weight: torch.Tensor) -> LinearLayer:
    return lambda x: F.linear(x, weight)


def time_linear_paths(
    weights: Sequence[torch.Tensor],
    packed_other: bool,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = 3,
    fma: bool = False,
) -> LinearTimes:
    """Time our kernel against the other path (oneDNN packed if `packed_other`, else plain
    `F.linear`) on `weights` ([out_features, in_features] each, in the order a step runs them;
    all of one dtype). The caller has loaded the kernels and checked `has_kernel_gemm`. `fma`
    (bfloat16 weights, no tile unit): ours on float32 multiply-adds is timed too; the process's
    `set_linear_bf16_fma` switch is left as it was found."""
    generator = torch.Generator().manual_seed(0)
    dtype = weights[0].dtype
    inputs = {
        in_features: [
            torch.randn(rows, in_features, generator=generator).to(dtype)
            for rows in (PREFILL_ROWS, DECODE_ROWS)
        ]
        for in_features in sorted({w.shape[1] for w in weights})
    }
    kernel: list[LinearLayer] = [KernelLinear(w) for w in weights]
    other: list[LinearLayer] = [PackedLinear(w) if packed_other else _plain(w) for w in weights]
    decode_sweeps = PREFILL_ROWS // DECODE_ROWS

    def sweep(layers: list[LinearLayer], which: int) -> float:
        start = clock()
        for layer, weight in zip(layers, weights, strict=True):
            layer(inputs[weight.shape[1]][which])
        return clock() - start

    def one_pass(layers: list[LinearLayer]) -> float:
        prefill = sweep(layers, 0)
        return prefill + decode_sweeps * sweep(layers, 1)

    def kernel_pass(on_fma: bool) -> float:
        was = torch.ops.infercloud.set_linear_bf16_fma(on_fma)
        try:
            return one_pass(kernel)
        finally:
            torch.ops.infercloud.set_linear_bf16_fma(was)

    paths: dict[str, Callable[[], float]] = {
        "kernel": (lambda: kernel_pass(False)) if fma else (lambda: one_pass(kernel)),
        "other": lambda: one_pass(other),
    }
    if fma:
        paths["kernel_fma"] = lambda: kernel_pass(True)
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for run in paths.values():
            run()
        for _ in range(repeats):  # interleaved, so that a slow phase of the machine hits all
            for name, run in paths.items():
                best[name] = min(best[name], run())
    return LinearTimes(
        kernel_s=best["kernel"], other_s=best["other"], kernel_fma_s=best.get("kernel_fma")
    )
