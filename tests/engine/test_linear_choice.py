"""`linear_kernel="auto"`: our GEMM or oneDNN's, whichever the timing at engine start favours."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.linear_choice import LinearTimes, layer_shapes, time_linear_paths
from infercloud.engine.llm import LLM
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.packed_linear import KernelLinear, PackedLinear
from infercloud.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (load_kernels() and torch.ops.infercloud.has_linear_bf16()),
    reason=f"no AVX512-BF16 linear kernel here: {load_error() or 'CPU without AVX512-BF16'}",
)


def test_layer_shapes_are_the_decoder_layers_projections(real_model_dir: Path) -> None:
    config = ModelConfig.from_folder(real_model_dir)
    # SmolLM2-135M: 9 heads and 3 KV heads of 64, hidden 576, intermediate 1536
    assert layer_shapes(config) == [(960, 576), (576, 576), (3072, 576), (1536, 576)]


def _scripted_clock(kernel_pass_s: list[float], other_pass_s: list[float]) -> Iterator[float]:
    """Readings for passes in the order `time_linear_paths` runs them: a warm-up of each path,
    then kernel and other alternately; each pass reads the clock at its start and end."""
    now = 0.0
    order = [kernel_pass_s[0], other_pass_s[0]]
    for k, o in zip(kernel_pass_s[1:], other_pass_s[1:], strict=True):
        order += [k, o]
    for seconds in order:
        yield now
        now += seconds
        yield now


@pytest.mark.parametrize(
    ("kernel_pass_s", "other_pass_s", "kernel_wins"),
    [
        ([9.0, 3.0, 2.0, 4.0], [9.0, 5.0, 6.0, 2.5], True),  # best 2.0 vs 2.5
        ([1.0, 3.0, 2.75, 4.0], [9.0, 5.0, 2.5, 2.625], False),  # warm-ups do not count
    ],
)
def test_the_best_timed_pass_of_each_path_decides(
    kernel_pass_s: list[float], other_pass_s: list[float], kernel_wins: bool
) -> None:
    readings = _scripted_clock(kernel_pass_s, other_pass_s)
    times = time_linear_paths([(32, 16)], packed_other=False, clock=lambda: next(readings))
    assert times == LinearTimes(min(kernel_pass_s[1:]), min(other_pass_s[1:]))
    assert times.kernel_wins is kernel_wins
    assert next(readings, None) is None  # every pass was timed, none twice


def _linear_types(llm: LLM) -> set[type]:
    return {type(m) for m in llm.engine.runner.model.modules() if "Linear" in type(m).__name__}


def test_auto_times_both_paths_and_builds_the_faster(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype="bfloat16")
    times = llm.engine.linear_times
    assert times is not None and times.kernel_s > 0 and times.other_s > 0
    assert llm.engine.linear_kernel is times.kernel_wins
    assert _linear_types(llm) == {KernelLinear if times.kernel_wins else PackedLinear}
    out = llm.generate([[5, 6, 7, 8, 9] * 8], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize(("choice", "layer"), [("kernel", KernelLinear), ("onednn", PackedLinear)])
def test_an_explicit_choice_is_not_timed(tiny_model_dir: Path, choice: str, layer: type) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype="bfloat16", linear_kernel=choice)
    assert llm.engine.linear_times is None
    assert _linear_types(llm) == {layer}


def test_float32_is_not_timed(tiny_model_dir: Path) -> None:
    """Our kernel takes bfloat16 only: nothing to choose between."""
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, dtype="float32")
    assert llm.engine.linear_times is None and not llm.engine.linear_kernel
