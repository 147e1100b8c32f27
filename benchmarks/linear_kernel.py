"""Our GEMM (`torch.ops.infercloud.linear_bf16`, or `linear_f32` with `--dtype float32`) against
oneDNN's packed kernel (`PackedLinear`), on SmolLM2-135M's linear shapes, torch's default threads.

    .venv/bin/python benchmarks/linear_kernel.py [--dtype bfloat16|float32] [--rows 1 8 32 512]
        [--stream] [--fma]

Prints the time per call and GFLOP/s of each, and the largest difference between the two
outputs (they may differ in the last bit: another summation order). Ours runs on the AMX tile
unit where the CPU has one; `--no-tiles` keeps it on vdpbf16ps; `--fma` runs bfloat16 weights on
float32 multiply-adds (the path the engine picks where vdpbf16ps is slow). Weights are hot in
cache, except with `--stream`: then each path runs a decode step's worth of linear layers (30
layers of four projections and the vocabulary projection, each weight once, about 270 MB), as
a decode step reads them from memory, and the time per step is printed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.host_allocator import keep_freed_memory
from infercloud.engine.packed_linear import KernelLinear, PackedLinear, has_kernel_gemm

SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "vocab": (49152, 576),
}
LAYERS = 30


def _step_shapes() -> list[tuple[int, int]]:
    """The projections a decode step runs, in order: each layer's four, then the vocabulary."""
    layer = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    return layer * LAYERS + [SHAPES["vocab"]]


def seconds_per_call(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int
) -> float:
    for _ in range(5):
        layer(x)
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls


def seconds_per_step(
    layers: list[Callable[[torch.Tensor], torch.Tensor]], rows: int, dtype: torch.dtype
) -> float:
    """Best of 10 passes through `layers` (each weight read once), after 3 warm-up passes."""
    shapes = _step_shapes()
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {s[1] for s in shapes}}

    def one_pass() -> float:
        start = time.perf_counter()
        for layer, (_, in_features) in zip(layers, shapes, strict=True):
            layer(inputs[in_features])
        return time.perf_counter() - start

    for _ in range(3):
        one_pass()
    return min(one_pass() for _ in range(10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--no-tiles", dest="tiles", action="store_false")
    parser.add_argument("--stream", action="store_true", help="a decode step's weights, cold")
    parser.add_argument(
        "--fma",
        action="store_true",
        help="bfloat16 weights on float32 multiply-adds (the path for CPUs with a slow vdpbf16ps)",
    )
    args = parser.parse_args()
    keep_freed_memory()  # as the engine does: no fresh pages for every call's buffers
    dtype = getattr(torch, args.dtype)
    if not (load_kernels() and has_kernel_gemm(dtype)):
        raise SystemExit(f"no {args.dtype} GEMM of ours here: {load_error() or 'CPU lacks it'}")
    tiles = args.tiles and dtype == torch.bfloat16 and bool(torch.ops.infercloud.has_linear_tiles())
    fma = args.fma and dtype == torch.bfloat16 and not tiles
    if fma:  # (the switch exists only where the CPU has AVX512-BF16)
        torch.ops.infercloud.set_linear_bf16_fma(True)
    path = "AMX tiles" if tiles else "vdpbf16ps" if dtype == torch.bfloat16 and not fma else "FMA"
    print(f"threads {torch.get_num_threads()}, {args.dtype}, ours on {path}")
    if args.stream:
        weights = [torch.randn(shape, dtype=dtype) * 0.02 for shape in _step_shapes()]
        megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
        for rows in args.rows:
            for name in ("oneDNN", "ours"):
                layers: list[Callable[[torch.Tensor], torch.Tensor]] = [
                    KernelLinear(w, use_tiles=args.tiles) if name == "ours" else PackedLinear(w)
                    for w in weights
                ]
                with torch.inference_mode():
                    seconds = seconds_per_step(layers, rows, dtype)
                print(
                    f"rows {rows:4d} decode step's linear layers ({megabytes:.0f} MB) {name:6s} "
                    f"{seconds * 1e3:6.2f} ms, {megabytes / 1e3 / seconds:5.1f} GB/s"
                )
        return
    for rows in args.rows:
        for name, (out_features, in_features) in SHAPES.items():
            if name == "vocab" and rows > 64:
                continue  # logits are computed for sampled rows only
            weight = torch.randn(out_features, in_features, dtype=dtype) * 0.02
            x = torch.randn(rows, in_features, dtype=dtype)
            onednn, ours = PackedLinear(weight), KernelLinear(weight, use_tiles=args.tiles)
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
