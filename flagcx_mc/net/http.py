"""Minimal, strict HTTP/1.1 message parsing shared by the metadata client and server.

Only what the metadata protocol needs: a request or status line, header fields, and a
body framed by ``Content-Length`` or ``Transfer-Encoding: chunked`` (or, for responses
only, by the end of the connection). Every size is bounded, every line must end in CRLF,
and anything ambiguous (both framings, conflicting lengths, folded headers, control
characters) is refused: these bytes come off the network. No asyncio import beyond
reading from a ``StreamReader``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from http import HTTPStatus

__all__ = [
    "MAX_HEAD",
    "MAX_HEADERS",
    "HttpViolation",
    "Head",
    "parse_request_head",
    "parse_response_head",
    "read_head",
    "body_framing",
    "read_body",
    "read_until_eof",
    "format_response",
    "close_writer",
]

MAX_HEAD = 64 * 1024  # request/status line plus all header fields, CRLFs included
MAX_HEADERS = 100
_CLOSE_GRACE = 1.0

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rf"({_TOKEN}) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_STATUS_LINE = re.compile(r"HTTP/1\.[01] ([1-9][0-9]{2})(?: [\t\x20-\x7e\x80-\xff]*)?")
_FIELD_NAME = re.compile(_TOKEN)
_BAD_VALUE_CHAR = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(r"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?")


class HttpViolation(Exception):
    """The peer's bytes are not acceptable HTTP/1.1; ``status`` is what a server answers."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Head:
    """A parsed request or status line plus header fields (names lower-cased)."""

    start: tuple[str, ...]  # (method, target, version) or (status,)
    fields: tuple[tuple[str, str], ...]

    def get(self, name: str) -> str | None:
        """The field's value, with repeated fields joined by ``", "``; ``None`` if absent."""
        values = [v for k, v in self.fields if k == name]
        return ", ".join(values) if values else None

    def tokens(self, name: str) -> list[str]:
        """A comma-separated field as lower-cased tokens (``Connection``, ``Transfer-Encoding``)."""
        value = self.get(name)
        if value is None:
            return []
        return [t.strip().lower() for t in value.split(",") if t.strip()]


def _split_lines(raw: bytes) -> list[str]:
    if not raw.endswith(b"\r\n\r\n"):
        raise HttpViolation("message head does not end with an empty line")
    text = raw[:-4].decode("latin-1")
    lines = text.split("\r\n")
    for line in lines:
        if "\r" in line or "\n" in line:
            raise HttpViolation("bare CR or LF in message head")
    return lines


def _parse_fields(lines: list[str]) -> tuple[tuple[str, str], ...]:
    if len(lines) > MAX_HEADERS:
        raise HttpViolation(f"more than {MAX_HEADERS} header fields", 431)
    fields = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            raise HttpViolation("obsolete line folding in header fields")
        name, sep, value = line.partition(":")
        if not sep or not _FIELD_NAME.fullmatch(name):
            raise HttpViolation(f"malformed header field {line[:80]!r}")
        value = value.strip(" \t")
        if _BAD_VALUE_CHAR.search(value):
            raise HttpViolation(f"control character in header field {name!r}")
        fields.append((name.lower(), value))
    return tuple(fields)


def parse_request_head(raw: bytes) -> Head:
    """Parse a request head (``raw`` ends with the empty line).

    Raises:
        HttpViolation: malformed (400), too many fields (431) or not HTTP/1.x (505).
    """
    lines = _split_lines(raw)
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise HttpViolation(f"malformed request line {lines[0][:80]!r}")
    method, target, major, minor = match.groups()
    if major != "1":
        raise HttpViolation(f"HTTP/{major}.{minor} is not supported", 505)
    return Head((method, target, f"1.{minor}"), _parse_fields(lines[1:]))


def parse_response_head(raw: bytes) -> Head:
    """Parse a status line and header fields; ``start`` is ``(status,)``.

    Raises:
        HttpViolation: malformed or not HTTP/1.x.
    """
    lines = _split_lines(raw)
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise HttpViolation(f"malformed status line {lines[0][:80]!r}")
    return Head((match.group(1),), _parse_fields(lines[1:]))


async def read_head(reader: asyncio.StreamReader) -> bytes:
    """Read one message head, up to and including the empty line.

    The reader's ``limit`` must be at least ``MAX_HEAD``.

    Raises:
        HttpViolation: the head is longer than ``MAX_HEAD`` (431).
        asyncio.IncompleteReadError: the connection ended first (``partial`` holds the rest).
    """
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpViolation(f"message head is longer than {MAX_HEAD} bytes", 431) from None
    if len(raw) > MAX_HEAD:
        raise HttpViolation(f"message head is longer than {MAX_HEAD} bytes", 431)
    return raw


def body_framing(head: Head, max_body: int) -> int | None:
    """How the body is framed: its length, or ``None`` for chunked.

    A message with neither field has length 0 (requests; responses handle EOF framing
    themselves).

    Raises:
        HttpViolation: both framings, an unknown transfer coding (501), a bad or
            conflicting ``Content-Length`` (400), or a length above ``max_body`` (413).
    """
    codings = head.tokens("transfer-encoding")
    lengths = [v for k, v in head.fields if k == "content-length"]
    if codings:
        if lengths:
            raise HttpViolation("both Content-Length and Transfer-Encoding")
        if codings != ["chunked"]:
            raise HttpViolation(f"unsupported transfer coding {', '.join(codings)!r}", 501)
        return None
    if not lengths:
        return 0
    values = {v.strip() for text in lengths for v in text.split(",")}
    if len(values) != 1:
        raise HttpViolation("conflicting Content-Length values")
    value = values.pop()
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise HttpViolation(f"invalid Content-Length {value[:40]!r}")
    length = int(value)
    if length > max_body:
        raise HttpViolation(f"body of {length} bytes exceeds the {max_body}-byte limit", 413)
    return length


async def read_body(reader: asyncio.StreamReader, framing: int | None, max_body: int) -> bytes:
    """Read a body framed as ``body_framing`` said (``None`` = chunked).

    Raises:
        HttpViolation: bad chunk syntax (400) or a chunked body above ``max_body`` (413).
        asyncio.IncompleteReadError: the connection ended first.
    """
    if framing is not None:
        return await reader.readexactly(framing) if framing else b""
    parts: list[bytes] = []
    total = 0
    while True:
        line = await _read_line(reader)
        match = _CHUNK_SIZE.fullmatch(line)
        if match is None:
            raise HttpViolation(f"malformed chunk size line {line[:40]!r}")
        size = int(match.group(1), 16)
        if size == 0:
            break
        total += size
        if total > max_body:
            raise HttpViolation(f"chunked body exceeds the {max_body}-byte limit", 413)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise HttpViolation("chunk data not followed by CRLF")
    trailer_bytes = 0
    while True:  # trailer fields are read and dropped
        line = await _read_line(reader)
        if not line:
            return b"".join(parts)
        trailer_bytes += len(line) + 2
        if trailer_bytes > MAX_HEAD:
            raise HttpViolation("trailer section too long", 431)


async def read_until_eof(reader: asyncio.StreamReader, max_body: int) -> bytes:
    """Read a body delimited by the end of the connection (responses only).

    Raises:
        HttpViolation: more than ``max_body`` bytes.
    """
    data = await reader.read(max_body + 1)
    parts = [data]
    total = len(data)
    while data and total <= max_body:
        data = await reader.read(max_body + 1 - total)
        parts.append(data)
        total += len(data)
    if total > max_body:
        raise HttpViolation(f"body exceeds the {max_body}-byte limit", 413)
    return b"".join(parts)


async def _read_line(reader: asyncio.StreamReader) -> str:
    try:
        raw = await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError:
        raise HttpViolation("line too long in chunked body", 431) from None
    line = raw[:-2].decode("latin-1")
    if "\r" in line or "\n" in line:
        raise HttpViolation("bare CR or LF in chunked body")
    return line


def format_response(
    status: int,
    body: bytes,
    *,
    close: bool,
    head_only: bool = False,
    content_type: str = "application/json",
) -> bytes:
    """Encode one response with a ``Content-Length`` body."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Connection: {'close' if close else 'keep-alive'}",
        "",
        "",
    ]
    head = "\r\n".join(lines).encode("latin-1")
    return head if head_only else head + body


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream and wait a bounded time for it to finish."""
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), _CLOSE_GRACE)
