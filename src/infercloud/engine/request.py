"""One generation request as the engine sees it: its tokens and how far they are computed.

There are no prefill and decode phases. A request has `num_tokens` tokens (prompt plus output so
far) and `num_computed_tokens` of them have their keys and values in the KV cache. Each step the
scheduler lets `num_computed_tokens` catch up with `num_tokens` by some amount; when it catches up
the model's logits at the last token give the next output token. Preemption by recompute resets
`num_computed_tokens` to 0 and keeps the tokens, so the request later recomputes its whole
context (prompt and output so far) and continues where it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infercloud.engine.request_meter import RequestMeter
from infercloud.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(slots=True)
class Request:
    """Mutable engine-side state of one request. Only the scheduler changes `status`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    priority: int = 0
    """Lower runs first (vLLM's convention); ties go to the earlier arrival."""
    max_total_tokens: int = 0
    """Context limit for this request (prompt + output); set by the engine."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time_s: float | None = None
    cache_salt: str = ""
    """Prefix-cache namespace: only requests with the same salt share cached blocks."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at first admission (None before it)."""
    meter: RequestMeter = field(default_factory=RequestMeter)
    """What it used of the replica so far (the engine charges it each step)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens `start .. end - 1` of prompt + output, without building the concatenation."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
