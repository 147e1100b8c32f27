"""The hot path in front of the gateway's FastAPI app: which requests it takes, which it hands to
the full app (with the body replayed), and how it answers errors.

The gateway here is a double that records what reaches it: these tests are about the dispatch
in front of `Gateway.handle`; the real gateway behind the hot path is driven end to end in
test_gateway_api.py and test_platform.py."""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message

from infercloud.gateway.app import LastChunk, RelayResponse
from infercloud.gateway.hot_path import GatewayApp, HotPath, is_json, new_request_id
from infercloud.gateway.protocol import ChatCompletionRequest, CompletionRequest
from infercloud.server.errors import APIError, BodyLimitMiddleware, install_error_handlers

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


class GatewayDouble:
    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.seen: list[tuple[str, str, dict[str, Any]]] = []
        self.headers: list[Mapping[str, str] | None] = []

    async def handle(
        self,
        raw: Request,
        body: ChatCompletionRequest | CompletionRequest,
        endpoint: str,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        self.seen.append((raw.state.request_id, endpoint, body.forwarded()))
        self.headers.append(headers)
        if self.raises is not None:
            raise self.raises
        return JSONResponse({"ok": endpoint})


def make_app(gateway: GatewayDouble, max_body_bytes: int = 1000) -> tuple[GatewayApp, list[str]]:
    app = GatewayApp()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    full: list[str] = []

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        full.append(json.dumps(body.forwarded()))
        return JSONResponse({"ok": "full"})

    app.hot_path = HotPath(gateway, app, max_body_bytes)  # type: ignore[arg-type]
    return app, full


def post(
    app: GatewayApp,
    content: bytes | list[bytes],
    content_type: str | None,
    extra_headers: list[tuple[str, str]] | None = None,
) -> httpx.Response:
    """POST `content` (a list: in those pieces, chunked, with no declared length)."""

    async def pieces(parts: list[bytes]) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            headers = [("content-type", content_type)] if content_type else []
            body = pieces(content) if isinstance(content, list) else content
            return await client.post(
                "/v1/completions", content=body, headers=[*headers, *(extra_headers or [])]
            )

    return asyncio.run(go())


def test_json_bodies_take_the_hot_path_with_a_request_id() -> None:
    gateway = GatewayDouble()
    app, full = make_app(gateway)
    for content_type in ("application/json", "Application/JSON; charset=utf-8", None):
        r = post(app, json.dumps(BODY).encode(), content_type)
        assert r.status_code == 200 and r.json() == {"ok": "completions"}
        assert r.headers["x-request-id"] == gateway.seen[-1][0]
        assert r.headers["x-request-id"].startswith("req-")
    assert full == []
    assert [s[2] for s in gateway.seen] == [BODY] * 3
    assert len({s[0] for s in gateway.seen}) == 3


def test_the_hot_path_hands_on_headers_by_lower_case_name_the_first_of_a_repeated_one() -> None:
    gateway = GatewayDouble()
    app, _ = make_app(gateway)
    extra = [
        ("Authorization", "Bearer first"),
        ("X-Infercloud-Task", "t-1"),
        ("authorization", "Bearer second"),
    ]
    assert post(app, json.dumps(BODY).encode(), "application/json", extra).status_code == 200
    headers = gateway.headers[-1]
    assert headers is not None
    assert headers["authorization"] == "Bearer first"  # as Starlette's `Headers.get` gives it
    assert headers["x-infercloud-task"] == "t-1"
    assert headers["content-type"] == "application/json"


def test_what_the_hot_path_would_answer_differently_goes_to_the_full_app() -> None:
    gateway = GatewayDouble()
    app, full = make_app(gateway, max_body_bytes=200)
    body = json.dumps(BODY).encode()
    # another JSON media type: FastAPI parses it, the hot path does not try
    r = post(app, body, "application/vnd.api+json")
    assert r.status_code == 200 and r.json() == {"ok": "full"}
    assert json.loads(full[-1]) == BODY  # the body reached the full app whole
    # not JSON at all, invalid JSON, a body that fails validation: the full app's 400s
    for content, content_type in (
        (body, "text/plain"),
        (b"{not json", "application/json"),
        (json.dumps({**BODY, "max_tokens": "lots"}).encode(), "application/json"),
    ):
        r = post(app, content, content_type)
        assert r.status_code == 400 and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    assert post(app, b"{not json", "application/json").json()["error"]["code"] == "invalid_json"
    # a body over the limit, declared or chunked: the full app's 413
    big = json.dumps({**BODY, "prompt": "x" * 300}).encode()
    r = post(app, big, "application/json")
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(app, [big[:100], big[100:200], big[200:]], "application/json")
    assert r.status_code == 413 and "exceeds the limit of 200" in r.json()["error"]["message"]
    r = post(app, [body[:10], body[10:]], "application/json")  # chunked, under: the hot path
    assert r.json() == {"ok": "completions"}
    assert len(gateway.seen) == 1 and len(full) == 1


def test_errors_on_the_hot_path_are_openai_bodies_with_their_headers() -> None:
    refusal = APIError(429, "slow down", code="rate_limit_exceeded")
    refusal.headers = {"retry-after": "7"}
    app, _ = make_app(GatewayDouble(raises=refusal))
    r = post(app, json.dumps(BODY).encode(), "application/json")
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.headers["x-request-id"].startswith("req-")

    app, _ = make_app(GatewayDouble(raises=RuntimeError("bug")))
    r = post(app, json.dumps(BODY).encode(), "application/json")
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert r.headers["x-request-id"].startswith("req-")


def test_is_json() -> None:
    assert is_json(None) and is_json(b"application/json") and is_json(b" application/json ;x=1")
    assert not is_json(b"text/plain") and not is_json(b"application/jsonx")


def test_request_ids_never_repeat_and_a_forked_child_draws_its_own() -> None:
    ids = [new_request_id() for _ in range(10000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 36 and i.startswith("req-") for i in ids)
    int(ids[0][4:], 16)
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads; the child
        warnings.simplefilter("ignore", DeprecationWarning)  # only formats an id and leaves
        pid = os.fork()
    if pid == 0:  # the child: report its first id, then leave at once
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    assert child[:20] != ids[0][:20] and child not in ids


def test_a_relay_response_sends_its_last_chunk_with_the_end() -> None:
    """Two writes for a stream whose end came with its last events (`LastChunk`): headers, then
    the rest with the end; a stream without one ends with an empty body, as before."""

    async def run(chunks: list[bytes]) -> list[Message]:
        sent: list[Message] = []

        async def gen() -> AsyncGenerator[bytes, None]:
            for c in chunks:
                yield c

        async def receive() -> Message:
            await asyncio.Event().wait()  # the client stays
            raise AssertionError

        async def send(message: Message) -> None:
            sent.append(message)

        await RelayResponse(gen(), media_type="text/event-stream")({}, receive, send)
        await asyncio.sleep(0)
        return sent

    sent = asyncio.run(run([b"data: a\n\n", LastChunk(b"data: [DONE]\n\n")]))
    assert [m["type"] for m in sent] == ["http.response.start", *["http.response.body"] * 2]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: a\n\n", True),
        (b"data: [DONE]\n\n", False),
    ]
    sent = asyncio.run(run([b"data: a\n\n"]))
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: a\n\n", True),
        (b"", False),
    ]
