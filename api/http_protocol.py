"""uvicorn's HTTP protocols with a deadline on reading a request's headers.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`), and any byte that arrives
restarts even that: a client that opens a connection and sends its headers a byte at a time holds the
connection (and its memory) forever, and a few thousand such clients hold them all. Here every request
must finish its headers within `header_timeout_s`, counted from the connection's start for its first
request and from the first byte for each later one; past it the connection gets a 408 and is closed. The
deadline ends once the headers are in: bodies and responses (long streams) are not bounded by it.

Classes, not instances, go to uvicorn (`Config(http=...)`), and with several gateway processes uvicorn
hands its config to each by pickling; so the protocols are module-level classes and the timeout travels
as an attribute of uvicorn's config (`HEADER_TIMEOUT_ATTR`), read when each connection starts.
"""

from __future__ import annotations

import asyncio
import importlib.util

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
"""Default: headers are a few hundred bytes; ten seconds is generous for a slow link, short for an attacker."""
HEADER_TIMEOUT_ATTR = "hisparse_header_timeout_s"
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _HeaderDeadline:
    """The deadline itself, armed when a connection opens and cleared when it closes (it comes first in each
    protocol's bases, so these run around uvicorn's own); the subclasses say when a request's headers start and end."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_timeout_s = float(getattr(config, HEADER_TIMEOUT_ATTR, HEADER_TIMEOUT_S))
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._clear_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = asyncio.get_running_loop().call_later(self._header_timeout_s, self._headers_too_slow)

    def _clear_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # never write into a response that is running
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


class H11HeaderTimeout(_HeaderDeadline, H11Protocol):
    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():  # the first byte of a request after a finished one starts its clock
            self._arm_header_deadline()
        super().data_received(data)
        if not self._waiting_for_headers():
            self._clear_header_deadline()

    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE


if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeout(_HeaderDeadline, HttpToolsProtocol):
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_deadline()  # a no-op for the first request: its clock runs from the connection

        def on_headers_complete(self) -> None:
            self._clear_header_deadline()
            super().on_headers_complete()
else:  # uvicorn runs on h11 then (`api.server.http_stack`)
    HttpToolsHeaderTimeout = None


def protocol_class(http: str) -> type:
    """The protocol for uvicorn's `http` choice ("httptools" or "h11"), with the header deadline."""
    return HttpToolsHeaderTimeout if http == "httptools" else H11HeaderTimeout
