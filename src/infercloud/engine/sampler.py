"""Turn logits into tokens: greedy, temperature, top-k, top-p, seeds, min_tokens, logprobs.

Rows are processed together where the parameters allow (greedy rows in one argmax, masking in
batched ops); the draw itself is per row so that a seeded request consumes only its own
generator and gives the same tokens whatever else shares the batch.

Reported log probabilities are those of the model's raw distribution (before temperature, top-k
and top-p), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infercloud.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The `logprobs` most likely tokens with their log probabilities, best first."""


@dataclass(frozen=True, slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator
    suppressed_token_ids: tuple[int, ...]
    """Tokens that may not be drawn this step (EOS and stop ids before min_tokens)."""


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], greedy_kernel: bool = False
) -> SamplerOutput:
    """logits: `[len(rows), vocab]`, float32 or the model's dtype (widened to float32 here
    where a row needs more than its argmax). `greedy_kernel`: greedy rows through
    `torch.ops.infercloud.greedy_tokens` (the caller has loaded the CPU kernels; same indices
    as `max(dim).indices`, on bfloat16 logits too: widening is exact)."""
    argmax_only = greedy_kernel and all(
        r.params.greedy and r.params.logprobs is None and not r.suppressed_token_ids for r in rows
    )
    if not (argmax_only and logits.dtype == torch.bfloat16):
        # 32 rows of 49152 bfloat16 to float32 took 0.32 ms of an 18 ms decode step (a Zen 5
        # EPYC); a batch of greedy rows skips it
        logits = logits.float()
    num_rows, vocab = logits.shape
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    for i, row in enumerate(rows):
        if row.suppressed_token_ids:
            ids = [t for t in row.suppressed_token_ids if t < vocab]
            logits[i, ids] = float("-inf")

    # Greedy rows take `max(dim).indices`: the same index as `argmax` (the first maximum; NaN
    # wins), and on the CPU 3x faster (32 rows of 49152: 0.48 vs 1.39 ms on a Xeon); our
    # kernel's is faster again (in a decode step of 32 on an EPYC: 0.13 ms against 0.89).
    argmax = torch.ops.infercloud.greedy_tokens if greedy_kernel else _max_indices
    greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy_rows) == num_rows:
        chosen = argmax(logits)
    else:
        chosen = torch.empty(num_rows, dtype=torch.long)
        if greedy_rows:
            index = torch.tensor(greedy_rows)
            chosen[index] = argmax(logits.index_select(0, index))
    for i, row in enumerate(rows):
        if not row.params.greedy:
            chosen[i] = _draw(logits[i], row.params, row.generator)

    token_ids = chosen.tolist()
    logprobs: list[TokenLogprobs | None] = []
    for i, row in enumerate(rows):
        if raw_logprobs is None or row.params.logprobs is None:
            logprobs.append(None)
            continue
        top: list[tuple[int, float]] = []
        if row.params.logprobs > 0:
            values, indices = raw_logprobs[i].topk(row.params.logprobs)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        token = token_ids[i]
        logprobs.append(TokenLogprobs(token, float(raw_logprobs[i, token]), top))
    return SamplerOutput(token_ids, logprobs)


def _max_indices(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
