"""The engine server driven over loopback HTTP with the official `openai` client."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tests.conftest import EngineServer


def test_models_lists_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_equals_non_streaming_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        prompt="Paris is",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_streaming_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        seed=1,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.role == "assistant"
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            seed=1,
            stream=True,  # type: ignore[arg-type]
        )
        if c.choices
    )
    assert text == out.choices[0].message.content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model="tiny", prompt="A", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    # the first 3-character window after the start that has a non-space character: stopping on
    # it must cut the text just before its first occurrence
    stop = next(full[i : i + 3] for i in range(1, len(full) - 3) if full[i : i + 3].strip())
    out = client.completions.create(
        model="tiny",
        prompt="A",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


@pytest.mark.parametrize(
    ("kwargs", "error", "status"),
    [
        ({"model": "nope"}, openai.NotFoundError, 404),
        ({"temperature": -1}, openai.BadRequestError, 400),
        ({"top_p": 0}, openai.BadRequestError, 400),
        ({"max_tokens": 10**6}, openai.BadRequestError, 400),
        ({"prompt": "hello " * 2000}, openai.BadRequestError, 400),
        ({"n": 3}, openai.BadRequestError, 400),
        ({"logprobs": 50}, openai.BadRequestError, 400),
    ],
    ids=["unknown-model", "temperature", "top-p", "max-tokens", "long-prompt", "n", "logprobs"],
)
def test_bad_input_gets_openai_error_and_server_goes_on(
    client: openai.OpenAI, kwargs: dict[str, object], error: type[Exception], status: int
) -> None:
    request = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        client.completions.create(**request)  # type: ignore[call-overload]
    assert info.value.status_code == status  # type: ignore[attr-defined]
    body = info.value.body  # type: ignore[attr-defined]
    assert isinstance(body, dict) and body["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


@pytest.mark.parametrize(
    ("kwargs", "error", "status"),
    [
        ({"model": "nope"}, openai.NotFoundError, 404),
        ({"temperature": -1}, openai.BadRequestError, 400),
        ({"max_tokens": 10**6}, openai.BadRequestError, 400),
        ({"messages": [{"role": "user", "content": "hello " * 2000}]}, openai.BadRequestError, 400),
        ({"messages": []}, openai.BadRequestError, 400),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, 400),
        ({"top_logprobs": 50, "logprobs": True}, openai.BadRequestError, 400),
    ],
    ids=[
        "unknown-model",
        "temperature",
        "max-tokens",
        "long-prompt",
        "no-messages",
        "role",
        "top-logprobs",
    ],
)
def test_chat_bad_input_gets_openai_error_and_server_goes_on(
    client: openai.OpenAI, kwargs: dict[str, object], error: type[Exception], status: int
) -> None:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **kwargs,
    }
    with pytest.raises(error) as info:
        client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert info.value.status_code == status  # type: ignore[attr-defined]
    body = info.value.body  # type: ignore[attr-defined]
    assert isinstance(body, dict) and body["message"]
    ok = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok"}], max_tokens=2
    )
    assert ok.choices


def test_chat_stream_reports_usage_in_a_last_chunk_without_choices(client: openai.OpenAI) -> None:
    """`stream_options.include_usage`: one last chunk with empty `choices` and the usage; the
    counts equal those of the same request not streamed."""
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Count to ten"}],
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )  # type: ignore[call-overload]
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_malformed_json_and_oversized_body(tiny_server: EngineServer) -> None:
    url = tiny_server.base_url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": "tiny"})  # missing prompt
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    big = b"x" * (9 << 20)
    r = httpx.post(  # chunked, no declared length: refused once the bytes pass the limit
        url,
        content=(big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(url, json={"model": "tiny", "prompt": "ok", "max_tokens": 1}).is_success


def test_metrics_use_vllm_names(tiny_server: EngineServer) -> None:
    # one request first: labelled histograms have no samples until something is served
    body = {"model": "tiny", "prompt": "ok", "max_tokens": 2}
    assert httpx.post(tiny_server.base_url + "/v1/completions", json=body).is_success
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in (
        "infercloud:time_to_first_token_seconds_bucket",
        "infercloud:inter_token_latency_seconds_bucket",
        "infercloud:e2e_request_latency_seconds_count",
        "infercloud:request_queue_time_seconds_count",
        "infercloud:kv_cache_usage_perc",
        "infercloud:num_requests_running",
        "infercloud:num_requests_waiting",
        "infercloud:num_preemptions_total",
        "infercloud:prompt_tokens_total",
        "infercloud:generation_tokens_total",
        "infercloud:kv_blocks_moved_total",
    ):
        assert name in text, name


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(tiny_server: EngineServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert tiny_server.metric("infercloud:num_requests_running") == 1
    # the connection is closed here, long before 900 tokens
    for _ in range(100):
        if (
            tiny_server.metric("infercloud:num_requests_running") == 0
            and tiny_server.metric("infercloud:kv_cache_usage_perc") == 0
        ):
            break
        time.sleep(0.05)
    assert tiny_server.metric("infercloud:num_requests_running") == 0
    assert tiny_server.metric("infercloud:kv_cache_usage_perc") == 0


def _aborted_requests(server: EngineServer) -> float:
    return server.metric(
        "infercloud:request_success_total", labels='finished_reason="abort"', default=0.0
    )


def test_client_disconnect_non_streaming_aborts(tiny_server: EngineServer) -> None:
    """The connection closes once the request is running (not after a fixed time, which a fast
    engine can outrun): the request is counted as aborted and its blocks are freed."""
    aborted_before = _aborted_requests(tiny_server)
    body = json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{tiny_server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10.0) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 10.0
        while tiny_server.metric("infercloud:num_requests_running") == 0:
            assert time.monotonic() < deadline, "the request never started running"
    # the connection is closed here, while the request is still generating
    for _ in range(100):
        if tiny_server.metric("infercloud:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert tiny_server.metric("infercloud:num_requests_running") == 0
    assert tiny_server.metric("infercloud:kv_cache_usage_perc") == 0
    assert _aborted_requests(tiny_server) == aborted_before + 1


def test_cached_tokens_reported_and_isolated_by_salt(client: openai.OpenAI) -> None:
    """Tenant B sending tenant A's exact prompt gets no cached tokens; tenant A gets them."""
    prompt = "the quick brown fox jumps over the lazy dog " * 6

    def cached(salt: str, stream: bool = False) -> int:
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"cache_salt": salt},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=3, extra_body={"cache_salt": salt}
            ).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    warm = cached("tenant-a")
    assert warm > 0 and warm % 16 == 0
    assert cached("tenant-a", stream=True) == warm
    assert cached("tenant-c", stream=True) == 0


def test_prefix_cache_metrics(tiny_server: EngineServer) -> None:
    text = httpx.get(tiny_server.base_url + "/metrics").text
    assert 'infercloud:prefix_cache_queries_total{model_name="tiny",tier="device"}' in text
    assert 'infercloud:prefix_cache_hits_total{model_name="tiny",tier="device"}' in text
    assert "infercloud:prefix_cache_evictions_total" in text


def test_kv_events_report_stored_blocks(client: openai.OpenAI, tiny_server: EngineServer) -> None:
    seq = httpx.get(tiny_server.base_url + "/kv_events").json()["seq"]
    client.completions.create(model="tiny", prompt="alpha beta gamma delta " * 8, max_tokens=2)
    body = httpx.get(tiny_server.base_url + "/kv_events", params={"since": seq}).json()
    assert body["seq"] > seq and not body["reset"] and body["block_size"] == 16
    stored = [e for e in body["events"] if e["type"] == "BlockStored"]
    assert stored and all(isinstance(h, int) for e in stored for h in e["block_hashes"])
