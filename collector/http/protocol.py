"""uvicorn's httptools protocol with a bounded request head, in bytes and in time.

uvicorn's httptools protocol puts no limit on a request's line and headers: the
parser buffers a header until it ends, so one connection sending a never-ending
header grew the collector by 400 MB before any route (or the gate) could see the
request; and any byte received re-arms nothing, so a client trickling a header a
byte at a time held its connection forever. This subclass answers 431 once the
head passes `max_head_bytes`, and closes a connection whose head is not complete
within `head_timeout_s` of its first byte (or of the connection, for the first
request). Both happen before the ASGI app runs, so the gate's bounds start where
these end.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 64 * 1024
    head_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.head_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_timer is None:  # the first byte of a new request on a kept-alive connection
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            body = b'{"error":"request line and headers exceed %d bytes"}' % self.max_head_bytes
            self.transport.write(_431 % (len(body), body))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._in_head = True  # the next request's head is counted afresh
        self._head_bytes = 0
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head and self._head_bytes and not self.transport.is_closing():
            self.transport.close()  # a head that trickles in: the slowloris case
        elif self._in_head and not self._head_bytes and self.cycle is None and not self.transport.is_closing():
            self.transport.close()  # a connection that never sent a request
