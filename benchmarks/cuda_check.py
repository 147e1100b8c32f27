"""The builtin engine on a CUDA device: the same code as on the CPU, checked and measured.

Run where a GPU is present (this project's lent H200; nothing here runs in CI):

    PYTHONPATH=src python3 benchmarks/cuda_check.py [--device cuda] [--out F]

1. Correctness: the tiny random Llama (built locally, `models/tiny.py`), float32, TF32 off.
   Greedy token ids of the engine, run batched, with chunked prefill and with preemption by
   recompute, against Hugging Face transformers `generate(do_sample=False)` on the same device.
   Also decodes of different context lengths in a group each, and bfloat16 on the device: it
   must run and keep the KV pool whole.
2. Step times: a SmolLM2-135M-shaped Llama (the real config, random weights: the lent machine
   cannot hold the real GGUF; timings do not depend on the weights' values), bfloat16, offline
   engine, `ignore_eos`: 32 x (128 + 64) tokens (issue 2's anchor) and 256 x (128 + 64). Every
   step's shape and wall time is recorded and priced by the simulator's performance model on
   the H200 catalog entry (default efficiency factors, then factors fitted to these very steps),
   so the report says how far the step model is from our engine on a real GPU.

Writes JSON (default `$OUT/cuda_check.json` when OUT is set, else stdout only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from infercloud.engine.config import EngineConfig
from infercloud.engine.llm import LLM
from infercloud.engine.llm_engine import LLMEngine
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import SchedulerConfig
from infercloud.engine.step_shape import StepShape
from infercloud.models.tiny import build_tiny_llama

SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def reference_greedy(
    folder: Path, prompts: list[list[int]], num_tokens: int, device: str
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = model.to(device).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def correctness(tiny: Path, device: str) -> dict[str, Any]:
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    lengths = (1, 5, 17, 33, 48, 60)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    reference = reference_greedy(tiny, prompts, 24, device)
    cases = {
        "batched": (4 << 20, SchedulerConfig()),
        "chunked-prefill": (
            4 << 20,
            SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=13),
        ),
        "preemption": (
            96 << 10,
            SchedulerConfig(max_num_batched_tokens=48, long_prefill_token_threshold=16),
        ),
    }
    out: dict[str, Any] = {}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for name, (kv_bytes, scheduler) in cases.items():
        llm = LLM(str(tiny), kv_cache_bytes=kv_bytes, scheduler=scheduler, device=device)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        engine = llm.engine
        out[name] = {
            "equal_to_transformers": got == reference,
            "sequences_equal": sum(a == b for a, b in zip(got, reference, strict=True)),
            "sequences": len(prompts),
            "preemptions": engine.scheduler.num_preemptions,
            "pool_whole": engine.kv_cache.num_available_blocks == engine.block_pool.num_blocks,
        }
    # decodes of different context lengths, each length in its own group (no cost per group)
    long_prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 70, 9, 150)]
    llm = LLM(str(tiny), kv_cache_bytes=4 << 20, device=device, decode_group_overhead_tokens=0)
    got = [o.token_ids for o in llm.generate(long_prompts, params)]
    out["decode-groups"] = {
        "equal_to_transformers": got == reference_greedy(tiny, long_prompts, 24, device)
    }
    llm = LLM(str(tiny), kv_cache_bytes=4 << 20, dtype="bfloat16", device=device)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    out["bfloat16"] = {
        "ran": all(len(t) > 0 for t in got),
        "sequences_equal_to_float32_reference": sum(
            a == b for a, b in zip(got, reference, strict=True)
        ),
        "pool_whole": llm.engine.kv_cache.num_available_blocks == llm.engine.block_pool.num_blocks,
    }
    return out


def smollm2_shaped(folder: Path, tokenizer_from: Path) -> Path:
    """A Llama folder with SmolLM2-135M's config and tokenizer files and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = tokenizer_from / name
        if src.exists():
            (folder / name).write_bytes(src.read_bytes())
    return folder


def timed_run(
    engine: LLMEngine, num_requests: int, prompt_len: int, output_len: int
) -> tuple[float, int, list[tuple[StepShape, float]]]:
    """Run the workload to completion; return wall seconds, output tokens and each step's
    (shape, seconds)."""
    g = torch.Generator().manual_seed(num_requests)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = f"{num_requests}x{prompt_len}-{time.monotonic_ns()}"
    for i in range(num_requests):
        ids = torch.randint(100, vocab - 1, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{tag}-{i}", ids, params)
    steps: list[tuple[StepShape, float]] = []
    num_tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t
        if engine.last_step is not None:
            steps.append((engine.last_step, seconds))
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
    return time.perf_counter() - started, num_tokens, steps


def step_times(
    folder: Path, device: str, batches: list[int], group_overhead_tokens: int
) -> dict[str, Any]:
    from infercloud.sim.hardware import HardwareCatalog
    from infercloud.sim.model_specs import load_model_catalog
    from infercloud.sim.perf_model import PerfModel, fit_efficiency

    scheduler = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256)
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="bfloat16",
            device=device,
            kv_cache_bytes=8 << 30,
            scheduler=scheduler,
            decode_group_overhead_tokens=group_overhead_tokens,
        )
    )
    timed_run(engine, 8, 64, 8)  # warm-up: kernels, allocator
    h200 = HardwareCatalog.load()["h200"]
    perf = PerfModel(load_model_catalog()["smollm2-135m"], h200, dtype_bytes=2)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    result: dict[str, Any] = {"device_name": name}
    all_steps: list[tuple[StepShape, float]] = []
    for num_requests in batches:
        wall_s, tokens, steps = timed_run(engine, num_requests, 128, 64)
        all_steps += steps
        decode = [s for shape, s in steps if all(n == 1 for _, n in shape.chunks)]
        result[f"{num_requests}x(128+64)"] = {
            "output_throughput": tokens / wall_s,
            "wall_s": wall_s,
            "steps": len(steps),
            "median_decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
            "median_error_default_factors": statistics.median(
                perf.step_s(shape) / s - 1 for shape, s in steps
            ),
        }
    fitted, error = fit_efficiency(perf, all_steps, "fitted to the builtin engine's steps on H200")
    result["fitted_factors"] = {k: v for k, v in asdict(fitted).items() if k != "source"}
    result["fitted_median_error"] = error
    result["steps"] = [
        {"chunks": shape.chunks, "num_sampled": shape.num_sampled, "seconds": s}
        for shape, s in all_steps
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    parser.add_argument("--batches", default="32,256", help="requests per timed run")
    parser.add_argument("--decode-group-overhead-tokens", type=int, default=1024)
    parser.add_argument("--skip-correctness", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_llama(Path(tmp) / "tiny")
        if not args.skip_correctness:
            report["correctness"] = correctness(tiny, args.device)
            print(json.dumps(report["correctness"], indent=1), flush=True)
        folder = smollm2_shaped(Path(tmp) / "smollm2-shaped", args.tokenizer_from or tiny)
        batches = [int(b) for b in args.batches.split(",")]
        overhead = args.decode_group_overhead_tokens
        report["step_times"] = step_times(folder, args.device, batches, overhead)
    summary = {k: v for k, v in report["step_times"].items() if k != "steps"}
    print(json.dumps(summary, indent=1), flush=True)
    out = args.out or (Path(os.environ["OUT"]) / "cuda_check.json" if "OUT" in os.environ else None)
    if out is not None:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
