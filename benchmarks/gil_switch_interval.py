"""A/B of the engine server's GIL switch interval on the anchor workload, over HTTP.

`infercloud engine` sets `sys.setswitchinterval(0.0005)`; each variant here starts the same
server with another interval pinned (the server's own call is made a no-op), alternating the
variants, 3 anchor rounds (32 x (128 + 64), fresh prompts) per server start, `--repeats` times.

    .venv/bin/python benchmarks/gil_switch_interval.py [--intervals-ms 5 0.5 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from engine_throughput import Server, anchor_workload, replay
from infercloud.models.registry import prepare_default_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8301)
    args = parser.parse_args()
    model = str(prepare_default_model())
    results: dict[float, list[float]] = {ms: [] for ms in args.intervals_ms}
    seed = 1
    for _ in range(args.repeats):
        for ms in args.intervals_ms:
            engine_argv = ["infercloud", "engine", "--model", model, "--dtype", "bfloat16"]
            engine_argv += ["--port", str(args.port), "--served-model-name", "m"]
            engine_argv += ["--log-level", "warning"]
            code = (
                f"import sys; sys.setswitchinterval({ms / 1000!r}); "
                "sys.setswitchinterval = lambda _s: None; "
                f"sys.argv = {engine_argv!r}; "
                "from infercloud.cli import main; main()"
            )
            log = Path("/tmp") / f"gil_switch_{ms}.log"
            server = Server([sys.executable, "-c", code], args.port, {}, log, 300.0)
            try:
                for r in range(3):
                    reqs = anchor_workload(49152, seed=seed + r)
                    out = asyncio.run(replay(server.url, "m", reqs))
                    results[ms].append(out["output_throughput"])
            finally:
                server.stop()
        seed += 3
    for ms, rounds in results.items():
        shown = ", ".join(f"{x:.1f}" for x in rounds)
        print(f"switch interval {ms} ms: median {statistics.median(rounds):.1f} tok/s ({shown})")


if __name__ == "__main__":
    main()
