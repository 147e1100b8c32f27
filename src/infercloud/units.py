"""Sizes as people write them: "512MiB", "1GiB", "64k", or a plain number of bytes."""

from __future__ import annotations


def parse_bytes(text: str | int) -> int:
    if isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)
