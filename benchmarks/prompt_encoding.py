"""Chat prompts to token ids with a repeated long system prompt: whole vs piece by piece.

The gateway (counting and routing) and the engine server (computing) both turn every chat
request into token ids in their event loop. Agents resend the same system prompt and tool
definitions each call; `SegmentEncoder` encodes such a piece once. This times both ways on the
embedded SmolLM2 tokenizer, each request with a new user turn, and checks they give the same ids.

    .venv/bin/python benchmarks/prompt_encoding.py [--requests 300] [--out F]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from infercloud.models.prompts import chat_prompt_ids, load_tokenizer
from infercloud.models.registry import prepare_default_model

WORDS = "the repository notes tool definitions system rules function call returns json schema"


def whole_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(prepare_default_model())
    rng = random.Random(0)
    words = WORDS.split()
    results: dict[str, Any] = {}
    for label, system_words in (("long_system_prompt", 1500), ("short_system_prompt", 4)):
        system = " ".join(rng.choice(words) for _ in range(system_words))
        turns = [f"fix the failing test number {i}, please" for i in range(args.requests)]

        def messages(turn: str, system: str = system) -> list[dict[str, str]]:
            return [{"role": "system", "content": system}, {"role": "user", "content": turn}]

        same = all(
            chat_prompt_ids(tokenizer, messages(t)) == whole_ids(tokenizer, messages(t))
            for t in turns[:20]
        )
        timings = {}
        for name, fn in (("whole", whole_ids), ("segmented", chat_prompt_ids)):
            start = time.perf_counter()
            for turn in turns:
                ids = fn(tokenizer, messages(turn))
            timings[name] = (time.perf_counter() - start) / len(turns) * 1e3
        results[label] = {
            "prompt_tokens": len(ids),
            "whole_ms": round(timings["whole"], 4),
            "segmented_ms": round(timings["segmented"], 4),
            "speedup": round(timings["whole"] / timings["segmented"], 1),
            "same_ids": same,
        }
        print(label, json.dumps(results[label]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
