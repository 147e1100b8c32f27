"""Linear layers with their weights pre-packed in oneDNN's blocked layout, for the CPU.

`F.linear` on the CPU reorders a plain row-major weight into the layout its GEMM kernel wants on
every call. Packing each weight once, at load time, skips that work: measured here (2 cores,
bfloat16) a decode step's up-projection (32 x 576 @ 576 x 3072) took 298 us packed against
498 us plain, the vocabulary projection 6.2 ms against 10.2 ms, and prefill-sized calls (512
rows) about 10% less. bfloat16 results are bit-identical to `F.linear`; float32 ones differ in
the last bits (another summation order), as between any two BLAS builds.

The packed tensor is opaque (`torch._mkldnn` layout): it replaces the plain weight, so the model
holds each weight once, except a vocabulary projection tied to the embeddings: the embedding
lookup keeps the plain table, so that one is held twice (57 MB more for SmolLM2 in bfloat16).
Used only where torch has oneDNN and the weights live on the CPU.

`KernelLinear` is the same idea with our own GEMM (`csrc/linear_bf16.cpp`: bfloat16 weights,
CPUs with AVX512-BF16). oneDNN's kernel is tuned for large row counts; a decode step has one row
per running request. Measured here (2 cores, 32 rows): the up-projection 137 -> 117 us, the
qkv projection 56 -> 39 us, the down projection 83 -> 59 us; at 512 rows both run at about
1 TFLOP/s. Outputs can differ from oneDNN's in the last bit (another summation order). On a
CPU with AMX, ours runs on the tile unit too (same packed layout): measured on an Intel Xeon
with AMX (2 cores), the linear layers of a 32-row decode step, weights streamed from memory,
took 16.4 ms against oneDNN's 23.6 (our vdpbf16ps path: 56.6; `benchmarks/linear_kernel.py
--stream`). `linear_choice.py` times ours
against oneDNN at engine start and keeps the faster.
"""

from __future__ import annotations

import functools
from typing import TypeGuard

import torch
from torch import nn

PACK_FOR_ROWS = 32
"""The row count the packed layout is tuned for (a hint: any row count works)."""


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` here: it needs AVX-512 (or AVX-NE-CONVERT) for
    bfloat16, which some x86 CPUs (AVX2-only ones) lack; there the plain layers stay."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 8, dtype=dtype), packed, None, "none", [], ""
        )
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """y = x W^T (no bias), with W packed once; x is [rows, in_features]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight: torch.Tensor
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return out  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class KernelLinear(nn.Module):
    """y = x W^T (no bias) through our own GEMM, W packed once: `linear_bf16` for bfloat16
    weights, `linear_f32` for float32 ones; x has the weight's dtype, [rows, in_features]. The
    caller has loaded the kernels (`cpu_kernels.load_kernels()`) and checked `has_kernel_gemm`.
    `use_tiles`: the AMX tile path where this CPU has it and in_features is a multiple of 32
    (else vdpbf16ps); bfloat16 only."""

    def __init__(self, weight: torch.Tensor, use_tiles: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.float32 = weight.dtype == torch.float32
        self.use_tiles = use_tiles and not self.float32
        self.packed_weight: torch.Tensor
        pack = (
            torch.ops.infercloud.pack_linear_f32
            if self.float32
            else (torch.ops.infercloud.pack_linear_bf16)
        )
        self.register_buffer("packed_weight", pack(weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # a view for the engine's 2-d inputs
        if self.float32:
            out = torch.ops.infercloud.linear_f32(rows, self.packed_weight, self.out_features)
        else:
            out = torch.ops.infercloud.linear_bf16(
                rows, self.packed_weight, self.out_features, self.use_tiles
            )
        return out.view(*x.shape[:-1], self.out_features)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        path = "kernel, tiles" if self.use_tiles else "kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, {path}"


class KernelGateUpSilu(nn.Module):
    """An MLP's gate and up projections and its SiLU in one call of our GEMM
    (`linear_silu_bf16`): x [rows, in_features] -> silu(x Wg^T) * (x Wu^T) [rows,
    intermediate_size], the same bits as `silu_and_mul` of the `KernelLinear` it replaces. Made
    from that layer (bfloat16, [gate; up] stacked, intermediate_size a multiple of 16): its
    packed tiles are reordered (gate 0, up 0, gate 1, ...) so that each 32-column group of the
    GEMM holds one gate tile and its up tile, and the [rows, 2 x intermediate_size] product is
    never stored. Measured on the AMX Xeon (2 cores, SmolLM2-135M's 576 -> 2 x 1536): 512 rows
    1,101 -> 851 us, 32 rows 92 -> 78 us."""

    @staticmethod
    def fits(gate_up: nn.Module) -> TypeGuard[KernelLinear]:
        """Whether `gate_up` can be fused: a bfloat16 `KernelLinear` whose gate and up halves
        are whole 16-column tiles."""
        return (
            isinstance(gate_up, KernelLinear)
            and not gate_up.float32
            and gate_up.out_features % 32 == 0
        )

    def __init__(self, gate_up: KernelLinear) -> None:
        super().__init__()
        if not self.fits(gate_up):
            raise ValueError("KernelGateUpSilu needs a bfloat16 [gate; up] of 16-column tiles")
        self.in_features = gate_up.in_features
        self.intermediate_size = gate_up.out_features // 2
        self.use_tiles = gate_up.use_tiles
        self.packed_weight: torch.Tensor
        packed = torch.ops.infercloud.interleave_gate_up(gate_up.packed_weight)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.infercloud.linear_silu_bf16(
            rows, self.packed_weight, self.intermediate_size, self.use_tiles
        )
        return out.view(*x.shape[:-1], self.intermediate_size)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        path = "kernel, tiles" if self.use_tiles else "kernel"
        return (
            f"in_features={self.in_features}, intermediate_size={self.intermediate_size}, "
            f"silu(gate) * up, {path}"
        )


def has_kernel_gemm(dtype: torch.dtype) -> bool:
    """Whether our GEMM runs `dtype` on this CPU: bfloat16 with AVX512-BF16, float32 with AVX2
    (and FMA) or AVX-512. The caller has loaded the kernels."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.infercloud.has_linear_bf16())
    if dtype == torch.float32:
        return bool(torch.ops.infercloud.has_linear_f32())
    return False


def pack_linears(module: nn.Module, kernel: bool = False) -> int:
    """Replace every bias-free `nn.Linear` below `module` by a `PackedLinear` (oneDNN), or with
    `kernel` by a `KernelLinear` (ours); returns the count."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            layer = KernelLinear(child.weight) if kernel else PackedLinear(child.weight)
            setattr(module, name, layer)
            count += 1
        else:
            count += pack_linears(child, kernel)
    return count
