"""A fast stub of an OpenAI-compatible server: answers every completion with the same text.

For measuring what a gateway adds: it does no work but parse the body, and streams a fixed
completion of `--tokens` chunks (or returns it whole) with usage. A bare ASGI app on uvicorn
(httptools, uvloop), so that it is never the bottleneck.

    .venv/bin/python benchmarks/stub_upstream.py --port 9100 [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn


def make_app(num_tokens: int) -> Any:
    usage = {"prompt_tokens": 8, "completion_tokens": num_tokens, "total_tokens": 8 + num_tokens}

    def chunk(kind: str, model: str, text: str | None, finish: str | None) -> bytes:
        if kind == "chat":
            delta = {"content": text} if text is not None else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
            obj = "text_completion"
        body = {"id": "stub", "object": obj, "created": 0, "model": model, "choices": [choice]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            body = json.dumps(
                {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "x"}]}
                if path.endswith("/models")
                else {"status": "ok"}
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(raw or b"{}")
        model = str(request.get("model", "stub"))
        kind = "chat" if path.endswith("/chat/completions") else "text"
        if request.get("stream"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            parts = [chunk(kind, model, " tok", None) for _ in range(num_tokens)]
            parts.append(chunk(kind, model, None, "length"))
            if (request.get("stream_options") or {}).get("include_usage"):
                tail = {
                    "id": "stub",
                    "object": "x",
                    "created": 0,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                parts.append(b"data: " + json.dumps(tail).encode() + b"\n\n")
            parts.append(b"data: [DONE]\n\n")
            for part in parts[:-1]:
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": parts[-1]})
            return
        text = " tok" * num_tokens
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": text},
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = "text_completion"
        body = json.dumps(
            {
                "id": "stub",
                "object": obj,
                "created": 0,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.tokens),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
