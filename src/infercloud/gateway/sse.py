"""Relaying a replica's server-sent events: pass bytes through, read the usage on the way.

The gateway asks every replica for the usage chunk (`stream_options.include_usage`), because
the usage record needs it, and removes it again when the client did not ask for it. Everything
else passes through as the replica sent it, in blocks as they arrive: `feed` returns the
complete events of what it has seen so far (an event ends with a blank line), holding back only
a partial event at the end, and it parses an event only when its bytes mention "usage".

Invariant: the concatenation of everything returned is the input, less the usage chunk (or the
usage field) when it is stripped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic_core import from_json, to_json

_END = b"\n\n"


class UsageRelay:
    __slots__ = ("_buffer", "saw_data", "saw_done", "saw_token", "usage", "want_usage")

    def __init__(self, want_usage: bool) -> None:
        self.want_usage = want_usage
        self.usage: dict[str, Any] | None = None
        self.saw_data = False
        """True once an event with a JSON payload passed."""
        self.saw_token = False
        """True once an event carried generated text, or a choice's end (the first token is
        out; a role-only first chunk does not count). The end counts for an answer whose tokens
        all decode to no text: a replica sends no event for a token without text, and the
        usage record would otherwise have no time to first token. Events are parsed for this
        only until it is true."""
        self.saw_done = False
        """True once the stream's last event (`data: [DONE]`, a whole event, not text that
        mentions it) passed."""
        self._buffer = b""

    def feed(self, block: bytes) -> bytes:
        data = self._buffer + block if self._buffer else block
        cut = data.rfind(_END)
        if cut < 0:
            self._buffer = data
            return b""
        complete, self._buffer = data[: cut + 2], data[cut + 2 :]
        if not self.saw_data and b"data: {" in complete:
            self.saw_data = True
        if self.saw_data and not self.saw_token:
            self.saw_token = any(_has_token(e) for e in complete[:-2].split(_END))
        if not self.saw_done and b"[DONE]" in complete:
            self.saw_done = any(
                complete[a:b].strip() == b"data: [DONE]"
                for a, b in _events_with(complete, b"[DONE]")
            )
        if b'"usage"' not in complete:
            return complete
        # only the events that mention usage are parsed; the rest pass as they are
        out: list[bytes] = []
        pos = 0
        for a, b in _events_with(complete, b'"usage"'):
            out.append(complete[pos:a])
            out.append(self._event(complete[a:b]))
            pos = b + 2
        out.append(complete[pos:])
        return b"".join(out)

    def finish(self) -> bytes:
        """What is left at the end of the stream (a last event without its blank line)."""
        rest, self._buffer = self._buffer, b""
        if not rest.strip():
            return rest
        if rest.strip() == b"data: [DONE]":
            self.saw_done = True
        return b"".join(self._event(e) for e in rest.rstrip(b"\n").split(_END))

    def _event(self, event: bytes) -> bytes:
        if not (event.startswith(b"data: {") and b'"usage"' in event):
            return event + _END
        try:
            chunk = from_json(event[6:])
        except ValueError:
            return event + _END
        if not isinstance(chunk, dict) or not chunk.get("usage"):
            return event + _END
        self.usage = chunk["usage"]
        if self.want_usage:
            return event + _END
        if not chunk.get("choices"):
            return b""  # the usage-only chunk the client did not ask for
        del chunk["usage"]
        return b"data: " + to_json(chunk) + _END


def _events_with(complete: bytes, needle: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each event of `complete` (whole events, each ending with a blank line)
    that contains `needle` (which holds no newline, so never runs over an event's end), in
    order, found without splitting `complete` into all its events (when the gateway is busy a
    block holds a whole stream, and most events need no look). An event starts after the last
    blank line before it, so stray blank lines between events stay outside every event."""
    found = complete.find(needle)
    while found >= 0:
        end = complete.find(_END, found)
        before = complete.rfind(_END, 0, found)
        yield (before + 2 if before >= 0 else 0), end
        found = complete.find(needle, end + 2)


def _has_token(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    try:
        chunk = from_json(event[6:])
    except ValueError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    for c in choices or ():
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if (
            c.get("text")
            or c.get("finish_reason")
            or (isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")))
        ):
            return True
    return False
