"""Prompts encoded piece by piece, long pieces remembered: the same ids as the tokenizer's own,
on the real SmolLM2 tokenizer and the tiny one, for any messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, processors

from infercloud.models.prompts import (
    chat_prompt_ids,
    load_tokenizer,
    segment_encoder,
    text_prompt_ids,
)
from infercloud.models.segment_encoder import SegmentEncoder


@pytest.fixture(scope="module")
def smollm2(real_model_dir: Path) -> Any:
    return load_tokenizer(real_model_dir)


def whole(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


SYSTEM = "You are a coding agent. Tools: " + " ".join(
    f'{{"name": "tool_{i}", "description": "does thing {i} to the repository"}}' for i in range(60)
)

TEXT = st.lists(
    st.sampled_from(
        [*"abc xyz\n\t  éß日🙂{}\"'<>|_", "<|im_start|>", "<|im_end|>", "<|endoftext|>", " the"]
    ),
    max_size=300,
).map("".join)


def test_the_real_tokenizer_is_split_and_a_repeated_system_prompt_is_encoded_once(
    smollm2: Any,
) -> None:
    encoder = SegmentEncoder(smollm2)
    assert encoder.split
    for turn in ("fix the failing test", "now run it", "fix the failing test"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}]
        text = smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert encoder.encode(text) == whole(smollm2, messages)
    assert (encoder.misses, encoder.hits) == (1, 2)  # the system prompt: once, then remembered


@settings(max_examples=60, deadline=None)
@given(system=TEXT, user=TEXT, repeat=st.booleans())
def test_any_messages_get_the_tokenizers_own_ids(
    smollm2: Any, system: str, user: str, repeat: bool
) -> None:
    messages = [{"role": "system", "content": system * (8 if repeat else 1)}]
    messages.append({"role": "user", "content": user})
    assert chat_prompt_ids(smollm2, messages) == whole(smollm2, messages)
    assert chat_prompt_ids(smollm2, messages) == whole(smollm2, messages)  # from the cache


def test_the_tiny_tokenizer_gets_its_own_ids(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    assert chat_prompt_ids(tokenizer, messages) == whole(tokenizer, messages)
    assert segment_encoder(tokenizer) is segment_encoder(tokenizer)


def test_the_cache_keeps_to_its_bound_and_drops_the_least_recent(smollm2: Any) -> None:
    encoder = SegmentEncoder(smollm2, max_cached_chars=1000)
    pieces = [f"piece {i} " + "word " * 60 for i in range(5)]  # about 310 characters each
    for p in pieces:
        assert encoder.encode(p) == encoder.whole_ids(p)
    assert sum(len(k) for k in encoder._cache) <= 1000
    assert list(encoder._cache) == pieces[-3:]
    encoder.encode(pieces[2])
    assert list(encoder._cache)[-1] == pieces[2]


def test_a_tokenizer_whose_added_tokens_strip_spaces_is_encoded_whole(smollm2: Any) -> None:
    class Stripping:
        """The SmolLM2 tokenizer, its added tokens reported as stripping spaces beside them."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.backend_tokenizer = self

        def get_added_tokens_decoder(self) -> dict[int, Any]:
            tokens = self.inner.backend_tokenizer.get_added_tokens_decoder()
            return {
                i: AddedToken(t.content, lstrip=True, normalized=False, special=True)
                for i, t in tokens.items()
            }

        def __call__(self, text: str, **kw: Any) -> Any:
            return self.inner(text, **kw)

    encoder = SegmentEncoder(Stripping(smollm2))
    assert not encoder.split
    text = "x" * 300 + "<|im_end|>" + "y" * 300
    assert encoder.encode(text) == list(smollm2(text, add_special_tokens=False)["input_ids"])


@settings(max_examples=40, deadline=None)
@given(prefix=TEXT, rest=TEXT)
def test_completion_prompts_get_the_tokenizers_own_ids(
    smollm2: Any, prefix: str, rest: str
) -> None:
    text = prefix * 6 + rest  # a long repeated part, then a new one
    assert text_prompt_ids(smollm2, text) == list(smollm2(text)["input_ids"])
    assert text_prompt_ids(smollm2, text) == list(smollm2(text)["input_ids"])


def test_a_tokenizer_that_adds_special_tokens_gets_them_around_the_pieces(smollm2: Any) -> None:
    backend = Tokenizer.from_str(smollm2.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)],
    )
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    encoder = SegmentEncoder(tokenizer)
    assert encoder.split and encoder._affixes == ([1], [2])
    text = SYSTEM + "<|im_end|>\nand then" + SYSTEM
    ids = text_prompt_ids(tokenizer, text)
    assert ids == list(tokenizer(text)["input_ids"]) and ids[0] == 1 and ids[-1] == 2
    assert encoder.encode(text) == list(tokenizer(text, add_special_tokens=False)["input_ids"])
