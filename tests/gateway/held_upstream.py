"""An OpenAI-compatible upstream whose completions wait at a gate the test opens: a real HTTP
server (uvicorn, in a thread) on a loopback port, standing in for a busy replica so that tests
can hold requests in flight for as long as they need (our engine answers in milliseconds).

It answers `GET /health` and `/v1/models`, and every `POST /v1/completions` with one fixed
non-streamed completion once the gate is open, counting arrivals and keeping each body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn


class HeldUpstream:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", interface="asgi3"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> HeldUpstream:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the held upstream did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def arrived(self) -> int:
        with self._lock:
            return len(self.bodies)

    def wait_arrived(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.arrived < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.arrived} of {n} requests reached the upstream")
            time.sleep(0.01)

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "POST":
            with self._lock:
                self.bodies.append(json.loads(body))
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
            answer: dict[str, Any] = {
                "id": "held",
                "object": "text_completion",
                "created": 0,
                "model": "held",
                "choices": [{"index": 0, "text": "done", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        elif scope["path"].endswith("/models"):
            answer = {"object": "list", "data": [{"id": "held", "object": "model"}]}
        else:
            answer = {"status": "ok"}
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
