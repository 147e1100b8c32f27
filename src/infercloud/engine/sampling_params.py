"""What the caller asks of generation: how to pick each token and when to stop.

Field names follow vLLM's `SamplingParams` (including its extras `ignore_eos` and `min_tokens`)
so that benchmark clients written for vLLM work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Generation settings of one request.

    `temperature == 0` means greedy. `top_k == 0` (or a value >= vocab size) disables top-k;
    `top_p == 1` disables nucleus sampling. `max_tokens is None` means "until the context is
    full". `logprobs` is the number of most likely alternatives reported per token (0 reports the
    sampled token's own log probability only; None reports nothing).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
