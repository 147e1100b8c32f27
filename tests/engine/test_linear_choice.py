"""`linear_kernel="auto"`: our GEMM or oneDNN's, whichever the timing at engine start favours."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.linear_choice import LinearTimes, time_linear_paths
from infercloud.engine.llama import DecoderLayer, LlamaModel
from infercloud.engine.llm import LLM
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.packed_linear import KernelLinear, PackedLinear, can_pack, has_kernel_gemm
from infercloud.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (load_kernels() and torch.ops.infercloud.has_linear_f32()),
    reason=f"no GEMM of ours here: {load_error() or 'CPU without AVX2 or AVX-512'}",
)


def _dtypes_ours_takes() -> list[object]:
    """bfloat16 (AVX512-BF16) and float32 (AVX2 or AVX-512), each skipped where ours cannot."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not (load_kernels() and has_kernel_gemm(getattr(torch, name))),
                reason=f"our GEMM does not take {name} on this CPU",
            ),
        )
        for name in ("bfloat16", "float32")
    ]


def test_the_timed_weights_are_the_first_layers_projections(
    real_model_dir: Path, tiny_model_dir: Path
) -> None:
    with torch.device("meta"):
        smollm = LlamaModel(ModelConfig.from_folder(real_model_dir))
    # SmolLM2-135M: 9 heads and 3 KV heads of 64, hidden 576, intermediate 1536
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert [tuple(w.shape) for w in smollm.projection_weights(2)] == shapes * 2
    tiny = LlamaModel(ModelConfig.from_folder(tiny_model_dir))
    layer = tiny.layers[1]
    assert isinstance(layer, DecoderLayer)
    want = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    want += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    got = tiny.projection_weights(5)  # the tiny model has 2 layers
    assert len(got) == 8
    assert [w.data_ptr() for w in got[4:]] == [p.weight.data_ptr() for p in want]


def _scripted_clock(*paths: list[tuple[float, float]]) -> Iterator[float]:
    """Readings for passes in the order `time_linear_paths` runs them: a warm-up of each path,
    then the paths in turn (kernel, other and, with fma, kernel on multiply-adds); a pass is a
    prefill sweep and a decode sweep, each reading the clock at its start and end."""
    now = 0.0
    order = [passes[i] for i in range(len(paths[0])) for passes in paths]
    for sweeps in order:
        for seconds in sweeps:
            yield now
            now += seconds
            yield now


def _best(passes: list[tuple[float, float]]) -> float:
    """A path's time: its best pass after the warm-up, a pass counting its decode sweep 16
    times."""
    return min(prefill + 16 * decode for prefill, decode in passes[1:])


@pytest.mark.parametrize(
    ("kernel_passes", "other_passes", "kernel_wins"),
    [
        # (prefill sweep, decode sweep): a pass counts its decode sweep 512 / 32 = 16 times
        ([(9, 9), (1, 0.25), (2, 0.125), (1, 0.5)], [(9, 9), (2, 0.25), (1.5, 0.25), (3, 1)], True),
        # best kernel pass 3.0 + 16 * 0.0625 = 4.0; other 1.0 + 16 * 0.125 = 3.0
        ([(0, 0), (3, 0.0625), (4, 1), (5, 1)], [(9, 9), (5, 1), (1, 0.125), (2, 2)], False),
    ],
)
def test_the_best_timed_pass_of_each_path_decides(
    kernel_passes: list[tuple[float, float]],
    other_passes: list[tuple[float, float]],
    kernel_wins: bool,
) -> None:
    readings = _scripted_clock(kernel_passes, other_passes)
    weights = [torch.ones(32, 16), torch.ones(16, 32)]  # float32: ours takes it on any vector CPU
    times = time_linear_paths(weights, packed_other=False, clock=lambda: next(readings))
    assert times == LinearTimes(_best(kernel_passes), _best(other_passes))
    assert times.kernel_wins is kernel_wins
    assert next(readings, None) is None  # every sweep was timed, none twice


@pytest.mark.skipif(
    not (load_kernels() and has_kernel_gemm(torch.bfloat16)), reason="no bfloat16 GEMM of ours"
)
@pytest.mark.parametrize(
    ("fma_passes", "fma_wins"),
    [
        ([(9, 9), (1, 0.0625), (3, 3), (3, 3)], True),  # 2.0 against vdpbf16ps' 3.0
        ([(9, 9), (2, 0.125), (3, 3), (3, 3)], False),  # 4.0 against 3.0
    ],
)
def test_ours_is_timed_on_both_ways_to_multiply_and_counts_at_the_faster(
    fma_passes: list[tuple[float, float]], fma_wins: bool
) -> None:
    kernel_passes = [(9, 9), (1, 0.125), (5, 5), (5, 5)]  # best 3.0
    other_passes = [(9, 9), (2, 0.25), (5, 5), (5, 5)]  # best 6.0
    readings = _scripted_clock(kernel_passes, other_passes, fma_passes)
    weights = [torch.ones(32, 16, dtype=torch.bfloat16)]
    was = torch.ops.infercloud.set_linear_bf16_fma(False)
    try:
        times = time_linear_paths(
            weights, packed_other=False, clock=lambda: next(readings), fma=True
        )
        assert torch.ops.infercloud.set_linear_bf16_fma(False) is False  # left as found
    finally:
        torch.ops.infercloud.set_linear_bf16_fma(was)
    assert times == LinearTimes(3.0, 6.0, _best(fma_passes))
    assert times.fma_wins is fma_wins
    assert times.best_kernel_s == min(3.0, _best(fma_passes)) and times.kernel_wins
    assert next(readings, None) is None


def _linear_types(llm: LLM) -> set[type]:
    return {type(m) for m in llm.engine.runner.model.modules() if "Linear" in type(m).__name__}


@pytest.mark.parametrize("dtype", _dtypes_ours_takes())
def test_auto_times_both_paths_and_builds_the_faster(tiny_model_dir: Path, dtype: str) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype=dtype)
    times = llm.engine.linear_times
    assert times is not None and times.kernel_s > 0 and times.other_s > 0
    assert llm.engine.linear_kernel is times.kernel_wins
    assert _linear_types(llm) == {KernelLinear if times.kernel_wins else PackedLinear}
    # bfloat16 without the tile unit: vdpbf16ps and multiply-adds timed, the faster one set
    timed_fma = dtype == "bfloat16" and not torch.ops.infercloud.has_linear_tiles()
    assert (times.kernel_fma_s is not None) is timed_fma
    assert llm.engine.runner.linear_fma is (times.kernel_wins and times.fma_wins)
    if times.kernel_wins and dtype == "bfloat16":
        on = llm.engine.runner.linear_fma
        assert torch.ops.infercloud.set_linear_bf16_fma(on) is on
    out = llm.generate([[5, 6, 7, 8, 9] * 8], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("dtype", _dtypes_ours_takes())
@pytest.mark.parametrize(("choice", "layer"), [("kernel", KernelLinear), ("onednn", PackedLinear)])
def test_an_explicit_choice_is_not_timed(
    tiny_model_dir: Path, choice: str, layer: type, dtype: str
) -> None:
    if layer is PackedLinear and dtype == "bfloat16" and not can_pack_bf16():
        pytest.skip("oneDNN does not pack bfloat16 here")
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype=dtype, linear_kernel=choice)
    assert llm.engine.linear_times is None
    assert _linear_types(llm) == {layer}


def test_float16_is_not_timed(tiny_model_dir: Path) -> None:
    """Our kernels take bfloat16 and float32 only: nothing to choose between."""
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype="float16")
    assert llm.engine.linear_times is None and not llm.engine.linear_kernel


def can_pack_bf16() -> bool:
    return can_pack(torch.device("cpu"), torch.bfloat16)
