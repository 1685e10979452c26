"""P2PHANDSHAKE control plane: a sans-I/O frame codec and an asyncio server/client."""

from .codec import (
    DEFAULT_MAX_LENGTH,
    FrameDecoder,
    Message,
    MessageType,
    encode_message,
    max_length_from_env,
)
from .server import Handler, HandshakeServer, request

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "FrameDecoder",
    "Message",
    "MessageType",
    "encode_message",
    "max_length_from_env",
    "Handler",
    "HandshakeServer",
    "request",
]
