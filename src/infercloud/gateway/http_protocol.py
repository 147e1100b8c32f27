"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each response's
head and first body bytes sent in one write.

Under ASGI, uvicorn writes a response's head when the app sends `http.response.start` and its
body at each `http.response.body`: two system calls for a response that is ready at once (most
of the gateway's answers, and every stream whose replica's end came in one read). The client's
transport here holds a head back until the next write of the same connection, or until the
event loop's current iteration ends, whichever comes first, and sends them together. So a
head is never delayed past the iteration that wrote it (a stream whose first event comes later
still gets its head at once), bytes keep their order, and nothing else changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1.1 "


class _HeadHoldingTransport:
    """A client transport that holds a response head back for the write that follows it
    (see the module's docstring); everything else is the wrapped transport's."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + bytes(data))
        elif bytes(data[: len(_HEAD)]) == _HEAD:
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over `_HeadHoldingTransport` (`uvicorn.Config(http=...)`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadHoldingTransport(transport, self.loop))  # type: ignore[arg-type]
