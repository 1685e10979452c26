"""asyncio glue under h11, shared by the metadata clients and the metadata server.

h11 parses and formats HTTP/1.1; this module feeds one ``h11.Connection`` from an asyncio
``StreamReader`` and hands out its events, with a deadline on each wait and a bound on every
body. Limits the peer exceeds surface as ``h11.RemoteProtocolError`` whose
``error_status_hint`` is the status a server answers (413 for a body, 431 for a head).
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import cast

import h11

__all__ = ["MAX_HEAD", "EventReader", "declared_length", "header", "reason"]

MAX_HEAD = 64 * 1024  # message head (start line and header fields) h11 buffers before it refuses
_READ_CHUNK = 64 * 1024
# h11 checks MAX_HEAD between reads, so a head can pass it by up to one read: reads are this
# small while a head is awaited (a head usually arrives in one of them anyway).
_HEAD_READ_CHUNK = 4 * 1024
_HEAD_STATES = (h11.IDLE, h11.SEND_RESPONSE)  # the peer's state while its next head is awaited


def header(event: h11.Request | h11.Response, name: bytes) -> str | None:
    """A header field's value (repeated fields joined by ``", "``), or ``None`` if absent.

    ``name`` is lower-case, as h11 reports names.
    """
    values = [value for key, value in event.headers if key == name]
    return b", ".join(values).decode("latin-1") if values else None


def declared_length(event: h11.Request | h11.Response) -> int | None:
    """The ``Content-Length`` a message declares (h11 has checked its syntax), else ``None``."""
    value = header(event, b"content-length")
    return int(value) if value is not None else None


def reason(status: int) -> bytes:
    """The standard reason phrase of ``status`` (empty if it has none)."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


class EventReader:
    """Reads the events of one ``h11.Connection`` off a ``StreamReader``.

    Args:
        conn: the connection to feed.
        reader: where its bytes come from.
        pending: bytes already read for it (what a previous connection left unprocessed).
        eof: the stream has already ended after ``pending``.
        blank_lines: empty lines dropped before a request line (a server between requests
            on a kept-alive connection; RFC 9112 2.2); more than that is a 400.
    """

    def __init__(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        *,
        pending: bytes = b"",
        eof: bool = False,
        blank_lines: int = 0,
    ) -> None:
        self._conn = conn
        self._reader = reader
        self._blank_bytes_left = 2 * blank_lines  # a blank line is CRLF
        self._started = blank_lines == 0
        self.eof = False
        self._unfed: list[bytes] = ([pending] if pending else []) + ([b""] if eof else [])

    def _feed(self, data: bytes) -> None:
        if not data:
            self.eof = True
        elif not self._started:
            stripped = data.lstrip(b"\r\n")
            self._blank_bytes_left -= len(data) - len(stripped)
            if self._blank_bytes_left < 0:
                raise h11.RemoteProtocolError("too many empty lines before the request line", 400)
            if not stripped:
                return
            self._started = True
            data = stripped
        self._conn.receive_data(data)  # b"" tells h11 the stream ended

    async def next_event(self, deadline: float | None = None) -> h11.Event | type[h11.PAUSED]:
        """The connection's next event, reading as much as it needs.

        ``deadline`` is an event-loop time (``loop.time()``); ``None`` waits without one.

        Raises:
            h11.RemoteProtocolError: the peer broke HTTP/1.1 or a limit.
            asyncio.TimeoutError: the deadline passed first.
            OSError: the stream failed.
        """
        loop = asyncio.get_running_loop()
        while self._unfed:
            self._feed(self._unfed.pop(0))
        while True:
            event = self._conn.next_event()
            if event is not h11.NEED_DATA:
                return cast("h11.Event | type[h11.PAUSED]", event)
            size = _HEAD_READ_CHUNK if self._conn.their_state in _HEAD_STATES else _READ_CHUNK
            if deadline is None:
                data = await self._reader.read(size)
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                data = await asyncio.wait_for(self._reader.read(size), remaining)
            self._feed(data)

    async def read_body(self, max_body: int, deadline: float | None = None) -> bytes:
        """The rest of the current message's body, up to its ``EndOfMessage``.

        Raises:
            h11.RemoteProtocolError: the body exceeds ``max_body`` (hint 413) or breaks HTTP/1.1.
            asyncio.TimeoutError: the deadline passed first.
            OSError: the stream failed.
        """
        parts: list[bytes] = []
        total = 0
        while True:
            event = await self.next_event(deadline)
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > max_body:
                    raise h11.RemoteProtocolError(f"body exceeds the {max_body}-byte limit", 413)
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a message body", 400)
