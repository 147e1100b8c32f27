"""What one request used of its replica, measured step by step: the ledger's raw input.

Each engine step takes `step_s` of wall time for all the chunks it computes. A chunk's share is
its work: its tokens through the weight matrices plus its attention pairs, weighted by what one
pair costs against one token (`StepCostWeights`). Within a chunk, the tokens this request had
computed before (it was preempted and recomputes) or that the prefix cache once held and evicted
are *recomputed*; the rest are *new*. Every step also charges each running request for the KV
bytes it holds, a block shared by several requests split evenly among them.

Invariants:
- in one step the chunks' `compute_s + recompute_s` add up to the step's time (no time is lost
  or counted twice between the requests of a step);
- `recomputed_tokens <= ` the tokens the request computed;
- all figures only grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infercloud.cache.transfer_cost import attention_pairs


@dataclass(frozen=True, slots=True)
class StepCostWeights:
    """Relative cost of a step's parts, to split its measured time between its chunks."""

    attention_pair_tokens: float
    """What one (query, key) pair costs, in tokens through the weights."""

    @classmethod
    def for_model(
        cls, hidden_size: int, intermediate_size: int, num_kv_heads: int, head_dim: int
    ) -> StepCostWeights:
        """Per layer a token costs 2 x (attention projections + MLP) FLOPs; a pair costs
        2 x 2 x hidden (scores and the weighted sum of values); the layer count cancels."""
        kv = num_kv_heads * head_dim
        per_token = 2 * (2 * hidden_size * hidden_size + 2 * hidden_size * kv)
        per_token += 2 * 3 * hidden_size * intermediate_size
        per_pair = 4 * hidden_size
        return cls(per_pair / per_token if per_token else 0.0)


@dataclass(slots=True)
class RequestMeter:
    compute_s: float = 0.0
    """Share of step time spent computing tokens for the first time."""
    recompute_s: float = 0.0
    """Share of step time spent computing tokens again (preempted, or evicted from the cache)."""
    recomputed_tokens: int = 0
    kv_byte_s: float = 0.0
    """KV cache bytes held x seconds held."""
    computed_high_water: int = 0
    """Tokens whose keys and values this request has computed at least once."""
    evicted_prefix_tokens: int = 0
    """Prompt tokens the prefix cache held for this prompt once but had evicted at admission:
    computing them is recompute."""

    def charge_chunk(self, start: int, num_tokens: int, chunk_s: float) -> None:
        """This request computed tokens `start .. start + num_tokens - 1` in `chunk_s`."""
        if num_tokens <= 0:
            return
        seen = max(self.computed_high_water, self.evicted_prefix_tokens)
        again = max(0, min(start + num_tokens, seen) - start)
        self.recomputed_tokens += again
        self.recompute_s += chunk_s * again / num_tokens
        self.compute_s += chunk_s * (num_tokens - again) / num_tokens
        self.computed_high_water = max(self.computed_high_water, start + num_tokens)

    def as_usage(self) -> dict[str, Any]:
        """The usage extension a replica reports (`usage.infercloud`)."""
        return {
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_byte_s": self.kv_byte_s,
        }


def split_step(
    chunks: list[tuple[int, int]], step_s: float, weights: StepCostWeights
) -> list[float]:
    """Each chunk's share of `step_s` by its work; the shares add up to `step_s`."""
    work = [n + weights.attention_pair_tokens * attention_pairs(start, n) for start, n in chunks]
    total = sum(work)
    if total <= 0:
        return [step_s / len(chunks)] * len(chunks) if chunks else []
    return [step_s * w / total for w in work]
