"""Sampling fields through the engine server's HTTP API (the engine-level tests cover the sampler
itself): seeds, top_k, stop_token_ids, min_tokens and the completions logprobs format, sent
as the `openai` client sends them, and the token counters in /metrics."""

from __future__ import annotations

from pathlib import Path

import openai
from tokenizers import Tokenizer

from tests.conftest import EngineServer

PROMPT = [5, 17, 42, 99, 7, 23, 61, 8]  # token ids: no tokenizer round trip in the prompt


def complete(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    body: dict[str, object] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12}
    extra = kwargs.pop("extra_body", {})
    body.update(kwargs)
    return client.completions.create(**body, extra_body=extra)  # type: ignore[call-overload, no-any-return]


def test_seed_reproduces_a_sampled_completion(client: openai.OpenAI) -> None:
    def sampled(seed: int) -> str:
        out = complete(client, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return out.choices[0].text

    first = sampled(7)
    assert sampled(7) == first
    assert any(sampled(seed) != first for seed in (8, 9, 10))


def test_top_k_one_is_greedy(client: openai.OpenAI) -> None:
    greedy = complete(client, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    for seed in (1, 2):
        top1 = complete(
            client, temperature=1.5, seed=seed, extra_body={"ignore_eos": True, "top_k": 1}
        )
        assert top1.choices[0].text == greedy
    # top_k=-1 is vLLM's "no limit", not an error
    assert complete(client, temperature=0, extra_body={"top_k": -1}).choices[0].text


def test_completion_logprobs_format(client: openai.OpenAI) -> None:
    out = complete(client, temperature=0, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = out.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == out.text
    # each offset is where its token starts in the text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 2
        # greedy: the chosen token is the most likely one (entries are keyed by text, so two
        # tokens with the same text share one key: compare as bounds)
        assert token in top and max(top.values()) <= logprob + 1e-4


def _ids_decoding_to(tokenizer: Tokenizer, text: str) -> list[int]:
    return [
        i
        for i in range(tokenizer.get_vocab_size())
        if tokenizer.decode([i], skip_special_tokens=False) == text
    ]


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    greedy = complete(client, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    tokens = greedy.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens is not None
    # the first token from the third on whose text no earlier token has: generation must stop
    # exactly there when its ids are stop ids
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop_ids = _ids_decoding_to(tokenizer, tokens[at])
    assert stop_ids

    # ignore_eos: EOS must not end the greedy run first (stop ids still apply, as in vLLM)
    stopped = complete(
        client, temperature=0, extra_body={"stop_token_ids": stop_ids, "ignore_eos": True}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == at + 1
    assert stopped.choices[0].text.startswith("".join(tokens[:at]))

    # min_tokens keeps stop ids (and EOS) from being drawn before that many tokens
    floor = at + 2
    held = complete(
        client,
        temperature=0,
        max_tokens=floor + 4,
        extra_body={"stop_token_ids": stop_ids, "min_tokens": floor, "ignore_eos": True},
    )
    assert held.usage is not None and held.usage.completion_tokens > floor
    assert held.choices[0].text.startswith("".join(tokens[:at]))


def test_metrics_count_prompt_and_generation_tokens(
    client: openai.OpenAI, tiny_server: EngineServer
) -> None:
    prompt_before = tiny_server.metric("infercloud:prompt_tokens_total", default=0.0)
    generated_before = tiny_server.metric("infercloud:generation_tokens_total", default=0.0)
    out = complete(client, temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage is not None
    assert tiny_server.metric("infercloud:prompt_tokens_total") == prompt_before + len(PROMPT)
    assert tiny_server.metric("infercloud:generation_tokens_total") == generated_before + 5
