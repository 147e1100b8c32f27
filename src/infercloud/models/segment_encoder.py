"""Token ids of prompts whose long parts repeat, each long part encoded once.

Agents resend the same system prompt and tool definitions with every call; encoding them again
each time cost 4.6 ms for a 1,500-token chat prompt here, in the event loop of the gateway (which
counts and routes by token ids) and of the engine server. A Hugging Face tokenizer splits a text
at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before anything else and encodes the
pieces between them independently, so a chat prompt's ids are the ids of its pieces, in order,
with each added token's id between them. `SegmentEncoder` cuts a text the same way, encodes
each piece (remembering the long ones, least recently used first out, bounded in characters)
and joins the ids.

Invariant: `encode(text, special)` equals the tokenizer's own ids for `text`
(`tokenizer(text, add_special_tokens=special)`). It is used only where that holds by
construction: every added token matched as it is (not normalized, no stripping of the spaces
beside it, not single-word only), and a check on probe texts at construction agrees; otherwise
every text is encoded whole, as before.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

PROBES = (
    "Hello world",
    " leading space and  double  spaces ",
    "a<|im_start|>b<|im_end|>c",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "\n\n  indented\n\tcode(x) -> y",
    "naïve café 日本語 🙂 ß",
    "tokens<|endoftext|>glued<unk>",
)
"""Texts on which the split encoding must agree with the whole one (added tokens in the middle
of words, whitespace on both sides, multi-byte characters)."""


class SegmentEncoder:
    min_cached_chars: int = 256
    """Pieces shorter than this are encoded each time (a user's turn is rarely sent twice);
    longer ones are remembered."""

    def __init__(self, tokenizer: Any, max_cached_chars: int = 8 << 20) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.max_cached_chars = max_cached_chars
        # a tokenizer without a Rust backend (a slow one) is always encoded whole
        added = self._backend.get_added_tokens_decoder() if self._backend is not None else {}
        self._id_of: dict[str, int] = {t.content: i for i, t in added.items()}
        literal = all(
            not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added.values()
        )
        # leftmost match, the longest at a position (the tokenizer's own rule for added tokens)
        alternatives = sorted(self._id_of, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(a) for a in alternatives) or r"(?!)")
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        """Piece -> its ids, 4 bytes each (a list would hold a 36-byte int object per id)."""
        self._cached_chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.split = (
            self._backend is not None
            and literal
            and all(self._split_ids(p) == self.whole_ids(p) for p in PROBES)
        )
        """True when texts are encoded piece by piece; False: whole, as the tokenizer does."""
        self._affixes = self._special_affixes() if self.split else None
        """The ids the tokenizer's post-processor puts before and after a text's own when it
        adds special tokens (a BOS, say), where that is all it does (checked on the probes)."""

    def whole_ids(self, text: str, special: bool = False) -> list[int]:
        """The tokenizer's own ids for `text`, with its special tokens added if `special`."""
        return list(self._tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode(self, text: str, special: bool = False) -> list[int]:
        """`text`'s ids (as `whole_ids`), its long pieces from the cache when seen before."""
        if not self.split or len(text) < self.min_cached_chars:
            return self.whole_ids(text, special)
        if not special:
            return self._split_ids(text)
        if self._affixes is None:
            return self.whole_ids(text, special)
        before, after = self._affixes
        return [*before, *self._split_ids(text), *after]

    def _special_affixes(self) -> tuple[list[int], list[int]] | None:
        bare, full = self.whole_ids("x"), self.whole_ids("x", special=True)
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
        if not starts:
            return None
        before, after = full[: starts[0]], full[starts[0] + len(bare) :]
        agrees = all(
            [*before, *self._split_ids(p), *after] == self.whole_ids(p, special=True)
            for p in PROBES
        )
        return (before, after) if agrees else None

    def _split_ids(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                out.extend(self._piece(text[pos : m.start()]))
            out.append(self._id_of[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self._piece(text[pos:]))
        return out

    def _piece(self, piece: str) -> Sequence[int]:
        if len(piece) < self.min_cached_chars:
            return self._encode_piece(piece)
        with self._lock:
            cached = self._cache.get(piece)
            if cached is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return cached
        ids = self._encode_piece(piece)
        with self._lock:
            self.misses += 1
            if piece not in self._cache and len(piece) <= self.max_cached_chars:
                self._cache[piece] = array("i", ids)
                self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        backend: Any = self._backend
        ids: list[int] = backend.encode(piece, add_special_tokens=False).ids
        return ids
