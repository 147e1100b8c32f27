"""Profile decode steps of the builtin engine: 32 sequences of 128 prompt tokens, bfloat16.

Prefills all requests, then runs 10 decode steps under cProfile and prints where time goes.

    .venv/bin/python benchmarks/decode_profile.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from infercloud.engine.llm import LLM
from infercloud.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = LLM("SmolLM2-135M-Instruct", dtype=args.dtype).engine
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), [100 + (i * 7 + j) % 20000 for j in range(128)], params)
    for _ in range(12):  # prefill (4096 tokens at 512 a step) and a few decodes
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(10):
        engine.step()
    profile.disable()
    print(f"decode step: {(time.perf_counter() - start) * 100:.1f} ms")
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
