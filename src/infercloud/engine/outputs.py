"""What the engine reports after each step, per request: a delta, not the whole history."""

from __future__ import annotations

from dataclasses import dataclass

from infercloud.engine.request_meter import RequestMeter
from infercloud.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output.

    `finish_reason` is "stop", "length" or "abort" once `finished`; `stop_reason` is the stop
    string or stop token id that ended it (None for EOS or length).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time_s: float
    first_scheduled_time_s: float | None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (OpenAI's `cached_tokens`)."""
    meter: RequestMeter | None = None
    """What the request used of the replica (on the finishing output only)."""
