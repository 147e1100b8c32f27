"""Prompts to token ids, one way for everyone: the engine that computes them and the gateway
that counts them and routes by their cached blocks must agree on every id, or a router's block
hashes would never match the engine's."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from infercloud.models.segment_encoder import SegmentEncoder


def load_tokenizer(folder: Path) -> Any:
    """The Hugging Face tokenizer of a model folder (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def content_text(content: str | list[Any] | None) -> str:
    """A chat message's text: a string, or the `text` of each content part, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(part.get("text", "")) if isinstance(part, dict) else str(getattr(part, "text", ""))
        for part in content
    )


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied (with the generation prompt), then tokenized without adding
    special tokens again. Raises whatever the template raises on messages it refuses.

    A repeated long part (a system prompt, tool definitions) is encoded once per process
    (`SegmentEncoder`, one per tokenizer): the same ids, without the cost."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return segment_encoder(tokenizer).encode(text)


_encoders: weakref.WeakKeyDictionary[Any, SegmentEncoder] = weakref.WeakKeyDictionary()


def segment_encoder(tokenizer: Any) -> SegmentEncoder:
    """The tokenizer's `SegmentEncoder` (made on first use, dropped with the tokenizer)."""
    encoder = _encoders.get(tokenizer)
    if encoder is None:
        encoder = _encoders[tokenizer] = SegmentEncoder(tokenizer)
    return encoder


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt's ids (with the tokenizer's own special tokens, as OpenAI's API),
    repeated long parts encoded once (`SegmentEncoder`)."""
    return segment_encoder(tokenizer).encode(text, special=True)
