"""The gateway's HTTP protocol: a response head goes out with the write that follows it, never
later than the event loop iteration that wrote it, and the bytes on the wire are unchanged."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from infercloud.gateway.http_protocol import GatewayHttpProtocol, _HeadHoldingTransport


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_a_head_goes_out_with_the_next_write_or_at_the_end_of_the_iteration() -> None:
    async def go() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        rec = Recorder()
        t = _HeadHoldingTransport(rec, loop)  # type: ignore[arg-type]
        seen = []
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")  # same iteration: one write
        seen.append(list(rec.writes))
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # nothing follows
        seen.append(list(rec.writes))
        await asyncio.sleep(0)  # the iteration ends: out it goes
        seen.append(list(rec.writes))
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.close()  # closing flushes first
        seen.append(list(rec.writes))
        assert rec.closed and t.get_extra_info("peername") == "info:peername"
        return seen

    a, b, c, d = asyncio.run(go())
    assert a == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    assert b == a
    assert c == [*a, b"HTTP/1.1 204 No Content\r\n\r\n"]
    assert d == [*c, b"HTTP/1.1 200 OK\r\n\r\n"]


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await receive()
    path = scope["path"]
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path == "/late":  # the body comes 0.3 s after the head
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b"second"})
    else:
        await send({"type": "http.response.body", "body": b"now"})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=GatewayHttpProtocol, log_level="warning"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    thread.join(timeout=10)


def read_response(sock: socket.socket) -> tuple[bytes, float]:
    """One chunked response's bytes, and the seconds until its head had arrived."""
    started = time.monotonic()
    data, head_s = b"", -1.0
    while not data.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
        if head_s < 0 and b"\r\n\r\n" in data:
            head_s = time.monotonic() - started
    return data, head_s


def test_responses_are_whole_on_a_kept_alive_connection_and_a_head_is_not_delayed(
    server: int,
) -> None:
    with socket.create_connection(("127.0.0.1", server)) as sock:
        for path in ("/now", "/late", "/now"):
            sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            data, head_s = read_response(sock)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head
            if path == "/late":
                assert body == b"5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n"
                assert head_s < 0.2  # at once, not with the body 0.3 s later
            else:
                assert body == b"3\r\nnow\r\n0\r\n\r\n"
