"""`infercloud calibrate`: measure this machine and the builtin engine, fit the performance model.

Three measurements, then a fit:
  1. peak matrix-multiply TFLOP/s in the engine's dtype (square matmuls, best of several);
  2. memory read bandwidth (a sum over a buffer far larger than the caches, best of several);
  3. the builtin engine's own steps, served as `infercloud engine` serves them (its default
     scheduler, prefix cache on, requests streamed over HTTP) with `--step-log`: prefill sweeps
     (one prompt of 16 .. 2048 tokens, chunked as the scheduler chunks them) and decode sweeps
     (batches of 1 .. 64 requests, each with its own context of 64 .. 1536 tokens), then mixed
     steps (long prompts chunked in beside a decoding batch of 4 .. 64). Each step is logged with
     its `StepShape` and its period (start to the next step's start), so the serving work
     between and during steps (streaming the outputs, on the same cores) is part of it.
The efficiency factors of `sim.perf_model` are then fitted to the measured steps, and the CPU's
hardware entry ("local-cpu": the measured peak and bandwidth, the fitted factors, the machine
and date) is written to the calibration file that the hardware catalog reads.

This module measures (it reads the clock and runs torch); everything it feeds is pure.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from infercloud.engine.config import DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS
from infercloud.engine.step_shape import StepShape
from infercloud.sim.hardware import Accelerator
from infercloud.sim.model_specs import ModelSpec
from infercloud.sim.perf_model import Efficiency, PerfModel, fit_efficiency

LOCAL = "local-cpu"
PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64)
DECODE_CONTEXTS = (64, 512, 1536)
MIXED_BATCHES = (4, 16, 32, 48, 64)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def measure_peak_tflops(dtype: Any, repeats: int = 5) -> float:
    import torch

    best = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        a @ b
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e12)
    return best


def measure_bandwidth_gbps(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = max(best, num_bytes / (time.perf_counter() - t) / 1e9)
    return best


async def _stream(client: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> None:
    """One streamed completion, read to its end."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def _first_token(client: Any, url: str, model: str, prompt: list[int]) -> None:
    await _stream(client, url, model, prompt, 1)


async def _drive(
    url: str, model: str, vocab: int, max_pool_tokens: int, max_len: int, seed: int
) -> None:
    """Prefill sweeps (one prompt at a time), then decode sweeps, then mixed steps.

    Decode sweeps: for each context length, a set of distinct contexts is computed once (sent
    with one output token, so the prefix cache holds them); then batches of 1 .. 64 requests,
    each its own context plus 16 new tokens, decode 12 tokens together, each attending to its
    whole context every step. Contexts are distinct because real traffic's are: a batch that
    shares one context reads it from the CPU's caches and would price KV reads too cheaply.
    Mixed steps: prompts of 1024 tokens arrive while such a batch decodes (chunked prefill
    beside it), as under overload."""
    import asyncio

    import httpx

    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    def fits(batch: int, ctx: int) -> bool:
        return batch * (ctx + 16) <= max_pool_tokens and ctx + 12 <= max_len

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def computed(contexts: list[list[int]]) -> None:
            """Prefill the contexts, a few at a time, so the prefix cache holds them."""
            for i in range(0, len(contexts), 8):
                await asyncio.gather(
                    *(_first_token(client, url, model, c) for c in contexts[i : i + 8])
                )

        await asyncio.gather(*(_stream(client, url, model, prompt(64), 8) for _ in range(4)))
        for n in PREFILL_LENGTHS:
            if n + 2 <= max_len:
                await _stream(client, url, model, prompt(n), 2)
        for ctx in DECODE_CONTEXTS:
            batches = [b for b in DECODE_BATCHES if fits(b, ctx)]
            if not batches:
                continue
            contexts = [prompt(ctx - 16) for _ in range(max(batches))]
            await computed(contexts)
            for batch in batches:
                await asyncio.gather(
                    *(_stream(client, url, model, c + prompt(16), 12) for c in contexts[:batch])
                )
        # mixed steps: long prompts arriving while a batch decodes (chunked prefill beside it)
        ctx = 512
        for batch in MIXED_BATCHES:
            if batch * (ctx + 48) + 4 * 1024 > max_pool_tokens or max_len < 1024 + 2:
                continue
            contexts = [prompt(ctx - 16) for _ in range(batch)]
            await computed(contexts)
            decoders = [
                asyncio.ensure_future(_stream(client, url, model, c + prompt(16), 40))
                for c in contexts
            ]
            await asyncio.sleep(0.5)
            await asyncio.gather(*(_stream(client, url, model, prompt(1024), 2) for _ in range(4)))
            await asyncio.gather(*decoders)


def measure_steps(
    model: str,
    dtype: str,
    threads: int | None,
    kv_cache_bytes: int,
    vocab: int,
    max_pool_tokens: int,
    max_len: int,
    seed: int = 0,
    timeout_s: float = 300.0,
    decode_attention: str = "auto",
) -> list[tuple[StepShape, float]]:
    """Serve the model with `infercloud engine --step-log`, drive the sweeps over HTTP, and
    return the logged (shape, period) of every step."""
    import asyncio
    import socket
    import subprocess
    import sys
    import tempfile

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="infercloud-calibrate-") as tmp:
        log = Path(tmp) / "steps.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "infercloud",
            "engine",
            "--model",
            model,
            "--served-model-name",
            "calibration",
            "--dtype",
            dtype,
            "--kv-cache-bytes",
            str(kv_cache_bytes),
            "--port",
            str(port),
            "--step-log",
            str(log),
            "--log-level",
            "warning",
            "--decode-attention",
            decode_attention,
        ]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        server_log = (Path(tmp) / "engine.log").open("w")
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        "the engine exited: " + (Path(tmp) / "engine.log").read_text()[-2000:]
                    )
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not start")
                time.sleep(0.5)
            asyncio.run(_drive(url, "calibration", vocab, max_pool_tokens, max_len, seed))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            server_log.close()
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    warmup = 4
    return [
        (
            StepShape(
                tuple((int(a), int(b)) for a, b in r["chunks"]),
                int(r["num_sampled"]),
                int(r["host_blocks_loaded"]),
            ),
            float(r["seconds"]),
        )
        for r in rows[warmup:]
    ]


def calibrate(
    model: str,
    dtype: str = "auto",
    threads: int | None = None,
    kv_cache_bytes: int = 2 << 30,
    usd_per_hour: float | None = None,
    out: Path | None = None,
    samples_out: Path | None = None,
) -> dict[str, Any]:
    import torch

    from infercloud.engine.cpu_kernels import load_kernels
    from infercloud.engine.model_config import ModelConfig
    from infercloud.engine.model_runner import num_kv_blocks_for_bytes, resolve_dtype
    from infercloud.models.registry import resolve_model
    from infercloud.sim.hardware import calibration_path

    if threads is not None:
        torch.set_num_threads(threads)
    name, folder = resolve_model(model)
    config = ModelConfig.from_folder(folder)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    dtype_bytes = torch.empty((), dtype=torch_dtype).element_size()
    peak = measure_peak_tflops(torch_dtype)
    bandwidth = measure_bandwidth_gbps()
    block_size = 16
    pool_tokens = block_size * num_kv_blocks_for_bytes(
        config, kv_cache_bytes, block_size, torch_dtype
    )
    max_len = config.max_position_embeddings
    # The engine's decode attention, resolved here as `infercloud engine` would and passed to it
    # explicitly: the two agree on whether decodes are padded in groups.
    decode_kernel = load_kernels()
    decode_attention = "kernel" if decode_kernel else "torch"
    samples = measure_steps(
        model,
        dtype,
        threads,
        kv_cache_bytes,
        config.vocab_size,
        pool_tokens,
        max_len,
        decode_attention=decode_attention,
    )
    if samples_out is not None:
        rows = [
            {"chunks": s.chunks, "num_sampled": s.num_sampled, "seconds": t} for s, t in samples
        ]
        samples_out.write_text(json.dumps(rows))
    spec = ModelSpec.from_config(name, config, config.max_position_embeddings)
    today = date.today().isoformat()
    source = f"measured by infercloud calibrate on {cpu_name()}, {os.cpu_count()} cores, {today}"
    device = Accelerator(LOCAL, peak, memory_gb(), bandwidth, bandwidth, bandwidth, source)
    # With torch decode attention the engine pads its decodes in groups (its default rule);
    # our CPU kernel reads each at its own length.
    padding = None if decode_kernel else DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS
    start = Efficiency(decode_group_overhead_tokens=padding)
    perf = PerfModel(spec, device, start, dtype_bytes=dtype_bytes, block_size=block_size)
    fit_source = (
        f"fitted to {len(samples)} steps of {name} ({torch_dtype}, "
        f"threads={torch.get_num_threads()}) on {today}"
    )
    efficiency, error = fit_efficiency(perf, samples, fit_source)
    entry: dict[str, Any] = {
        "vendor": cpu_name(),
        "peak_tflops": round(peak, 4),
        "memory_gb": round(memory_gb(), 1),
        "bandwidth_gbps": round(bandwidth, 2),
        "interconnect_gbps": round(bandwidth, 2),
        "host_link_gbps": round(bandwidth, 2),
        "source": source,
        "efficiency": asdict(efficiency),
        "calibration": {
            "model": name,
            "dtype": str(torch_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "decode_attention": decode_attention,
            "num_steps": len(samples),
            "median_abs_error": round(error, 4),
        },
    }
    if usd_per_hour is not None:
        entry["prices"] = [
            {
                "provider": "local",
                "usd_per_hour": usd_per_hour,
                "date": today,
                "source": "--usd-per-hour",
            }
        ]
    path = out or calibration_path()
    existing = yaml.safe_load(path.read_text()) if path.exists() else None
    doc = existing if isinstance(existing, dict) else {}
    doc.setdefault("accelerators", {})[LOCAL] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return {"path": str(path), **entry}
