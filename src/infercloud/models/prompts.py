"""Prompts to token ids, one way for everyone: the engine that computes them and the gateway
that counts them and routes by their cached blocks must agree on every id, or a router's block
hashes would never match the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    special tokens again. Raises whatever the template raises on messages it refuses."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt's ids (with the tokenizer's own special tokens, as OpenAI's API)."""
    return list(tokenizer(text)["input_ids"])
