"""Prefix caching: eviction policies on a real trace, and the real engine with caching off vs on.

(a) Replays ../shared/traces/mooncake_synthetic.jsonl through the real prefix cache at 5%, 10%
    and 25% of the trace's unique blocks with the LRU, value-aware and Belady policies (the same
    code as `infercloud cache-replay`), and reports token hit rates and the share of the gap
    between LRU and Belady that the value-aware policy closes.
(b) Serves SmolLM2-135M (bfloat16) with `infercloud engine` twice, prefix caching off and on, and
    replays an agent-like workload over HTTP: one 1536-token system prompt with tool definitions
    shared by every request, a unique 100-200 token suffix each (about 90% of the prompt
    shared), 32 output tokens, Poisson arrivals. Reports mean / p99 TTFT, throughput and the
    engine's own prefix-cache hit counters.
(c) The second tier under memory pressure: six agents, each with its own 1536-token system
    prompt, requests spread uniformly over them; the device pool (`--kv-cache-bytes 100MiB`,
    about 4,300 tokens) holds fewer than three of the prompts. Caching on both times, the host
    tier off vs on (`--host-cache-bytes 512MiB`, room for all six): mean / p99 TTFT, throughput,
    and hits per tier.
(d) Demand the engine can see: the six agents of (c) at 0.6 requests/s, near what the engine
    serves, so that requests queue at times, while the pool (`--demand-pool 400MiB`: about
    9,100 tokens in float32, 5.4 of the prompts; no host tier) holds fewer prompts than there
    are agents. Eviction policy LRU vs value-aware (which keeps first the blocks that a queued
    request will match, `KVCacheManager.note_waiting`), alternating for `--demand-rounds`:
    mean / p99 TTFT, throughput, hit rate.
(admission) The workload of (d) with value-aware eviction, admission FCFS vs CACHE
    (`--scheduling-policy cache`: of the first 16 waiting, the longest cached prefix first).

    .venv/bin/python benchmarks/prefix_cache.py [--parts policies,caching,tier,demand,admission]
        [--dtype auto|float32|bfloat16] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Req, Server, replay
from infercloud.cache.replay import load_mooncake, unique_blocks
from infercloud.cache.replay import replay as replay_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"


def policies_on_trace(trace: Path) -> list[dict[str, object]]:
    requests = load_mooncake(trace)
    unique = unique_blocks(requests)
    rows: list[dict[str, object]] = []
    for share in (0.05, 0.10, 0.25):
        capacity = int(unique * share)
        rates = {
            p: replay_trace(requests, capacity, p).to_json() for p in ("lru", "value", "belady")
        }
        lru, value, belady = (
            float(rates[p]["hit_rate_tokens"]) for p in ("lru", "value", "belady")
        )  # type: ignore[arg-type]
        gap = belady - lru
        row = {
            "capacity_share": share,
            "capacity_blocks": capacity,
            "hit_rate_tokens": {"lru": lru, "value": value, "belady": belady},
            "compute_saved": {p: rates[p]["compute_saved"] for p in rates},
            "gap_closed_by_value": (value - lru) / gap if gap > 0 else 0.0,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def agent_workload(vocab: int, n: int, rate_per_s: float, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab - 100) for _ in range(1536)]
    t, reqs = 0.0, []
    for _ in range(n):
        suffix = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(100, 200))]
        reqs.append(Req(system + suffix, 32, t))
        t += rng.expovariate(rate_per_s)
    return reqs


def multi_agent_workload(
    vocab: int, n: int, rate_per_s: float, agents: int, seed: int = 0
) -> list[Req]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab - 100) for _ in range(1536)] for _ in range(agents)]
    t, reqs = 0.0, []
    for _ in range(n):
        suffix = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(100, 200))]
        reqs.append(Req(rng.choice(systems) + suffix, 32, t))
        t += rng.expovariate(rate_per_s)
    return reqs


def cache_counters(url: str, tier: str = "device") -> tuple[float, float]:
    hits = queries = 0.0
    label = f'tier="{tier}"'
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("infercloud:prefix_cache_hits_total{") and label in line:
            hits = float(line.rsplit(" ", 1)[1])
        elif line.startswith("infercloud:prefix_cache_queries_total{") and label in line:
            queries = float(line.rsplit(" ", 1)[1])
    return hits, queries


DTYPE = "auto"
"""The engine's `--dtype` (main sets it): auto is bfloat16 where the CPU computes it natively
(AVX512-BF16 or AMX), float32 elsewhere."""


def run_engine(label: str, extra: list[str], reqs: list[Req]) -> dict[str, float]:
    """Start `infercloud engine` with `extra` flags, replay `reqs`, stop it."""
    from infercloud.models.registry import prepare_default_model

    model_dir = prepare_default_model()
    logs = ROOT / "benchmarks" / "results"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "infercloud", "engine", "--model", str(model_dir)]
    cmd += ["--dtype", DTYPE, "--port", "8203", "--served-model-name", "m"]
    cmd += ["--log-level", "warning", *extra]
    server = Server(cmd, 8203, {}, logs / f"prefix_cache_{label}.log", 300.0)
    try:
        before = {t: cache_counters(server.url, t) for t in ("device", "host")}
        result = asyncio.run(replay(server.url, "m", reqs))
        for tier in ("device", "host"):
            hits, queries = cache_counters(server.url, tier)
            h0, q0 = before[tier]
            result[f"hit_tokens_{tier}"] = hits - h0
            result[f"query_tokens_{tier}"] = queries - q0
        device_queries = result["query_tokens_device"]
        result["engine_hit_rate_tokens"] = (
            (result["hit_tokens_device"] + result["hit_tokens_host"]) / device_queries
            if device_queries
            else 0.0
        )
    finally:
        server.stop()
    keys = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")
    shown = {k: round(result[k], 1) for k in keys}
    shown["hit_rate"] = round(result["engine_hit_rate_tokens"], 3)
    print(label, json.dumps(shown), flush=True)
    return result


def ratios(off: dict[str, float], on: dict[str, float]) -> dict[str, float]:
    return {
        "mean_ttft_off_over_on": off["mean_ttft_ms"] / on["mean_ttft_ms"],
        "p99_ttft_off_over_on": off["p99_ttft_ms"] / on["p99_ttft_ms"],
        "throughput_on_over_off": on["output_throughput"] / off["output_throughput"],
    }


def tier_on_off(n: int, rate_per_s: float) -> dict[str, dict[str, float]]:
    reqs = multi_agent_workload(49152, n, rate_per_s, agents=6)
    pool = ["--kv-cache-bytes", "100MiB"]
    out = {
        "host_tier_off": run_engine("host_tier_off", pool, reqs),
        "host_tier_on": run_engine("host_tier_on", [*pool, "--host-cache-bytes", "512MiB"], reqs),
    }
    out["ratios"] = ratios(out["host_tier_off"], out["host_tier_on"])
    print(json.dumps(out["ratios"]), flush=True)
    return out


def alternating(
    label: str,
    variants: dict[str, list[str]],
    reqs: list[Req],
    rounds: int,
    first: str,
) -> dict[str, list[dict[str, float]] | dict[str, float]]:
    """Two engine configurations (name -> extra flags), alternating for `rounds` rounds (the
    machine drifts between runs of minutes): `first` first in the first round, the order
    flipped each round. Ratios of the medians (mean and p99 TTFT of the first variant over
    the second's, throughput of the second over the first's)."""
    a, b = list(variants)
    order = [first, b if first == a else a]
    runs: dict[str, list[dict[str, float]]] = {a: [], b: []}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            runs[name].append(run_engine(f"{label}_{name}_{r}", variants[name], reqs))

    def median(name: str, key: str) -> float:
        return float(statistics.median(run[key] for run in runs[name]))

    ratios = {
        f"mean_ttft_{a}_over_{b}": median(a, "mean_ttft_ms") / median(b, "mean_ttft_ms"),
        f"p99_ttft_{a}_over_{b}": median(a, "p99_ttft_ms") / median(b, "p99_ttft_ms"),
        f"throughput_{b}_over_{a}": median(b, "output_throughput") / median(a, "output_throughput"),
    }
    print(json.dumps(ratios), flush=True)
    return {**runs, "ratios": ratios}


def demand_lru_vs_value(
    n: int, rate_per_s: float, pool: str, rounds: int, first: str
) -> dict[str, list[dict[str, float]] | dict[str, float]]:
    """Eviction LRU vs value-aware (which reads the queue's demand), FCFS admission."""
    reqs = multi_agent_workload(49152, n, rate_per_s, agents=6, seed=1)
    flags = ["--kv-cache-bytes", pool, "--eviction-policy"]
    variants = {p: [*flags, p] for p in ("lru", "value")}
    return alternating("demand", variants, reqs, rounds, first)


def admission_fcfs_vs_cache(
    n: int, rate_per_s: float, pool: str, rounds: int
) -> dict[str, list[dict[str, float]] | dict[str, float]]:
    """Admission FCFS vs CACHE (longest cached prefix first), value-aware eviction both."""
    reqs = multi_agent_workload(49152, n, rate_per_s, agents=6, seed=1)
    flags = ["--kv-cache-bytes", pool, "--eviction-policy", "value", "--scheduling-policy"]
    variants = {p: [*flags, p] for p in ("fcfs", "cache")}
    return alternating("admission", variants, reqs, rounds, "fcfs")


def engine_on_off(n: int, rate_per_s: float) -> dict[str, dict[str, float]]:
    reqs = agent_workload(49152, n, rate_per_s)
    out = {
        "caching_off": run_engine("caching_off", ["--no-enable-prefix-caching"], reqs),
        "caching_on": run_engine("caching_on", [], reqs),
    }
    out["ratios"] = ratios(out["caching_off"], out["caching_on"])
    print(json.dumps(out["ratios"]), flush=True)
    return out


def main() -> None:
    global DTYPE
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--parts", default="policies,caching,tier")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (caching)")
    parser.add_argument("--tier-requests", type=int, default=40)
    parser.add_argument("--tier-rate", type=float, default=0.2, help="requests per second (tier)")
    parser.add_argument("--demand-requests", type=int, default=48)
    parser.add_argument("--demand-rate", type=float, default=0.6, help="requests per second")
    parser.add_argument("--demand-pool", default="400MiB", help="device KV pool (demand)")
    parser.add_argument("--demand-rounds", type=int, default=2)
    parser.add_argument("--demand-first", default="lru", choices=["lru", "value"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_cache.json"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    DTYPE = args.dtype
    report: dict[str, object] = {}
    if "policies" in parts:
        report["policies"] = policies_on_trace(args.trace)
    if "caching" in parts:
        report["engine"] = engine_on_off(args.requests, args.rate)
    if "tier" in parts:
        report["host_tier"] = tier_on_off(args.tier_requests, args.tier_rate)
    if "admission" in parts:
        report["admission"] = admission_fcfs_vs_cache(
            args.demand_requests, args.demand_rate, args.demand_pool, args.demand_rounds
        )
    if "demand" in parts:
        report["demand"] = demand_lru_vs_value(
            args.demand_requests,
            args.demand_rate,
            args.demand_pool,
            args.demand_rounds,
            args.demand_first,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
