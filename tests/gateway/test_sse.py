"""The SSE relay: bytes pass through in any split, the usage is read (and stripped when the
client did not ask for it), and the end of the stream is noticed."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from infercloud.gateway.sse import UsageRelay

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
