"""The decoder layers as one C++ call (`csrc/decoder_stack.cpp`) against the Python layer loop
over the same kernels: the same operators in the same order, so the same bits. A tiny random
model (head size 32, so that every part of a layer runs on our kernels) diverges at the first
differing bit, and greedy continuations and their logprobs must agree exactly through steps
that batch decodes, chunk prefills beside them and preempt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infercloud.engine.config import SchedulerConfig
from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.llm import LLM
from infercloud.engine.packed_linear import KernelGateUpSilu
from infercloud.engine.sampling_params import SamplingParams
from infercloud.models.tiny import build_tiny_llama

pytestmark = pytest.mark.skipif(
    not (load_kernels() and torch.ops.infercloud.has_linear_bf16()),
    reason=f"no AVX512-BF16 kernels here: {load_error() or 'CPU without AVX512-BF16'}",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-32", head_dim=32)


def _run(
    model_dir: Path, stacked: bool, kv_layout: str = "auto"
) -> tuple[LLM, list[tuple[list[int], list[float]]]]:
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        kv_cache_bytes=96 << 10,  # room for about two of the prompts below: preemption
        scheduler=SchedulerConfig(max_num_batched_tokens=48, long_prefill_token_threshold=16),
        linear_kernel="kernel",
        decode_attention="kernel",
        prefill_attention="kernel",
        stacked_layers=stacked,
        kv_layout=kv_layout,
    )
    assert llm.engine.kv_tiled == (kv_layout == "auto")
    on_tiles = kv_layout == "auto" and bool(torch.ops.infercloud.has_attention_tiles())
    assert llm.engine.attention_tiles == on_tiles  # the stack and the loop pass it alike
    layers = llm.engine.runner.model.layers
    assert all(isinstance(layer.mlp.gate_up_proj, KernelGateUpSilu) for layer in layers)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 460, (n,), generator=g).tolist() for n in (5, 40, 90, 17, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("kv_layout", ["auto", "plain"], ids=["tiled-kv", "plain-kv"])
def test_stack_gives_the_python_loops_tokens_and_logprobs_bit_for_bit(
    model_dir: Path, kv_layout: str
) -> None:
    """Also over tiled KV blocks (the stack writes them itself, the loop through
    `write_kv_tiled`)."""
    loop, want = _run(model_dir, stacked=False, kv_layout=kv_layout)
    assert not loop.engine.stacked_layers
    stacked, got = _run(model_dir, stacked=True, kv_layout=kv_layout)
    assert stacked.engine.stacked_layers
    assert stacked.engine.scheduler.num_preemptions > 0  # the pool was too small for all
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lps for _, lps in got] == [lps for _, lps in want]
    assert all(len(lps) == 24 for _, lps in got)


def test_every_step_of_a_stacked_engine_runs_the_stack(model_dir: Path) -> None:
    llm, _ = _run(model_dir, stacked=True)
    model = llm.engine.runner.model

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("a step fell back to the Python layer loop")

    model._layers_fused = refuse  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7] * 30, [9] * 3], params)
    assert [len(o.token_ids) for o in out] == [8, 8]


def test_a_write_row_outside_the_cache_is_refused_before_anything_is_written(
    model_dir: Path,
) -> None:
    llm, _ = _run(model_dir, stacked=True)
    model = llm.engine.runner.model
    cache = llm.engine.runner.kv_cache
    before = cache.clone()
    hidden = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    rows = cache.shape[2] * cache.shape[3]  # rows of one layer's key cache
    write_rows = torch.tensor([0, rows], dtype=torch.long)  # 2 KV heads, one token
    none = torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="write row"):
        model.stack.forward(
            hidden,
            torch.zeros(1, dtype=torch.long),
            model.rotary.cos,
            model.rotary.sin,
            write_rows,
            0,
            none,
            none,
            none,
            none,
            none,
        )
    assert torch.equal(cache, before)
