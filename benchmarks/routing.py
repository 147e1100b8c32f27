"""Cache-aware routing: round_robin vs least_outstanding vs kv_aware over real replicas.

For each policy, one run of `infercloud serve` with N builtin replicas of SmolLM2-135M-Instruct
(dtype auto, the machine's cores divided among them, a small KV pool each so that no replica
can hold every tenant's prefix), then a multi-tenant workload through the gateway: T tenants,
each with its own API key (so its own cache salt) and its own long system prompt, a unique
suffix per request, Poisson arrivals. Cold replicas for every policy, the same requests.
Reports the prefix hit rate (cached / prompt tokens, from the gateway's usage records), mean
and p99 TTFT and output throughput, and kv_aware's ratios to round_robin.

    .venv/bin/python benchmarks/routing.py [--replicas 2] [--tenants 4] [--requests 48]
        [--rate 0.5] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Req, Server, client_session, one, summarize

ROOT = Path(__file__).resolve().parent.parent
INFERCLOUD = ROOT / ".venv" / "bin" / "infercloud"
ADMIN = "ic-admin-routing-bench"


def workload(
    vocab: int, tenants: int, n: int, rate_per_s: float, system_len: int, seed: int = 0
) -> list[tuple[int, Req]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab - 100) for _ in range(system_len)] for _ in range(tenants)]
    t, out = 0.0, []
    for _ in range(n):
        tenant = rng.randrange(tenants)
        suffix = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 128))]
        out.append((tenant, Req(systems[tenant] + suffix, 16, t)))
        t += rng.expovariate(rate_per_s)
    return out


def run_policy(policy: str, args: argparse.Namespace, reqs: list[tuple[int, Req]]) -> Any:
    work = Path(tempfile.mkdtemp(prefix=f"ic-routing-{policy}-"))
    threads = max(1, (os.cpu_count() or 2) // args.replicas)
    replica = (
        f"      - builtin: {{model: SmolLM2-135M-Instruct, kv_cache_bytes: {args.kv_cache}, "
        f"threads: {threads}}}\n"
    )
    (work / "deploy.yaml").write_text(
        "models:\n"
        "  - name: smollm2\n"
        f"    routing: {{policy: {policy}}}\n"
        "    replicas:\n" + replica * args.replicas
    )
    data = ["--data-dir", str(work)]
    gateway = Server(
        [
            str(INFERCLOUD),
            *("serve", "--config", str(work / "deploy.yaml"), "--port", "8401"),
            *("--admin-key", ADMIN, "--log-level", "warning", *data),
        ],
        8401,
        {},
        work / "gateway.log",
        600.0,
    )
    try:
        keys = [
            json.loads(
                subprocess.run(
                    [str(INFERCLOUD), "keys", "create", "--tenant", f"t{i}", "--json", *data],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )["key"]
            for i in range(args.tenants)
        ]

        async def go() -> dict[str, float]:
            async with client_session() as client:
                t0 = time.perf_counter()
                results = await asyncio.gather(
                    *(
                        one(
                            client,
                            gateway.url,
                            "smollm2",
                            r,
                            t0,
                            {"Authorization": f"Bearer {keys[t]}"},
                        )
                        for t, r in reqs
                    )
                )
                return summarize(list(results), time.perf_counter() - t0)

        summary = asyncio.run(go())
        rows = httpx.get(
            gateway.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()["data"]
        records = httpx.get(
            gateway.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()["data"]
    finally:
        gateway.stop()
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    summary["hit_rate_tokens"] = cached / prompt if prompt else 0.0
    summary["requests_per_replica"] = {r["name"]: r["routed_total"] for r in rows}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--system-len", type=int, default=768)
    parser.add_argument("--kv-cache", default="128MiB")
    parser.add_argument("--policies", default="round_robin,least_outstanding,kv_aware")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "routing.json"
    )
    args = parser.parse_args()
    reqs = workload(49152, args.tenants, args.requests, args.rate, args.system_len)
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args, reqs)
        print(policy, json.dumps(results[policy]), flush=True)
    if "kv_aware" in results and "round_robin" in results:
        kv, rr = results["kv_aware"], results["round_robin"]
        results["ratios"] = {
            "hit_rate_kv_over_rr": kv["hit_rate_tokens"] / max(1e-9, rr["hit_rate_tokens"]),
            "p99_ttft_kv_over_rr": kv["p99_ttft_ms"] / rr["p99_ttft_ms"],
            "mean_ttft_kv_over_rr": kv["mean_ttft_ms"] / rr["mean_ttft_ms"],
            "throughput_kv_over_rr": kv["output_throughput"] / rr["output_throughput"],
        }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results.get("ratios", {}), indent=1))


if __name__ == "__main__":
    main()
