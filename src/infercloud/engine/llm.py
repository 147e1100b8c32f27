"""The offline API: generate for a list of prompts, blocking, results in input order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from infercloud.engine.config import EngineConfig
from infercloud.engine.llm_engine import LLMEngine
from infercloud.engine.request_meter import RequestMeter
from infercloud.engine.sampler import TokenLogprobs
from infercloud.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens that came from the prefix cache."""
    meter: RequestMeter | None = None
    """What the request used of the engine (`request_meter`)."""


class LLM:
    """`LLM(model).generate(prompts, params)` runs every prompt batched on one engine."""

    def __init__(self, model: str, **engine_kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))  # type: ignore[arg-type]

    def encode(self, prompt: str) -> list[int]:
        return list(self.engine.tokenizer(prompt)["input_ids"])

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{id(results)}-{i}"
            self.engine.add_request(request_id, ids, p)
            results[request_id] = CompletionOutput(prompt_token_ids=ids)
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                result.logprobs.extend(out.new_logprobs)
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.stop_reason = out.stop_reason
                    result.num_cached_tokens = out.num_cached_tokens
                    result.meter = out.meter
                    pending.discard(out.request_id)
        return [results[r] for r in order]
