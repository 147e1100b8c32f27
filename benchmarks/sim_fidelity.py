"""Fidelity of the simulator on hardware we have: the same workload on the real builtin engine
and in the simulator, after `infercloud calibrate`.

1. `infercloud calibrate` measures this CPU (peak matmul TFLOP/s, memory bandwidth) and the
   builtin engine's step times, fits the performance model's efficiency factors, and writes the
   "local-cpu" hardware entry (here to benchmarks/results/calibration.yaml).
2. The real run: `infercloud engine` (SmolLM2-135M-Instruct, dtype auto, all cores) over HTTP,
   streamed, each request sent at its arrival time (engine_throughput.one).
3. The simulated run: one local-cpu replica with the engine's scheduler settings and KV pool,
   the same requests (same token ids from the same workload generator).
Then mean and p99 TTFT, mean TPOT and throughput side by side, with the relative error of the
simulation (goal: within 15%). The real engine logs its steps (`--step-log`), and the calibrated
performance model prices those very steps too, so the report separates the error of the step
model (`steps`: measured vs predicted seconds of the real run's own steps, by kind of step) from
what the simulated run does differently (which steps it schedules).

    .venv/bin/python benchmarks/sim_fidelity.py [--skip-calibrate] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine_throughput import ROOT, Req, Server, replay
from infercloud.engine.step_shape import StepShape
from infercloud.models.registry import DEFAULT_MODEL_NAME
from infercloud.sim.fleet import Fleet
from infercloud.sim.hardware import HardwareCatalog
from infercloud.sim.model_specs import load_model_catalog
from infercloud.sim.perf_model import PerfModel
from infercloud.sim.simulator import Simulation
from infercloud.sim.workload import SimRequest, TokenSource, poisson

COMPARED = (
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "output_throughput",
    "request_throughput",
)
CALIBRATION = ROOT / "benchmarks/results/calibration.yaml"
SAMPLES = ROOT / "benchmarks/results/calibration_steps.json"
STEP_LOG = Path("/tmp/sim_fidelity_steps.jsonl")


def read_steps(path: Path, skip: int) -> list[tuple[StepShape, float]]:
    """The (shape, seconds) of the steps logged after the first `skip` lines."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][skip:]
    return [
        (
            StepShape(tuple((int(a), int(b)) for a, b in r["chunks"]), int(r["num_sampled"])),
            float(r["seconds"]),
        )
        for r in rows
    ]


def step_kind(shape: StepShape) -> str:
    decodes = sum(1 for _, n in shape.chunks if n == 1)
    prefills = shape.num_seqs - decodes
    if prefills and decodes:
        return "mixed, " + ("< 32" if decodes < 32 else ">= 32") + " decoding"
    return "prefill" if prefills else "decode, " + ("< 32" if decodes < 32 else ">= 32")


def step_errors(steps: list[tuple[StepShape, float]], perf: PerfModel) -> dict[str, Any]:
    """The calibrated model's prediction for each step the real engine ran, by kind of step:
    count, measured and predicted seconds in all, and the median relative error."""
    import statistics

    kinds: dict[str, list[tuple[float, float]]] = {}
    for shape, seconds in steps:
        kinds.setdefault(step_kind(shape), []).append((seconds, perf.step_s(shape)))
    kinds["all"] = [pair for pairs in list(kinds.values()) for pair in pairs]
    return {
        kind: {
            "steps": len(pairs),
            "measured_s": sum(m for m, _ in pairs),
            "predicted_s": sum(p for _, p in pairs),
            "median_error": statistics.median(p / m - 1 for m, p in pairs),
        }
        for kind, pairs in sorted(kinds.items())
    }


def workloads(vocab: int) -> dict[str, list[SimRequest]]:
    return {
        "poisson 0.5 req/s, prompts 64-512, outputs 32-256": poisson(
            0.5, 48, (64, 512), (32, 256), seed=11
        ),
        "poisson 2 req/s, prompts 64-1024, outputs 16-128": poisson(
            2.0, 64, (64, 1024), (16, 128), seed=12
        ),
    }


async def real_run(url: str, model: str, reqs: list[SimRequest], vocab: int) -> dict[str, float]:
    tokens = TokenSource(vocab)
    return await replay(
        url, model, [Req(tokens.prompt(r), r.output_len, r.arrival_s) for r in reqs]
    )


def sim_run(reqs: list[SimRequest], calibration: Path, kv_cache: str) -> dict[str, Any]:
    fleet = Fleet.model_validate(
        {
            "model": "smollm2-135m",
            "dtype": "bfloat16",
            "pools": [{"hardware": "local-cpu", "kv_cache_bytes": kv_cache}],
            # the builtin engine's defaults (`infercloud engine`)
            "scheduler": {
                "max_num_batched_tokens": 512,
                "max_num_seqs": 64,
                "long_prefill_token_threshold": 256,
            },
        }
    )
    return Simulation(fleet, reqs, HardwareCatalog.load(calibration)).run()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-calibrate", action="store_true")
    parser.add_argument("--calibration", type=Path, default=CALIBRATION)
    parser.add_argument("--kv-cache", default="512MiB")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sim_fidelity.json")
    args = parser.parse_args()
    exe = [sys.executable, "-m", "infercloud"]
    if not args.skip_calibrate:
        out = subprocess.run(
            [
                *exe,
                "calibrate",
                "--out",
                str(args.calibration),
                "--samples",
                str(SAMPLES),
                "--json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        calibration = json.loads(out.stdout)
        print("calibration:", json.dumps(calibration["efficiency"]), calibration["calibration"])
    vocab = 49152
    catalog = HardwareCatalog.load(args.calibration)
    print("local-cpu:", catalog["local-cpu"])
    server = Server(
        [
            *exe,
            "engine",
            "--model",
            DEFAULT_MODEL_NAME,
            "--dtype",
            "auto",
            "--kv-cache-bytes",
            args.kv_cache,
            "--port",
            str(args.port),
            "--log-level",
            "warning",
            "--step-log",
            str(STEP_LOG),
        ],
        args.port,
        {},
        Path("/tmp/sim_fidelity_engine.log"),
        300,
    )
    acc = catalog["local-cpu"]
    perf = PerfModel(load_model_catalog()["smollm2-135m"], acc, acc.efficiency, dtype_bytes=2)
    rows: dict[str, Any] = {}
    try:
        for name, reqs in workloads(vocab).items():
            logged = len(STEP_LOG.read_text().splitlines()) if STEP_LOG.exists() else 0
            client_cpu_s = time.process_time()
            real = asyncio.run(real_run(server.url, DEFAULT_MODEL_NAME, reqs, vocab))
            # the client shares the machine's cores with the engine it measures
            real["client_cpu_s"] = time.process_time() - client_cpu_s
            steps = step_errors(read_steps(STEP_LOG, logged), perf)
            sim = sim_run(reqs, args.calibration, args.kv_cache)
            errors = {k: sim[k] / real[k] - 1 if real[k] else None for k in COMPARED}
            rows[name] = {"real": real, "sim": sim, "error": errors, "steps": steps}
            print(f"\n{name}")
            for k in COMPARED:
                err = errors[k]
                shown = f"{err:+.1%}" if err is not None else "n/a"
                print(f"  {k:<22} real {real[k]:>10.2f}  sim {sim[k]:>10.2f}  error {shown}")
            print(f"  client CPU {real['client_cpu_s']:.1f} s over {real['duration']:.1f} s")
            for kind, e in steps.items():
                print(
                    f"  steps {kind:<22} {e['steps']:>5}  measured {e['measured_s']:8.2f} s"
                    f"  predicted {e['predicted_s']:8.2f} s  median error {e['median_error']:+.1%}"
                )
    finally:
        server.stop()
    args.out.write_text(
        json.dumps(
            {"calibration": catalog["local-cpu"].source, "workloads": rows}, indent=1, default=str
        )
    )


if __name__ == "__main__":
    main()
