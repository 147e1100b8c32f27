"""HTTP/1.1 to replicas on the request path: pooled keep-alive connections, each an asyncio
protocol whose bytes httptools parses as they arrive.

Why not aiohttp's client here (it stays for health checks and KV events): on the gateway's
request path, sending one request and relaying a stream of 20 chunks through it was the largest
share of the event loop's time (a quarter of it, docs/benchmarks.md). Most of that is its
generality (request and response objects, header multidicts, timers per read, a stream reader
with its own flow control). A replica speaks plain HTTP/1.1 with JSON bodies, and the gateway
needs the status, the body, and, for a stream, the body as it comes; so a response here is
those and nothing else: the parser's body callbacks append to a list that the relay takes
whole (`UpstreamResponse.__anext__`).

Invariants:
- A connection carries one request at a time. It goes back to its pool's idle list only when
  its response has ended and the server kept it alive; the response's data is then the
  response's own, so closing the response later touches no connection. An answer that arrives
  whole in one read frees its connection before the request's task resumes, so the request's
  side touches the connection only while `conn.response` is still its own.
- A response that has not ended when it is closed (the client left, the replica was ejected)
  aborts its connection: the replica sees the disconnect and stops the work.
- Every failure of the connection before the response ends (refused, reset, closed early, the
  read timeout, bytes the parser rejects) surfaces as `UpstreamError` to whoever waits, once.
- A request on a connection that was idle in the pool, which closes before any byte of the
  answer, is sent once more on a new connection (the server closed an idle keep-alive
  connection as the request went out; nothing was answered).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_KEEP_S = 4.0
"""Idle connections older than this are closed rather than reused: uvicorn (vLLM's, SGLang's
and our engine's server) closes keep-alive connections idle for 5 s."""

_DELIMITING = (b"content-length", b"transfer-encoding")

MAX_BUFFERED_BYTES = 1 << 20
"""A response holding this much unread body stops reading from its socket until it is read."""


class UpstreamError(ConnectionError):
    """The connection to a replica failed before its response ended."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Connecting took longer than the connect timeout, or the replica sent nothing for the read
    timeout while a response was pending."""


class Endpoint:
    """A replica's URL and one of its paths, parsed once: the constant part of each request's
    head is kept as bytes."""

    __slots__ = ("head", "host", "key", "port", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.key = (parts.scheme, self.host, self.port)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        default_port = parts.port is None
        host = parts.hostname if default_port else f"{parts.hostname}:{self.port}"
        if ":" in parts.hostname:  # an IPv6 literal
            host = f"[{parts.hostname}]" if default_port else f"[{parts.hostname}]:{self.port}"
        self.head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")


class UpstreamResponse:
    """A replica's answer: `status` once the head has arrived; the body whole (`read`) or as it
    comes (`async for block in response`: each block is everything that arrived since the last
    one, in order, never empty)."""

    __slots__ = ("_conn", "_error", "_loop", "_waiter", "buffered", "chunks", "done", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self._loop = conn.loop
        self.status = 0
        self.chunks: list[bytes] = []
        self.buffered = 0
        """Bytes in `chunks`."""
        self.done = False
        """The whole body has arrived (it may not all have been taken yet)."""
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side --

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if not self.done and self._error is None:
            self._error = error
            self._conn = None
            self._wake()

    # -- the reader's side --

    async def _wait(self) -> None:
        # the loop the connection runs on (Python 3.11's get_running_loop() is a getpid call)
        waiter = self._waiter = self._loop.create_future()
        await waiter

    def is_eof(self) -> bool:
        """The body has ended and every block of it has been taken."""
        return self.done and not self.chunks

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        while not self.chunks:
            if self.done:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self.chunks
        self.chunks = []
        self.buffered = 0
        if self._conn is not None and self._conn.paused:
            self._conn.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self) -> bytes:
        """The whole body (waits for its end)."""
        while not self.done:
            if self._error is not None:
                raise self._error
            if self._conn is not None and self._conn.paused:
                self._conn.resume()
            await self._wait()
        body = b"".join(self.chunks)
        self.chunks = []
        self.buffered = 0
        return body

    def close(self) -> None:
        """Drop the response: a connection still carrying it is aborted (the replica sees the
        client go); after its end this does nothing."""
        conn, self._conn = self._conn, None
        if conn is not None:  # still carrying it: the answer has not ended
            conn.abort()
        self._fail(UpstreamError("response closed"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica and httptools' parser of what it sends."""

    __slots__ = (
        "busy_since_s",
        "closed",
        "got_bytes",
        "headers",
        "idle_since_s",
        "key",
        "loop",
        "parser",
        "paused",
        "pool",
        "response",
        "transport",
        "until_eof",
    )

    def __init__(
        self, pool: UpstreamPool, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers: asyncio.Future[None] | None = None
        self.closed = False
        self.paused = False
        self.got_bytes = False
        self.until_eof = True
        """No `content-length` or `transfer-encoding` seen in this answer's head (yet): its body
        ends when the server closes the connection (HTTP/1.0 style)."""
        self.idle_since_s = 0.0
        self.busy_since_s = 0.0

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.busy_since_s = self.pool.clock()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._lost(UpstreamError("the replica tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._lost(UpstreamError(f"invalid HTTP from the replica: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self.response is not None and self.response.status and self.until_eof:
            self.on_message_complete()  # a body without a length ends with the connection
        # closed for good, never back in the pool (a no-op for the response just completed)
        self._lost(UpstreamError(f"connection closed: {exc!r}" if exc else "connection closed"))

    # -- httptools' callbacks --

    def on_header(self, name: bytes, _value: bytes) -> None:
        if self.until_eof and name.lower() in _DELIMITING:
            self.until_eof = False

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            if self.headers is not None and not self.headers.done():
                self.headers.set_result(None)

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response.chunks.append(body)
            response.buffered += len(body)
            response._wake()
            if response.buffered > MAX_BUFFERED_BYTES and not self.paused:
                self.pause()

    def on_message_complete(self) -> None:
        response = self.response
        self.response = None
        keep = self.parser.should_keep_alive()
        if response is not None:
            response.done = True
            response._conn = None
            response._wake()
        if self.paused:
            self.resume()
        if keep and not self.closed:
            self.pool.release(self)
        else:
            self._close(reset=False)  # complete, and the server will not send another

    # -- the pool's side --

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close at once (the replica sees a reset)."""
        self._close(reset=True)

    @property
    def is_open(self) -> bool:
        """Neither closed here nor closing under us (its loss not yet reported): a request
        may go out on it."""
        return not self.closed and not (self.transport is not None and self.transport.is_closing())

    def _close(self, reset: bool) -> None:
        """Close once; out of the pool's sets every time (also for a connection whose loss
        came before the pool took it)."""
        self.pool.forget(self)
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                if reset:
                    self.transport.abort()
                else:
                    self.transport.close()

    def _lost(self, error: UpstreamError) -> None:
        self.abort()
        if self.headers is not None and not self.headers.done():
            self.headers.set_exception(error)
        response, self.response = self.response, None
        if response is not None:
            response._fail(error)

    async def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        """Write the request and wait for the head of its answer. A connection that the
        server has closed already (its loss seen before this, or the transport closing) fails
        at once with `UpstreamError`, before any byte, as one that closes later does: the
        pool retries either on a new connection."""
        assert self.transport is not None and self.response is None
        self.got_bytes = False
        if not self.is_open:
            # uvloop's write raises RuntimeError on a closed transport; asyncio's drops the
            # bytes, and the answer would be awaited forever (no loss left to report)
            self.abort()
            raise UpstreamError("connection closed before the request was sent")
        response = self.response = UpstreamResponse(self)
        headers = self.headers = self.loop.create_future()
        self.until_eof = True
        self.busy_since_s = self.pool.clock()
        self.pool.watch(self)
        try:
            try:
                self.transport.write(head + body)
            except (RuntimeError, OSError) as exc:
                self._lost(UpstreamError(f"cannot write to the replica: {exc!r}"))
            await headers
        except BaseException:
            # Cancelled (the replica ejected, the client gone) or failed. Drop the connection
            # only while it still carries this request: an answer that arrived whole has
            # freed it, and another request may be on it by now.
            if self.response is response:
                self.abort()
            raise
        finally:
            if self.headers is headers:
                self.headers = None
        return response


class UpstreamPool:
    """Keep-alive connections to replicas, by (scheme, host, port): the most recently used idle
    one first. `read_timeout_s` bounds the silence of a replica while a response is pending;
    one timer per connection checks it (not one per read)."""

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.clock = clock
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._timers: dict[_Connection, asyncio.TimerHandle] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False

    @property
    def num_idle(self) -> int:
        return sum(len(v) for v in self._idle.values())

    @property
    def num_busy(self) -> int:
        return len(self._busy)

    async def post(
        self, endpoint: Endpoint, body: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        """POST `body` to `endpoint` and return once the answer's status has arrived. Raises
        `UpstreamError` (or `UpstreamTimeout`) when the connection fails first."""
        if self.closed:
            raise UpstreamError("the upstream pool is closed")
        lines = [endpoint.head]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        head = b"".join(lines)
        conn = self._take_idle(endpoint.key)
        if conn is not None:
            try:
                return await conn.send(head, body)
            except UpstreamError as exc:
                if conn.got_bytes or isinstance(exc, TimeoutError):
                    raise
                # closed before answering anything: an idle connection the server dropped
        conn = await self._connect(endpoint)
        return await conn.send(head, body)

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = self.clock()
        while idle:
            conn = idle.pop()
            if conn.is_open and now - conn.idle_since_s < IDLE_KEEP_S:
                self._busy.add(conn)
                return conn
            conn.abort()
        return None

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if endpoint.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self, endpoint.key, loop),
                    endpoint.host,
                    endpoint.port,
                    ssl=context,
                ),
                self.connect_timeout_s,
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"connecting to {endpoint.host}:{endpoint.port} timed out"
            ) from exc
        except OSError as exc:
            where = f"{endpoint.host}:{endpoint.port}"
            raise UpstreamError(f"cannot connect to {where}: {exc}") from exc
        self._busy.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """`conn`'s response has ended and the server keeps it open: idle, reusable."""
        self._busy.discard(conn)
        if self.closed:
            conn.abort()
            return
        conn.idle_since_s = self.clock()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        timer = self._timers.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def watch(self, conn: _Connection) -> None:
        """Start the read timeout's timer for `conn` unless one runs (it outlives responses:
        when it fires it looks at the connection's last activity and sets itself again)."""
        if conn not in self._timers:
            self._arm(conn, self.read_timeout_s)

    def _arm(self, conn: _Connection, delay_s: float) -> None:
        self._timers[conn] = conn.loop.call_later(delay_s, self._check, conn)

    def _check(self, conn: _Connection) -> None:
        self._timers.pop(conn, None)
        if conn.response is None:
            return  # idle: the next request sets the timer again
        if conn.closed:  # never expected (a loss fails the response); if so, end the wait
            conn._lost(UpstreamError("connection closed"))
            return
        silent_s = self.clock() - conn.busy_since_s
        if silent_s >= self.read_timeout_s:
            conn._lost(UpstreamTimeout(f"no data from the replica for {silent_s:.0f} s"))
        else:
            self._arm(conn, self.read_timeout_s - silent_s)

    async def close(self) -> None:
        """Close every connection; responses still pending fail with `UpstreamError`."""
        self.closed = True
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn._lost(UpstreamError("the upstream pool is closed"))
        self._idle.clear()
        self._busy.clear()

    def __repr__(self) -> str:
        return f"UpstreamPool(idle={self.num_idle}, busy={self.num_busy})"
