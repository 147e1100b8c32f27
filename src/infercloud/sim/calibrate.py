"""`infercloud calibrate`: measure this machine and the builtin engine, fit the performance model.

Three measurements, then a fit:
  1. peak matrix-multiply TFLOP/s in the engine's dtype (square matmuls, best of several);
  2. memory read bandwidth (a sum over a buffer far larger than the caches, best of several);
  3. the builtin engine's own steps: prefill sweeps (one prompt of 16 .. 2048 tokens, chunked as
     the scheduler chunks them) and decode sweeps (batches of 1 .. 64 requests at contexts of
     64 .. 1536 tokens), each step's wall time around `LLMEngine.step()` with its `StepShape`.
The efficiency factors of `sim.perf_model` are then fitted to the measured steps, and the CPU's
hardware entry ("local-cpu": the measured peak and bandwidth, the fitted factors, the machine
and date) is written to the calibration file that the hardware catalog reads.

This module measures (it reads the clock and runs torch); everything it feeds is pure.
"""

from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from infercloud.engine.step_shape import StepShape
from infercloud.sim.hardware import Accelerator
from infercloud.sim.model_specs import ModelSpec
from infercloud.sim.perf_model import PerfModel, fit_efficiency

LOCAL = "local-cpu"
PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (64, 512, 1536)


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


def _run(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> list[Any]:
    from infercloud.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    samples = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        if engine.last_step is not None:
            samples.append((engine.last_step, elapsed))
    return samples


def measure_steps(engine: Any, vocab: int, seed: int = 0) -> list[tuple[StepShape, float]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    _run(engine, [prompt(64) for _ in range(4)], 8, "warmup")
    samples: list[tuple[StepShape, float]] = []
    for n in PREFILL_LENGTHS:
        samples += _run(engine, [prompt(n)], 2, f"prefill{n}")
    for ctx in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if batch * (ctx + 16) > engine.max_tokens_in_pool:
                continue
            samples += _run(engine, [prompt(ctx) for _ in range(batch)], 12, f"d{ctx}x{batch}")
    return samples


def calibrate(
    model: str,
    dtype: str = "auto",
    threads: int | None = None,
    kv_cache_bytes: int = 1 << 30,
    usd_per_hour: float | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    import torch

    from infercloud.engine.config import EngineConfig
    from infercloud.engine.llm_engine import LLMEngine
    from infercloud.engine.model_runner import resolve_dtype
    from infercloud.sim.hardware import calibration_path

    config = EngineConfig(
        model=model,
        dtype=dtype,
        kv_cache_bytes=kv_cache_bytes,
        num_threads=threads,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    dtype_bytes = torch.empty((), dtype=torch_dtype).element_size()
    peak = measure_peak_tflops(torch_dtype)
    bandwidth = measure_bandwidth_gbps()
    samples = measure_steps(engine, engine.model_config.vocab_size)
    spec = ModelSpec.from_config(engine.model_name, engine.model_config, engine.max_model_len)
    today = date.today().isoformat()
    source = f"measured by infercloud calibrate on {cpu_name()}, {os.cpu_count()} cores, {today}"
    device = Accelerator(LOCAL, peak, memory_gb(), bandwidth, bandwidth, bandwidth, source)
    perf = PerfModel(spec, device, dtype_bytes=dtype_bytes, block_size=config.block_size)
    fit_source = (
        f"fitted to {len(samples)} steps of {engine.model_name} ({torch_dtype}, "
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
            "model": engine.model_name,
            "dtype": str(torch_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
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
