"""The SSE relay: bytes pass through in any split, the usage is read (and stripped when the
client did not ask for it), and the end of the stream is noticed."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from infercloud.gateway.sse import UsageRelay, _has_token

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def stream() -> bytes:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "hé"}}]},
        {"choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": USAGE},
    ]
    body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    return body + b"data: [DONE]\n\n"


@given(st.lists(st.integers(1, 400), max_size=12), st.booleans())
def test_any_split_relays_the_stream_and_reads_its_usage(cuts: list[int], want: bool) -> None:
    data = stream()
    points = sorted({min(c, len(data)) for c in cuts})
    blocks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    relay = UsageRelay(want_usage=want)
    out = b"".join(relay.feed(block) for block in blocks)
    out += relay.finish()
    assert relay.usage == USAGE and relay.saw_token and relay.saw_done
    expected = (
        data
        if want
        else data.replace(f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode(), b"")
    )
    assert out == expected


def test_the_end_is_seen_only_once_the_done_event_is_whole() -> None:
    relay = UsageRelay(want_usage=True)
    relay.feed(stream()[:-4])
    assert not relay.saw_done
    relay.feed(stream()[-4:])
    assert relay.saw_done


def test_a_token_that_mentions_done_is_not_the_end() -> None:
    relay = UsageRelay(want_usage=True)
    token = {"choices": [{"index": 0, "delta": {"content": 'print("data: [DONE]")'}}]}
    relay.feed(f"data: {json.dumps(token)}\n\n".encode())
    assert relay.saw_token and not relay.saw_done


def test_an_answer_without_text_has_its_first_token_at_its_end() -> None:
    """Tokens that decode to no text send no event of their own; the choice's end is then the
    first sign of output (the usage record's time to first token), a role chunk is not."""
    relay = UsageRelay(want_usage=True)
    relay.feed(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
    assert not relay.saw_token
    relay.feed(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n')
    assert relay.saw_token


class SplittingRelay(UsageRelay):
    """The relay as it was first written: every block split into all its events, each event
    that mentions usage parsed. The relay now finds those events without splitting the rest;
    it must relay exactly the same bytes and read the same usage (streams without stray blank
    lines: given one after an event that it parsed, this version dropped it)."""

    def feed(self, block: bytes) -> bytes:
        data = self._buffer + block if self._buffer else block
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buffer = data
            return b""
        complete, self._buffer = data[: cut + 2], data[cut + 2 :]
        events = complete[:-2].split(b"\n\n")
        if not self.saw_data and b"data: {" in complete:
            self.saw_data = True
        if self.saw_data and not self.saw_token:
            self.saw_token = any(_has_token(e) for e in events)
        if b"[DONE]" in complete and not self.saw_done:
            self.saw_done = any(e.strip() == b"data: [DONE]" for e in events)
        if b'"usage"' not in complete:
            return complete
        return b"".join(self._event(e) for e in events)


EVENTS = [
    b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"content": "the \\"usage\\" key"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"content": "data: [DONE]"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}], '
    b'"usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, '
    b'"total_tokens": 5}}\n\n',
    b'data: {"choices": [], "usage": null}\n\n',
    b'data: {"usage": not json}\n\n',
    b": ping\n\n",
    b"data: [DONE]\n\n",
    b"  data: [DONE] \n\n",
]


@given(
    st.lists(st.sampled_from(EVENTS), max_size=14),
    st.lists(st.integers(0, 2000), max_size=10),
    st.booleans(),
)
def test_the_relay_passes_what_splitting_every_event_passed(
    events: list[bytes], cuts: list[int], want: bool
) -> None:
    data = b"".join(events)
    points = sorted({min(c, len(data)) for c in cuts})
    blocks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    relay, reference = UsageRelay(want_usage=want), SplittingRelay(want_usage=want)
    for block in blocks:
        assert relay.feed(block) == reference.feed(block)
        assert (relay.saw_token, relay.saw_done) == (reference.saw_token, reference.saw_done)
    assert relay.finish() == reference.finish()
    assert relay.usage == reference.usage and relay.saw_done == reference.saw_done


def test_stray_blank_lines_around_a_usage_event_are_kept_and_its_usage_read() -> None:
    usage = b'"usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}'
    event = b'data: {"choices": [{"index": 0, "text": "x"}], ' + usage + b"}\n\n"
    relay = UsageRelay(want_usage=True)
    assert relay.feed(event + b"\n") == event + b"\n"
    assert relay.usage == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    relay = UsageRelay(want_usage=False)
    only_usage = b'data: {"choices": [], ' + usage.replace(b"1", b"4") + b"}\n\n"
    assert relay.feed(b": ping\n\n\n" + only_usage + b"\n\n") == b": ping\n\n\n\n\n"
    assert relay.usage == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 2}
