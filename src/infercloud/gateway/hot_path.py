"""The generation endpoints' hot path: `POST /v1/chat/completions` and `/v1/completions` go
straight to the gateway, around FastAPI's middleware stack, routing and dependency solving.

On a streamed request through a stub upstream, that stack (seven ASGI middleware layers, FastAPI's
and ours, most of them wrapping every `send` of the stream; the router; the dependency solver)
took about a seventh of the gateway's CPU. The hot path does for these two routes what the
stack did, and no more:
  - it gives the request its id (`x-request-id` on the response, `request.state.request_id`);
  - it reads the body and validates it with the same pydantic models;
  - it calls `Gateway.handle` and answers `APIError` (and its `Refusal`, with its headers) in
    OpenAI's format, and anything unexpected with a 500 in that format.

Invariant: a request the hot path would answer differently from the full app goes to the full
app, untouched, with the body replayed if it was read: any other path or method, a content type
other than JSON, a body over the limit, declared or chunked (the full app refuses it, 413, and
records it), a body that fails validation (the full app words the 400 and records it). So both
ways give one answer, and the hot path only decides how fast.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from infercloud.gateway.protocol import ChatCompletionRequest, CompletionRequest
from infercloud.server.errors import APIError, api_error_response, error_response

if TYPE_CHECKING:
    from infercloud.gateway.app import Gateway

log = logging.getLogger("infercloud.gateway")

ROUTES: dict[str, tuple[type[ChatCompletionRequest] | type[CompletionRequest], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "chat/completions"),
    "/v1/completions": (CompletionRequest, "completions"),
}
"""Path -> (body model, endpoint name as `Gateway.handle` and the replica take it)."""


class _RequestIds:
    """Request ids: `req-` and 32 hex digits, 64 random bits drawn once per process (again in a
    forked child) then a 64-bit counter, so that ids never repeat within a process and two
    processes sharing one usage table collide with odds of 2^-64. (A usage record's key is its
    request id.) `os.urandom` per request, as `uuid4` does, cost 6-7 us here: a system call.
    """

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = "req-" + os.urandom(8).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


_request_ids = _RequestIds()


def new_request_id() -> str:
    """A new request id, unique within this process (see `_RequestIds`)."""
    return _request_ids.next()


def is_json(content_type: bytes | None) -> bool:
    """True for no content type or `application/json` (with parameters): bodies FastAPI would
    parse as JSON and the hot path parses the same way. (`+json` types go the long way.)"""
    if content_type is None:
        return True
    return content_type.partition(b";")[0].strip().lower() == b"application/json"


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with `hot_path` in front of it once set."""

    hot_path: HotPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.hot_path is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in ROUTES
        ):
            await self.hot_path(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def full(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The full app, middleware and all."""
        await super().__call__(scope, receive, send)


class HotPath:
    def __init__(self, gateway: Gateway, app: GatewayApp, max_body_bytes: int) -> None:
        self.gateway = gateway
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model, endpoint = ROUTES[scope["path"]]
        content_type: bytes | None = None
        length: bytes | None = None
        headers: dict[str, str] = {}
        for name, value in reversed(scope["headers"]):  # reversed: the first of a repeated one
            headers[name.decode("latin-1")] = value.decode("latin-1")
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                length = value
        if not is_json(content_type) or (
            length is not None and length.isdigit() and int(length) > self.max_body_bytes
        ):
            await self.app.full(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:  # chunked, over the limit: the full app refuses it
                await self.app.full(scope, _replay(messages, receive), send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages)
        try:
            request = model.model_validate_json(body)
        except ValidationError:
            await self.app.full(scope, _replay(messages, receive), send)
            return
        request_id = new_request_id()
        scope["app"] = self.app
        scope.setdefault("state", {})["request_id"] = request_id
        raw = Request(scope, receive)
        try:
            response = await self.gateway.handle(raw, request, endpoint, headers)
        except APIError as exc:
            response = api_error_response(exc)
        except Exception:
            log.exception("request %s failed in the gateway", request_id)
            response = error_response(500, "internal error in the gateway", code="internal_error")
        response.raw_headers.append((b"x-request-id", request_id.encode()))
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that gives `messages` again first, then the client's own."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
