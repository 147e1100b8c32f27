"""The request path's HTTP client (`gateway.upstream`) against real sockets on loopback: small
asyncio servers that answer exactly the bytes each case needs (chunked streams, keep-alive, a
close mid-answer, silence, garbage), and uvicorn serving a plain ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

import pytest
import uvicorn
import uvloop

from infercloud.gateway import upstream as upstream_module
from infercloud.gateway.upstream import Endpoint, UpstreamError, UpstreamPool, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running `handler` per connection; yields its base URL and a list that
    counts the connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    out += b"transfer-encoding: chunked\r\n\r\n"
    for part in parts:
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


LOOP: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> str:
    """Every case on asyncio's own loop and on uvloop (which the gateway runs on)."""
    LOOP[0] = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop
    return str(request.param)


def run(coro: Coroutine[None, None, None]) -> None:
    with asyncio.Runner(loop_factory=LOOP[0]) as runner:
        runner.run(coro)


def test_a_stream_arrives_whole_in_order_and_the_connection_is_reused() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(20)]
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            requests.append(await read_request(reader))
            writer.write(chunked(*events))
            await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, accepted):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/chat/completions")
            for i in range(3):
                response = await pool.post(endpoint, b'{"x": %d}' % i, {"x-request-id": f"r{i}"})
                assert response.status == 200
                blocks = [block async for block in response]
                assert all(blocks) and b"".join(blocks) == b"".join(events)
                assert response.is_eof()
            assert len(accepted) == 1 and pool.num_idle == 1 and pool.num_busy == 0
            await pool.close()
        first = requests[0]
        assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert f"host: {url.removeprefix('http://')}\r\n".encode() in first
        assert b"x-request-id: r0\r\n" in first and first.endswith(b'{"x": 0}')

    run(main())


def test_a_whole_body_with_content_length_and_an_error_status() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b'{"error": {"message": "no"}}'
        head = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = UpstreamPool()
            response = await pool.post(Endpoint(f"{url}/v1/completions"), b"{}", {})
            assert response.status == 400
            assert await response.read() == b'{"error": {"message": "no"}}'
            response.close()  # after its end: nothing to abort
            assert pool.num_idle == 1
            await pool.close()

    run(main())


def test_an_idle_connection_the_server_dropped_is_replaced_without_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(chunked(b"one"))
        await writer.drain()
        # and close: the next request finds the pooled connection dead

    async def main() -> None:
        async with serving(handler) as (url, accepted):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/completions")
            for _ in range(3):
                response = await pool.post(endpoint, b"{}", {})
                assert await response.read() == b"one"
                await asyncio.sleep(0.05)  # the server's close arrives
            assert len(accepted) == 3
            await pool.close()

    run(main())


def test_a_stale_pooled_connection_is_retried_once_on_a_new_one() -> None:
    """The close races the request: the pooled connection looks alive, the server drops it as
    the request goes out, without answering. The request goes out again on a new connection."""
    served: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(served)
        served.append(n)
        await read_request(reader)
        if n == 0:
            writer.write(chunked(b"first"))
            await writer.drain()
            await read_request(reader)  # the second request on this connection: no answer
            return
        writer.write(chunked(b"second"))
        await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, accepted):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/completions")
            assert await (await pool.post(endpoint, b"{}", {})).read() == b"first"
            assert await (await pool.post(endpoint, b"{}", {})).read() == b"second"
            assert len(accepted) == 2
            await pool.close()

    run(main())


def test_a_close_mid_answer_fails_the_reader_and_a_fresh_connection_is_not_retried() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        full = chunked(b"a" * 10, b"b" * 10)
        writer.write(full[: full.index(b"bbbb")])
        await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, accepted):
            pool = UpstreamPool()
            response = await pool.post(Endpoint(f"{url}/v1/completions"), b"{}", {})
            assert await response.__anext__() == b"a" * 10
            with pytest.raises(UpstreamError):
                async for _ in response:
                    pass
            assert pool.num_idle == 0 and pool.num_busy == 0

            async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await read_request(reader)

            async with serving(hang_up) as (url2, accepted2):
                with pytest.raises(UpstreamError):
                    await pool.post(Endpoint(f"{url2}/v1/completions"), b"{}", {})
                assert len(accepted2) == 1  # a new connection that fails is not tried again
            await pool.close()
        assert len(accepted) == 1

    run(main())


def test_a_connection_lost_before_its_request_fails_at_once_with_an_upstream_error() -> None:
    """A replica killed under load: a new connection can be lost before its request goes out
    (the loss seen first). Sending on it is an `UpstreamError` at once, on either loop; it
    was a `RuntimeError` on uvloop (a write to a closed transport) and a wait without end on
    asyncio's loop (the bytes dropped, the loss already reported)."""

    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return

    async def main() -> None:
        async with serving(close_at_once) as (url, accepted):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/completions")
            conn = await pool._connect(endpoint)
            deadline = time.monotonic() + 5
            while not conn.closed:
                assert time.monotonic() < deadline, "the server's close never arrived"
                await asyncio.sleep(0.01)
            with pytest.raises(UpstreamError, match="before the request was sent"):
                await asyncio.wait_for(conn.send(b"POST / HTTP/1.1\r\n\r\n", b""), 5)
            assert pool.num_idle == 0 and pool.num_busy == 0
            for _ in range(20):  # the whole race, through post: never anything but the error
                with pytest.raises(UpstreamError):
                    await asyncio.wait_for(pool.post(endpoint, b"{}", {}), 5)
            assert pool.num_idle == 0 and pool.num_busy == 0
            assert len(accepted) == 21  # a new connection each time, none tried twice
            await pool.close()

    run(main())


def test_a_body_delimited_by_the_close_of_the_connection() -> None:
    """HTTP/1.0 style: no length, no chunks; the answer ends when the server closes. A close
    before the head, or one on a connection that carries a length, is still a failure."""

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"part two")
        await writer.drain()

    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async def main() -> None:
        pool = UpstreamPool()
        async with serving(until_close) as (url, _):
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            assert await response.read() == b"part one, part two"
            assert pool.num_idle == 0 and pool.num_busy == 0
        async with serving(short) as (url, _):
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            with pytest.raises(UpstreamError):
                await response.read()
        await pool.close()

    run(main())


def test_refused_and_invalid_http_are_upstream_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        pool = UpstreamPool()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.post(Endpoint(f"http://127.0.0.1:{free_port}/v1/x"), b"{}", {})
        async with serving(garbage) as (url, _):
            with pytest.raises(UpstreamError, match="invalid HTTP"):
                await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
        assert pool.num_idle == 0 and pool.num_busy == 0
        await pool.close()

    run(main())


def test_a_silent_replica_times_out_and_activity_keeps_a_slow_one_alive() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n")
        await writer.drain()
        await reader.read()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # 0.6 s in all, never 0.3 s silent
            await asyncio.sleep(0.1)
            writer.write(b"1\r\ny\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        pool = UpstreamPool(read_timeout_s=0.3)
        async with serving(silent) as (url, _):
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            assert await response.__anext__() == b"x"
            started = time.monotonic()
            with pytest.raises(UpstreamTimeout):
                await response.__anext__()
            assert 0.1 < time.monotonic() - started < 2.0
        async with serving(slow) as (url, _):
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            assert await response.read() == b"y" * 6

        async def mute_after_one(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            await read_request(reader)
            writer.write(chunked(b"ok"))
            await writer.drain()
            while True:
                await read_request(reader)  # and never answer

        async with serving(mute_after_one) as (url, accepted):
            endpoint = Endpoint(f"{url}/v1/x")
            assert await (await pool.post(endpoint, b"{}", {})).read() == b"ok"
            with pytest.raises(UpstreamTimeout):  # on the pooled connection: not sent again
                await pool.post(endpoint, b"{}", {})
            await asyncio.sleep(0.05)
            assert len(accepted) == 1
        await pool.close()

    run(main())


def test_closing_a_response_mid_stream_aborts_its_connection() -> None:
    gone = asyncio.Event

    async def main() -> None:
        saw_eof = gone()

        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                while True:
                    writer.write(b"1\r\nz\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionError:
                saw_eof.set()

        async with serving(endless) as (url, _):
            pool = UpstreamPool()
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            assert await response.__anext__()
            waiting = asyncio.ensure_future(response.__anext__())
            await asyncio.sleep(0)
            response.close()
            with contextlib.suppress(StopAsyncIteration, UpstreamError):
                await waiting  # either the block that had arrived or the close
            with pytest.raises(UpstreamError):
                async for _ in response:
                    pass
            await asyncio.wait_for(saw_eof.wait(), 2.0)
            assert pool.num_idle == 0 and pool.num_busy == 0
            await pool.close()

    run(main())


def test_a_request_cancelled_before_its_answer_drops_its_connection() -> None:
    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(0.3)
        writer.write(chunked(b"late"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with serving(late) as (url, accepted):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/x")
            task = asyncio.ensure_future(pool.post(endpoint, b"{}", {}))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.num_idle == 0 and pool.num_busy == 0
            assert await (await pool.post(endpoint, b"{}", {})).read() == b"late"
            assert len(accepted) == 2  # the late answer never lands on a reused connection
            await pool.close()

    run(main())


def test_a_body_larger_than_the_buffer_pauses_the_socket_and_arrives_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream_module, "MAX_BUFFERED_BYTES", 4096)
    parts = [bytes([65 + i % 26]) * 1000 for i in range(400)]

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(chunked(*parts))
            await writer.drain()
        await reader.read()

    async def main() -> None:
        async with serving(big) as (url, _):
            pool = UpstreamPool()
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            await asyncio.sleep(0.2)  # let it fill past the limit
            assert sum(map(len, response.chunks)) < 400_000  # reading stopped
            got = b""
            async for block in response:
                got += block
            assert got == b"".join(parts)
            assert pool.num_idle == 1
            # whole, the same body: `read` takes it past the limit, resuming the socket
            response = await pool.post(Endpoint(f"{url}/v1/x"), b"{}", {})
            assert await asyncio.wait_for(response.read(), 10) == b"".join(parts)
            await pool.close()

    run(main())


def test_against_uvicorn_keep_alive_and_chunked_streaming() -> None:
    """A real ASGI server (uvicorn with httptools, as replicas run): several requests in turn
    and at once, streamed and whole."""

    async def app(scope: dict, receive: Callable, send: Callable) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(5):
            await send({"type": "http.response.body", "body": body + b"%d" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)

        async def main() -> None:
            pool = UpstreamPool()
            endpoint = Endpoint(f"http://127.0.0.1:{port}/v1/x")

            async def one(tag: bytes) -> bytes:
                response = await pool.post(endpoint, tag, {"content-type": "text/plain"})
                assert response.status == 200
                return b"".join([block async for block in response])

            for tag in (b"a", b"b"):
                assert await one(tag) == b"".join(tag + b"%d" % i for i in range(5))
            tags = [b"t%d" % i for i in range(16)]
            results = await asyncio.gather(*(one(tag) for tag in tags))
            for tag, got in zip(tags, results, strict=True):
                assert got == b"".join(tag + b"%d" % i for i in range(5))
            assert pool.num_busy == 0 and 1 <= pool.num_idle <= 16
            await pool.close()

        run(main())
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_many_whole_answers_at_once_each_reach_their_own_request() -> None:
    """Whole answers that arrive in one read end their response and free the connection before
    the request's task resumes; another request can take that connection meanwhile. Each must
    still get its own answer, and none may wait forever."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            tag = request.rsplit(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(tag), tag))
            await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = UpstreamPool()
            endpoint = Endpoint(f"{url}/v1/x")

            async def worker(n: int) -> int:
                # a closed loop, as clients through the gateway are: the next request starts
                # as soon as the last one's answer is read
                for i in range(50):
                    tag = b"%d-%d" % (n, i)
                    assert await (await pool.post(endpoint, tag, {})).read() == tag
                return n

            done = await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(16))), 20)
            assert done == list(range(16))
            await pool.close()

    run(main())


def test_endpoint_parses_urls_and_refuses_other_schemes() -> None:
    e = Endpoint("http://127.0.0.1:8001/v1/chat/completions")
    assert (e.host, e.port, e.ssl) == ("127.0.0.1", 8001, False)
    assert e.head == b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8001\r\n"
    assert Endpoint("https://api.example.com/v1/completions").port == 443
    assert b"host: api.example.com\r\n" in Endpoint("https://api.example.com/v1/completions").head
    assert b"host: [::1]:9000\r\n" in Endpoint("http://[::1]:9000/v1/x").head
    with pytest.raises(ValueError):
        Endpoint("ftp://host/x")
