"""asyncio handshake listener and one-shot client; all byte handling lives in codec.py.

The server answers each frame with one frame of the same type (Mooncake clients reject
anything else) and keeps reading until EOF, so it serves both Mooncake's
one-request-per-connection clients and clients that reuse a connection. Every failure of
one connection is logged and contained there: the listener keeps serving the others.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import (
    DnsError,
    EngineStateError,
    FlagcxMcError,
    HandshakeRejectedError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    LocalProtocolError,
    MalformedJsonError,
    PeerConnectionError,
    RemoteProtocolError,
)
from ..net.addresses import format_host_port, numeric_stream_addrinfo
from ..net.listeners import BoundedServer, close_writer, peer_name
from .codec import (
    DEFAULT_MAX_LENGTH,
    FrameDecoder,
    Message,
    MessageType,
    encode_message,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_RPC_PORT_RANGE", "LISTEN_BACKLOG", "PORT_ATTEMPTS", "Handler", "HandshakeServer", "request"]

_log = logging.getLogger(__name__)

Handler = Callable[[Message], Awaitable[dict]]

DEFAULT_RPC_PORT_RANGE = (15000, 17000)  # Mooncake's MC_MIN_RPC_PORT..MC_MAX_RPC_PORT default
PORT_ATTEMPTS = 500  # Mooncake's findAvailableTcpPort tries this many random ports
# Hundreds of initiators may reach one engine at once (a cluster starting): a connection the
# backlog has no room for loses its SYN and waits a second for the retransmission.  Mooncake's
# default (MC_HANDSHAKE_LISTEN_BACKLOG) is 128; the kernel caps this at net.core.somaxconn.
LISTEN_BACKLOG = 4096
_READ_CHUNK = 64 * 1024


class HandshakeServer:
    """Listener that dispatches handshake frames to per-type async handlers.

    Args:
        handlers: coroutine per message type; each returns the reply payload.
        max_length: frame length cap (``EngineConfig.handshake_max_length``).
        read_timeout: seconds a connection may sit idle or take to deliver one frame.
        max_connections: connections served at once; at the cap a newcomer takes the slot of the
            connection with the least claim to it (``BoundedServer._admit``).
    """

    def __init__(
        self,
        handlers: Mapping[MessageType, Handler],
        *,
        max_length: int = DEFAULT_MAX_LENGTH,
        read_timeout: float = 5.0,
        max_connections: int = 1024,
    ) -> None:
        if read_timeout <= 0:
            raise InvalidArgumentError(f"read_timeout must be positive, not {read_timeout!r}")
        if max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be >= 1, not {max_connections!r}")
        self._handlers = {MessageType(k): v for k, v in handlers.items()}
        self._max_length = FrameDecoder(max_length).max_length  # validates it early
        self._read_timeout = read_timeout
        self._listener = BoundedServer(
            self._serve, name="handshake listener", log=_log, max_connections=max_connections
        )

    @property
    def port(self) -> int:
        """The bound port (raises EngineStateError before ``start``)."""
        port = self._listener.port
        if port is None:
            raise EngineStateError("handshake server is not started")
        return port

    @property
    def connection_count(self) -> int:
        """Connections currently being served."""
        return self._listener.connection_count

    async def start(self, host: str, port: int | None = 0, *,
                    port_range: tuple[int, int] = DEFAULT_RPC_PORT_RANGE) -> int:
        """Bind to ``host`` only and start accepting.

        Args:
            host: address or name to bind; the first address it resolves to is used.
            port: ``None`` picks like Mooncake (up to 500 random ports from ``port_range``,
                inclusive), ``0`` lets the OS choose, ``> 0`` binds exactly it.

        Returns:
            The bound port.

        Raises:
            EngineStateError: already started or closed.
            DnsError: ``host`` does not resolve.
            EndpointError: no port could be bound.
        """
        self._listener.check_startable()
        if not host:
            raise InvalidArgumentError("host must be given; pass '0.0.0.0' to bind all")
        if port is not None and not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port {port} is outside 0..65535")
        if port is None:
            low, high = port_range
            candidates = [random.randint(low, high) for _ in range(PORT_ATTEMPTS)]
        else:
            candidates = [port]
        bound = await self._listener.start(host, candidates, backlog=LISTEN_BACKLOG)
        _log.debug("handshake server listening on %s", format_host_port(host, bound))
        return bound

    async def close(self) -> None:
        """Stop listening, drop every live connection and wait for their tasks."""
        await self._listener.close()

    def close_without_loop(self) -> None:
        """Release the listening socket after the serving loop has ended."""
        self._listener.close_without_loop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        decoder = FrameDecoder(self._max_length)
        # The connection closes read_timeout after its last useful request (or its start): a
        # peer dribbling bytes, or sending nothing but Probes, cannot keep it open forever.
        deadline = loop.time() + self._read_timeout
        while True:
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                data = await asyncio.wait_for(reader.read(_READ_CHUNK), remaining)
            except asyncio.TimeoutError:
                state = "mid-frame" if decoder.has_partial else "idle"
                _log.info("handshake: closing %s connection from %s", state, peer_name(writer))
                return
            except OSError as exc:
                _log.info("handshake: connection from %s lost: %s", peer_name(writer), exc)
                return
            if not data:
                if decoder.has_partial:
                    _log.warning("handshake: %s closed mid-frame", peer_name(writer))
                return
            try:
                messages = decoder.feed(data)
            except (RemoteProtocolError, MalformedJsonError) as exc:
                _log.warning("handshake: dropping %s: %s", peer_name(writer), exc)
                return
            for message in messages:
                reply, accepted = await self._reply(message)
                writer.write(reply)
                try:
                    await asyncio.wait_for(writer.drain(), self._read_timeout)
                except (OSError, asyncio.TimeoutError) as exc:
                    _log.info("handshake: cannot reply to %s: %r", peer_name(writer), exc)
                    return
                if accepted and message.type != MessageType.PROBE:
                    self._listener.note_useful()
                    deadline = loop.time() + self._read_timeout

    async def _reply(self, message: Message) -> tuple[bytes, bool]:
        """Run the handler and encode its answer, and whether the request was accepted (an
        answer without ``"error"``); any failure becomes an error reply."""
        handler = self._handlers.get(message.type)
        if handler is None:
            payload: dict = {"error": f"unsupported message type {int(message.type)}"}
        else:
            try:
                payload = await handler(message)
                accepted = not payload.get("error")
                return encode_message(message.type, payload, max_length=self._max_length), accepted
            except Exception as exc:  # noqa: BLE001 - reported to the peer instead
                _log.exception("handshake: %s handler failed", message.type.name)
                payload = {"error": str(exc) or type(exc).__name__}
        try:
            return encode_message(message.type, payload, max_length=self._max_length), False
        except LocalProtocolError:
            return encode_message(message.type, {"error": "reply could not be encoded"}), False


async def request(
    host: str,
    port: int,
    type: MessageType,
    payload: dict,
    *,
    timeout: float = 5.0,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> dict:
    """Send one frame to ``host:port`` and return the payload of its one reply.

    Raises:
        LocalProtocolError: ``payload`` cannot be framed.
        DnsError: ``host`` does not resolve.
        PeerConnectionError: refused, reset, or closed before a full reply.
        HandshakeTimeoutError: the whole exchange took longer than ``timeout``.
        RemoteProtocolError: a bad reply frame, or a reply of another type.
        MalformedJsonError: the reply is not a JSON object.
        HandshakeRejectedError: the reply carries a non-empty ``"error"`` string.
    """
    where = format_host_port(host, port)
    limit = max_length
    frame = encode_message(type, payload, max_length=limit)
    mtype = MessageType(type)
    try:
        reply = await asyncio.wait_for(_exchange(host, port, where, frame, limit), timeout)
    except asyncio.TimeoutError:
        raise HandshakeTimeoutError(
            f"{mtype.name} handshake with {where} timed out after {timeout}s"
        ) from None
    if reply.type != mtype:
        raise RemoteProtocolError(
            f"{where} answered a {mtype.name} request with a {reply.type.name} frame"
        )
    error = reply.payload.get("error")
    if isinstance(error, str) and error:
        raise HandshakeRejectedError(f"{where} rejected {mtype.name}: {error}")
    return reply.payload


async def _exchange(host: str, port: int, where: str, frame: bytes, limit: int) -> Message:
    loop = asyncio.get_running_loop()
    infos = numeric_stream_addrinfo(host, port)
    try:
        if infos is None:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DnsError(f"cannot resolve {where}: {exc}") from None
    sock = await _connect_any(infos, where)
    try:
        reader, writer = await asyncio.open_connection(sock=sock, limit=_READ_CHUNK)
    except BaseException:
        sock.close()
        raise
    try:
        writer.write(frame)
        await writer.drain()
        decoder = FrameDecoder(limit)
        while True:
            data = await reader.read(_READ_CHUNK)
            if not data:
                raise PeerConnectionError(f"{where} closed the connection before a full reply")
            try:
                messages = decoder.feed(data)
            except (RemoteProtocolError, MalformedJsonError) as exc:
                raise type(exc)(f"bad reply from {where}: {exc}") from None
            if messages:
                return messages[0]
    except FlagcxMcError:
        raise  # some of ours subclass OSError; keep them as they are
    except OSError as exc:
        raise PeerConnectionError(f"connection to {where} failed: {exc}") from None
    finally:
        await close_writer(writer)


async def _sock_connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, addr: Any) -> None:
    """Connect a non-blocking socket to a resolved address, waiting for it on the loop.  Not
    ``loop.sock_connect``: uvloop's resolves the address again on libuv's thread pool, 4 threads
    a process would start for nothing."""
    err = sock.connect_ex(addr)
    if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
        writable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not writable.done():
                writable.set_result(None)

        loop.add_writer(sock.fileno(), ready)
        try:
            await writable
        finally:
            loop.remove_writer(sock.fileno())
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


async def _connect_any(infos: list[Any], where: str) -> socket.socket:
    """Try each resolved address in turn, like Mooncake's doConnect."""
    loop = asyncio.get_running_loop()
    last: OSError | None = None
    for family, stype, proto, _, addr in infos:
        sock = socket.socket(family, stype, proto)
        try:
            sock.setblocking(False)
            await _sock_connect(loop, sock, addr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise PeerConnectionError(f"cannot connect to {where}: {last}")

