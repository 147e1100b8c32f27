"""Profile decode steps of the builtin engine: 32 sequences of 128 prompt tokens, bfloat16.

Prefills all requests, then runs 10 decode steps under cProfile and prints where time goes.

    .venv/bin/python benchmarks/decode_profile.py [--dtype bfloat16] [--decode-attention torch]
        [--linear-kernel onednn] [--no-attention-tiles] [--torch-profiler] [--sort cumtime]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from infercloud.engine.llm import LLM
from infercloud.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decode-attention", default="auto", choices=["auto", "kernel", "torch"])
    parser.add_argument("--no-fused-layer-ops", dest="fused_layer_ops", action="store_false")
    parser.add_argument("--linear-kernel", default="auto", choices=["auto", "kernel", "onednn"])
    parser.add_argument("--prefill-attention", default="auto", choices=["auto", "kernel", "torch"])
    parser.add_argument(
        "--no-attention-tiles",
        dest="attention_tiles",
        action="store_false",
        help="both attention kernels on vdpbf16ps even where the AMX tile unit is",
    )
    parser.add_argument(
        "--torch-profiler", action="store_true", help="torch.profiler's table instead of cProfile"
    )
    parser.add_argument("--sort", default="tottime", help="cProfile's sort key (tottime, cumtime)")
    args = parser.parse_args()
    llm = LLM(
        "SmolLM2-135M-Instruct",
        dtype=args.dtype,
        decode_attention=args.decode_attention,
        fused_layer_ops=args.fused_layer_ops,
        linear_kernel=args.linear_kernel,
        prefill_attention=args.prefill_attention,
        attention_tiles=args.attention_tiles,
    )
    engine = llm.engine
    print(
        f"decode attention: {'kernel' if engine.decode_kernel else 'torch'}, "
        f"fused layer ops: {engine.fused_ops}, linear kernel: {engine.linear_kernel}, "
        f"attention on the tile unit: {engine.attention_tiles}"
    )
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), [100 + (i * 7 + j) % 20000 for j in range(128)], params)
    for _ in range(12):  # prefill (4096 tokens at 512 a step) and a few decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    print(f"decode step (unprofiled): {(time.perf_counter() - start) * 100:.1f} ms")
    if args.torch_profiler:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(10):
        engine.step()
    profile.disable()
    print(f"decode step: {(time.perf_counter() - start) * 100:.1f} ms")
    pstats.Stats(profile).sort_stats(args.sort).print_stats(25)


if __name__ == "__main__":
    main()
