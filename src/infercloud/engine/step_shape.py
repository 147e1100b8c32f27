"""What one engine step computes, in numbers a performance model can price.

A step computes, for each scheduled chunk, tokens `start .. start + num_tokens - 1` of one
request: those tokens go through every weight matrix, each attends to its whole context so far
(`start + i + 1` keys for the i-th), and the chunks that bring their request level with its
tokens sample one token through the LM head. Blocks loaded back from the second tier are copied
before the step runs. The real engine records each step's shape (`LLMEngine.last_step`); the
simulator prices it (`sim.perf_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infercloud.cache.transfer_cost import attention_pairs


@dataclass(frozen=True, slots=True)
class StepShape:
    chunks: tuple[tuple[int, int], ...]
    """(start, num_tokens) per scheduled request."""
    num_sampled: int
    """Rows that go through the LM head."""
    host_blocks_loaded: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs attended to in this step."""
        return sum(attention_pairs(start, n) for start, n in self.chunks)

    @property
    def context_tokens(self) -> int:
        """Keys each chunk reads: its whole context up to its last token."""
        return sum(start + n for start, n in self.chunks)
