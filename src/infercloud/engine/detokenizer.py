"""Incremental detokenization with stop strings, safe across multi-byte characters.

Text is produced by decoding a short window of tokens twice, with and without the newest ones,
and emitting the difference. A window that ends inside a multi-byte character decodes to the
replacement character U+FFFD; then nothing is emitted until a later token completes it.

Stop strings: the full output text is searched for each stop string; on a match the text is cut
there (after it, with `include_stop_str_in_output`) and the request stops. While a request runs,
the last `len(longest stop) - 1` characters are held back from the stream, so a client never sees
the start of a stop string that later completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Tokens of the prompt kept in the first window, so that a tokenizer that drops a leading
# space at the start of a decode does not drop it at the first output token.
_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    decoder: Decoder
    stop: list[str]
    include_stop_str_in_output: bool
    token_ids: list[int]
    """Prompt then output tokens; the detokenizer appends output tokens to it."""
    prefix_offset: int = 0
    read_offset: int = 0
    output_text: str = ""
    num_emitted_chars: int = 0
    matched_stop: str | None = None
    _hold_chars: int = field(default=0)

    @classmethod
    def for_prompt(
        cls,
        decoder: Decoder,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
    ) -> IncrementalDetokenizer:
        n = len(prompt_token_ids)
        return cls(
            decoder=decoder,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            token_ids=list(prompt_token_ids),
            prefix_offset=max(0, n - _PROMPT_CONTEXT_TOKENS),
            read_offset=n,
            _hold_chars=max((len(s) for s in stop), default=1) - 1,
        )

    def add_token(self, token_id: int) -> bool:
        """Append one output token; True if a stop string matched (the request should stop)."""
        self.token_ids.append(token_id)
        prefix = self.decoder.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        text = self.decoder.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return False
        delta = text[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        search_from = max(0, len(self.output_text) - self._hold_chars)
        self.output_text += delta
        return self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.matched_stop = stop
        return True

    def take_new_text(self, finished: bool) -> str:
        """Text not yet emitted; holds back a possible stop-string start unless finished."""
        limit = len(self.output_text) if finished else len(self.output_text) - self._hold_chars
        if limit <= self.num_emitted_chars:
            return ""
        new = self.output_text[self.num_emitted_chars : limit]
        self.num_emitted_chars = limit
        return new
