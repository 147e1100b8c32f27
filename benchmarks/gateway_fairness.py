"""Fairness under a flood (issue 4's goal): a light tenant's p99 time to first token while
another tenant keeps 10x the replica's capacity outstanding, against its own p99 unloaded.

`infercloud serve` in front of one builtin replica (8 slots: `max_inflight_per_replica: 8`),
tenants `flood` and `light` of equal weight, SQLite in a temporary data directory. Each round:
  1. unloaded: the light tenant sends N streamed requests ("ping", 4 tokens), one at a time,
     `--interval-s` apart; its TTFT is the time to the first `data: {` event, at the client;
  2. loaded: a client process at nice 10 keeps 80 requests of 128 tokens outstanding for the
     flood tenant (10x the 8 slots), and 2 s later the light tenant sends N more.
Reports each phase's median and p99 (the value at rank int(0.99 N) of the sorted TTFTs), the
ratio of the p99s per round (the goal: at most 2), and the flood's median wait for admission
from the usage records. The light tenant's and the flood's clients are those of
`tests/gateway/test_platform.py::test_a_flood_does_not_starve_a_light_tenant`, which checks the
structural property (the light tenant goes past the flood's backlog) in CI.

    .venv/bin/python benchmarks/gateway_fairness.py [--model tiny|default|PATH] [--rounds 3]
        [--requests 300] [--interval-s 0.03] [--out F]

The issue says one light request per second; `--interval-s 1 --requests 120` runs that (p99 is
then the second slowest of 120, about 4 minutes a phase).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import EngineServer  # noqa: E402
from tests.gateway.test_platform import FLOOD, light_ttfts_ms, p99  # noqa: E402


def model_dir(name: str, work: Path) -> tuple[Path, str]:
    """The model folder and the dtype to serve it in: `tiny` is the test suite's random-weight
    Llama (float32, as in the test); `default` the embedded SmolLM2-135M-Instruct (auto)."""
    if name == "tiny":
        from infercloud.models.tiny import build_tiny_llama

        return build_tiny_llama(work / "tiny-llama"), "float32"
    if name == "default":
        from infercloud.models.registry import prepare_default_model

        return prepare_default_model(), "auto"
    return Path(name), "auto"


def cli(data: Path, *args: str) -> Any:
    """`infercloud ARGS --json --data-dir DATA`, its output parsed."""
    cmd = [sys.executable, "-m", "infercloud", *args, "--json", "--data-dir", str(data)]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def make_key(data: Path, tenant: str) -> str:
    return str(cli(data, "keys", "create", "--tenant", tenant)["key"])


def flood_waits_ms(data: Path, since_s: float) -> list[float]:
    return [
        float(r["queue_ms"])
        for r in cli(data, "usage", "--tenant", "flood")
        if r["queue_ms"] is not None and float(r["created_at_s"]) >= since_s
    ]


def phase(ttfts_ms: list[float]) -> dict[str, float]:
    return {
        "requests": len(ttfts_ms),
        "median_ttft_ms": round(statistics.median(ttfts_ms), 2),
        "p99_ttft_ms": round(p99(ttfts_ms), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", help="tiny, default or a model folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="light requests per phase")
    parser.add_argument("--interval-s", type=float, default=0.03)
    parser.add_argument("--threads", type=int, default=1, help="the replica's torch threads")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gateway_fairness.json"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gateway-fairness-"))
    path, dtype = model_dir(args.model, work)
    config = work / "deploy.yaml"
    config.write_text(
        "models:\n"
        "  - name: m\n"
        "    max_inflight_per_replica: 8\n"
        "    replicas:\n"
        f"      - builtin: {{model: '{path}', dtype: {dtype}, kv_cache_bytes: 64MiB, "
        f"threads: {args.threads}}}\n"
        "tenants:\n"
        "  flood: {weight: 1}\n"
        "  light: {weight: 1}\n"
        "gateway: {max_queued: 2000, queue_timeout_s: 120}\n"
    )
    data = work / "data"
    flood_key, light_key = make_key(data, "flood"), make_key(data, "light")
    server = EngineServer(
        ["--config", str(config), "--data-dir", str(data)], command="serve", timeout_s=300
    )
    rounds: list[dict[str, Any]] = []
    try:
        url = server.base_url
        light_ttfts_ms(url, light_key, 10, 0.05, model="m")  # warm up
        for i in range(args.rounds):
            unloaded = light_ttfts_ms(url, light_key, args.requests, args.interval_s, model="m")
            since_s = time.time()
            flood = subprocess.Popen(
                [sys.executable, "-c", FLOOD, url, flood_key, "80", "m"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                time.sleep(2.0)  # the backlog builds up
                loaded = light_ttfts_ms(url, light_key, args.requests, args.interval_s, model="m")
            finally:
                flood_sent = int(flood.communicate("", timeout=300)[0] or 0)
            waits = flood_waits_ms(data, since_s)
            row = {
                "round": i + 1,
                "unloaded": phase(unloaded),
                "loaded": phase(loaded),
                "p99_ratio": round(p99(loaded) / p99(unloaded), 3),
                "flood_requests": flood_sent,
                "flood_median_wait_ms": round(statistics.median(waits), 1),
            }
            rounds.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(3.0)  # the flood's last requests drain
    finally:
        server.stop()
    ratios = [r["p99_ratio"] for r in rounds]
    result = {
        "model": args.model,
        "dtype": dtype,
        "threads": args.threads,
        "requests_per_phase": args.requests,
        "interval_s": args.interval_s,
        "rounds": rounds,
        "p99_ratio_median": round(statistics.median(ratios), 3),
        "p99_ratio_max": max(ratios),
        "rounds_within_2x": sum(r <= 2.0 for r in ratios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
