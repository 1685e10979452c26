"""Sans-I/O codec for Mooncake's P2PHANDSHAKE frames: bytes in, messages out.

Wire format (Mooncake ``writeString``/``readString``)::

    u64 length, little-endian | u8 type | JSON object text ending in "\\n"

``length`` counts the type byte plus the JSON text. Mooncake writes the length in host
order; every platform it ships on is little-endian, so we fix little-endian. Keeping this
module free of sockets and asyncio lets the tests drive it byte by byte.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import LocalProtocolError, MalformedJsonError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "MIN_MAX_LENGTH",
    "MAX_MAX_LENGTH",
    "HEADER_SIZE",
    "MessageType",
    "Message",
    "encode_message",
    "FrameDecoder",
]

HEADER_SIZE = 8
DEFAULT_MAX_LENGTH = 1 << 20
MIN_MAX_LENGTH = 1 << 20
MAX_MAX_LENGTH = 128 << 20


class MessageType(enum.IntEnum):
    """Type byte of a frame; a reply always carries the type of its request."""

    CONNECTION = 0
    METADATA = 1
    NOTIFY = 2
    PROBE = 3


@dataclass(frozen=True)
class Message:
    """One decoded frame."""

    type: MessageType
    payload: dict[str, Any]


def _resolve_max_length(max_length: int | None) -> int:
    if max_length is None:
        return DEFAULT_MAX_LENGTH
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise LocalProtocolError(f"max_length must be a positive int, not {max_length!r}")
    return max_length


def encode_message(
    type: MessageType | int, payload: dict[str, Any], *, max_length: int | None = None
) -> bytes:
    """Build one frame.

    Args:
        type: the message type; replies must reuse the request's type.
        payload: a JSON object (str keys, JSON-serializable values).
        max_length: cap on the length field; ``None`` means ``DEFAULT_MAX_LENGTH``.

    Returns:
        The complete frame, ready to write.

    Raises:
        LocalProtocolError: unknown type, payload not a dict or not serializable, or a
            frame longer than ``max_length`` (the peer would drop it).
    """
    limit = _resolve_max_length(max_length)
    try:
        mtype = MessageType(type)
    except ValueError:
        raise LocalProtocolError(f"unknown message type {type!r}") from None
    if not isinstance(payload, dict):
        raise LocalProtocolError(f"payload must be a dict, not {_type_name(payload)}")
    try:
        body = orjson.dumps(payload) + b"\n"
    except orjson.JSONEncodeError as exc:
        raise LocalProtocolError(f"payload is not JSON-serializable: {exc}") from None
    length = 1 + len(body)
    if length > limit:
        raise LocalProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return length.to_bytes(HEADER_SIZE, "little") + bytes((mtype,)) + body


def _type_name(value: object) -> str:
    """Name of a value's type, for error messages."""
    return type(value).__name__


class FrameDecoder:
    """Incremental frame parser for one byte stream.

    Accepts the stream split anywhere. It buffers at most one partial frame, and rejects an
    oversized length as soon as the header arrives, so memory stays below
    ``max_length + 8`` whatever the peer sends. After the first error the decoder is
    poisoned: the stream position is unknown, so every later ``feed`` raises.
    """

    def __init__(self, max_length: int | None = None) -> None:
        self._max_length = _resolve_max_length(max_length)
        self._buf = bytearray()
        self._length: int | None = None  # set once the header of the current frame is read
        self._error: Exception | None = None

    @property
    def max_length(self) -> int:
        """Largest accepted value of the length field."""
        return self._max_length

    @property
    def has_partial(self) -> bool:
        """True if bytes of an incomplete frame are buffered."""
        return bool(self._buf) or self._length is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Consume ``data`` and return the messages it completes, in order.

        Raises:
            RemoteProtocolError: zero or oversized length, unknown type byte, or an
                earlier error (poisoned decoder).
            MalformedJsonError: a payload that is not valid JSON or not a JSON object.
        """
        if self._error is not None:
            raise RemoteProtocolError(f"decoder unusable after an earlier error: {self._error}")
        try:
            return self._feed(memoryview(data).cast("B"))
        except (RemoteProtocolError, MalformedJsonError) as exc:
            self._error = exc
            self._buf = bytearray()
            self._length = None
            raise

    def _feed(self, view: memoryview) -> list[Message]:
        out: list[Message] = []
        pos, end = 0, len(view)
        while pos < end:
            if self._length is None:
                take = min(HEADER_SIZE - len(self._buf), end - pos)
                self._buf += view[pos : pos + take]
                pos += take
                if len(self._buf) < HEADER_SIZE:
                    break
                length = int.from_bytes(self._buf, "little")
                self._buf = bytearray()
                if length == 0:
                    raise RemoteProtocolError("frame with zero length")
                if length > self._max_length:
                    raise RemoteProtocolError(
                        f"frame length {length} exceeds the {self._max_length}-byte limit"
                    )
                self._length = length
                continue
            length = self._length
            if not self._buf and end - pos >= length:
                body: bytes | memoryview | bytearray = view[pos : pos + length]
                pos += length
            else:
                take = min(length - len(self._buf), end - pos)
                self._buf += view[pos : pos + take]
                pos += take
                if len(self._buf) < length:
                    break
                body, self._buf = self._buf, bytearray()
            self._length = None
            out.append(_decode_body(body))
        return out


def _decode_body(body: bytes | bytearray | memoryview) -> Message:
    try:
        mtype = MessageType(body[0])
    except ValueError:
        raise RemoteProtocolError(f"unknown message type byte {body[0]}") from None
    try:
        payload = orjson.loads(body[1:])
    except orjson.JSONDecodeError as exc:
        raise MalformedJsonError(f"undecodable JSON in {mtype.name} frame: {exc}") from None
    if not isinstance(payload, dict):
        raise MalformedJsonError(
            f"{mtype.name} payload is a JSON {_type_name(payload)}, not an object"
        )
    return Message(mtype, payload)
