from __future__ import annotations

import math

import pytest
import torch

from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.sampler import SamplingRow, sample
from infercloud.engine.sampling_params import SamplingParams


def row(params: SamplingParams, seed: int = 0, suppressed: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(params, torch.Generator().manual_seed(seed), suppressed)


def logits(n: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits()
    out = sample(x.clone(), [row(SamplingParams(temperature=0))] * 3)
    assert out.token_ids == x.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does() -> None:
    """Ties (the first wins), a NaN (it wins, as in argmax), a row of -inf; all rows greedy and
    greedy rows mixed with a sampled one take the same path to the same ids."""
    x = logits(n=5, vocab=64)
    x[:, 10] = x[:, 40] = 100.0
    x[1, 3] = 100.0
    x[2, 50] = float("nan")
    x[3] = float("-inf")
    want = x.argmax(-1).tolist()
    assert want[:4] == [10, 3, 50, 0]
    greedy = row(SamplingParams(temperature=0))
    assert sample(x.clone(), [greedy] * 5).token_ids == want
    mixed = sample(x.clone(), [greedy] * 4 + [row(SamplingParams(temperature=1.0), seed=1)])
    assert mixed.token_ids[:4] == want[:4]
    if load_kernels():
        assert sample(x.clone(), [greedy] * 5, greedy_kernel=True).token_ids == want
        mixed = sample(
            x.clone(),
            [greedy] * 4 + [row(SamplingParams(temperature=1.0), seed=1)],
            greedy_kernel=True,
        )
        assert mixed.token_ids[:4] == want[:4]


@pytest.mark.skipif(not load_kernels(), reason=f"CPU kernels: {load_error()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 16, 17, 33, 49152])
def test_greedy_kernel_agrees_with_max_indices(width: int, dtype: torch.dtype) -> None:
    """Ties among few distinct values, NaNs early and late, +inf, rows of -inf, widths around
    the kernel's 16 lanes and its tail: the same index as `max(dim=-1).indices` (bfloat16
    logits: as on their float32 copy)."""
    generator = torch.Generator().manual_seed(width)
    for trial in range(40):
        x = torch.randint(-3, 4, (6, width), generator=generator).to(dtype)
        noise = torch.rand(x.shape, generator=generator)
        if trial % 4 == 1:
            x[noise < 0.05] = float("nan")
        elif trial % 4 == 2:
            x[noise < 0.3] = float("inf")
        elif trial % 4 == 3:
            x[:3] = float("-inf")
        got = torch.ops.infercloud.greedy_tokens(x)
        assert torch.equal(got, x.float().max(dim=-1).indices), (trial, x, got)
    x = torch.zeros(2, width, dtype=dtype)
    x[1, -1] = float("nan")  # a NaN in the last lane or the tail still wins
    assert torch.ops.infercloud.greedy_tokens(x).tolist() == [0, width - 1]
    if width > 1:  # values that differ only below bfloat16's 8 bits of mantissa stay tied
        y = torch.full((1, width), 1.0, dtype=dtype)
        y[0, -1] = 1.0078125  # the next bfloat16 after 1.0
        assert torch.ops.infercloud.greedy_tokens(y).tolist() == [width - 1]


@pytest.mark.skipif(not load_kernels(), reason=f"CPU kernels: {load_error()}")
def test_bfloat16_logits_sample_as_their_float32_copy() -> None:
    """The model hands over bfloat16 logits: a batch of greedy rows takes its argmax on them
    directly, and every other batch (a sampled row, logprobs, suppressed tokens) is widened
    first; either way the same tokens and logprobs as from the float32 copy."""
    x = logits(n=4, vocab=300, seed=3).to(torch.bfloat16)
    greedy = row(SamplingParams(temperature=0))
    wide = sample(x.float(), [greedy] * 4, greedy_kernel=True)
    assert sample(x.clone(), [greedy] * 4, greedy_kernel=True).token_ids == wide.token_ids
    assert wide.token_ids == x.float().argmax(-1).tolist()

    def rows() -> list[SamplingRow]:  # fresh generators for each run
        return [
            greedy,
            row(SamplingParams(temperature=0.8), seed=5),
            row(SamplingParams(logprobs=2)),
            row(SamplingParams(temperature=0), suppressed=(int(wide.token_ids[3]),)),
        ]

    got = sample(x.clone(), rows(), greedy_kernel=True)
    want = sample(x.float(), rows(), greedy_kernel=True)
    assert got.token_ids == want.token_ids
    assert got.token_ids[3] != wide.token_ids[3]
    assert got.logprobs == want.logprobs


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits()
    best = x.argmax(-1).tolist()
    assert sample(x.clone(), [row(SamplingParams(top_k=1))] * 3).token_ids == best
    assert sample(x.clone(), [row(SamplingParams(top_p=1e-6))] * 3).token_ids == best


def test_seed_reproducible_and_batch_independent() -> None:
    x = logits(n=1, vocab=1000)
    params = SamplingParams(temperature=1.0, seed=7)
    draws_a = [sample(x.clone(), [row(params, seed=7)]).token_ids[0] for _ in range(1)]
    # same seed, other rows in the batch: the seeded row draws the same token
    mixed = torch.cat([logits(n=2, vocab=1000, seed=5), x])
    unseeded = row(SamplingParams(temperature=1.0), seed=99)
    draws_b = sample(mixed, [unseeded, unseeded, row(params, seed=7)]).token_ids[2]
    assert draws_a[0] == draws_b


def test_top_k_restricts_support() -> None:
    x = logits(n=1, vocab=100)
    allowed = set(x[0].topk(5).indices.tolist())
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=2.0, top_k=5)
    for _ in range(50):
        token = sample(x.clone(), [SamplingRow(params, gen, ())]).token_ids[0]
        assert token in allowed


def test_suppressed_tokens_are_never_drawn() -> None:
    x = torch.zeros(1, 10)
    x[0, 4] = 100.0
    out = sample(x, [row(SamplingParams(temperature=0), suppressed=(4,))])
    assert out.token_ids[0] != 4


def test_logprobs_are_raw_log_softmax() -> None:
    x = logits(n=1)
    expected = torch.log_softmax(x, -1)[0]
    out = sample(x.clone(), [row(SamplingParams(temperature=0.5, logprobs=3, seed=1))])
    lp = out.logprobs[0]
    assert lp is not None
    assert math.isclose(lp.logprob, float(expected[lp.token_id]), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()


def frequencies(x: torch.Tensor, params: SamplingParams, draws: int) -> list[float]:
    """Share of each token over `draws` draws from the one row of logits `x`."""
    gen = torch.Generator().manual_seed(11)
    counts = [0] * x.shape[1]
    for token in sample(x.repeat(draws, 1), [SamplingRow(params, gen, ())] * draws).token_ids:
        counts[token] += 1
    return [c / draws for c in counts]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax_of_logits_over_temperature(temperature: float) -> None:
    """20,000 draws: each token's share within 0.015 (over 4 standard deviations) of
    softmax(logits / T). A sampler that ignored the temperature would be off by 0.09 or more."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    want = torch.softmax(x[0] / temperature, -1).tolist()
    got = frequencies(x, SamplingParams(temperature=temperature), 20_000)
    assert all(abs(g - w) < 0.015 for g, w in zip(got, want, strict=True)), (got, want)


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.75, 2), (0.9, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_nucleus_and_renormalizes(top_p: float, kept: int) -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p keeps the most likely tokens until their mass
    reaches top_p (0.4 -> 1 token, 0.75 -> 2, 0.9 -> 3, 1.0 -> all) and draws among them in
    proportion to their probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().unsqueeze(0)
    want = [
        p / float(probs[:kept].sum()) if i < kept else 0.0 for i, p in enumerate(probs.tolist())
    ]
    got = frequencies(x, SamplingParams(temperature=1.0, top_p=top_p), 20_000)
    assert all(abs(g - w) < 0.015 for g, w in zip(got, want, strict=True)), (got, want)
    assert all(g == 0.0 for g in got[kept:])
