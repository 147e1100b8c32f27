from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from infercloud.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def stream(tokenizer, text: str, stop: list[str], include: bool = False) -> tuple[list[str], bool]:  # type: ignore[no-untyped-def]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer.for_prompt(tokenizer.backend_tokenizer, [5], stop, include)
    pieces, stopped = [], False
    for i, t in enumerate(ids):
        stopped = detok.add_token(t)
        last = stopped or i == len(ids) - 1
        pieces.append(detok.take_new_text(finished=last))
        if stopped:
            break
    return pieces, stopped


def test_multibyte_characters_stream_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Café 日本語 😀 über"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    pieces, _ = stream(tokenizer, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_output_and_is_never_streamed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces, stopped = stream(tokenizer, "Paris is the capital of France.", ["capital"])
    assert stopped
    assert "".join(pieces) == "Paris is the "
    assert not any("cap" in p for p in pieces)


def test_stop_string_included_when_asked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces, stopped = stream(tokenizer, "Paris is the capital of France.", ["capital"], True)
    assert stopped and "".join(pieces) == "Paris is the capital"
