"""The asyncio server skeleton shared by the handshake and metadata servers.

``BoundedServer`` binds one listening socket, serves each accepted connection in its own
task through a handler the server supplies, holds at most ``max_connections`` of them at
once, logs every peer it evicts or fails on, and on ``close`` cancels every connection task
and waits for it. What a server says on a connection lives in its handler; which
connection gives way when the cap is reached lives in ``BoundedServer._admit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DnsError, EndpointError, EngineStateError, InvalidArgumentError
from .addresses import format_host_port

__all__ = ["BoundedServer", "ConnectionHandler", "bind_listener", "close_writer", "peer_name"]

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

_CLOSE_GRACE = 1.0  # bound on waiting for a closed transport to finish


@dataclass
class _Standing:
    """What a connection has done to deserve its slot."""

    since: float           # loop time it was accepted, or last did something useful
    useful: bool = False   # a request was served and accepted (not a bare Probe, not refused)


def bind_listener(family: int, stype: int, proto: int, addr: tuple[Any, ...], backlog: int) -> socket.socket:
    """A non-blocking listening socket bound to exactly ``addr`` (IPv6 sockets are v6-only)."""
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_name(writer: asyncio.StreamWriter) -> str:
    """``host:port`` of the far end, for log lines."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return format_host_port(str(peer[0]), peer[1])
    return str(peer)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream and wait a bounded time for it to finish."""
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), _CLOSE_GRACE)


class BoundedServer:
    """One listening socket; each connection served by ``handler`` in its own task.

    The handler owns the connection's protocol; the writer is closed here once the handler
    returns, raises or is cancelled. A handler's exception is logged with the peer and goes
    no further, so one connection's failure never reaches the event loop or the others.

    Args:
        handler: coroutine serving one connection.
        name: what log lines and errors call this server (``"metadata server"``).
        log: the logger of the module the server belongs to.
        max_connections: connections served at once (see ``_admit``).
        stream_limit: buffer limit of each connection's ``StreamReader``.
    """

    def __init__(
        self,
        handler: ConnectionHandler,
        *,
        name: str,
        log: logging.Logger,
        max_connections: int,
        stream_limit: int = 64 * 1024,
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be a positive int, not {max_connections!r}")
        self._handler = handler
        self._name = name
        self._log = log
        self._max_connections = max_connections
        self._stream_limit = stream_limit
        self._server: asyncio.AbstractServer | None = None
        self._sock: socket.socket | None = None
        self._port: int | None = None
        self._conns: dict[asyncio.Task[Any], _Standing] = {}
        self._closed = False

    @property
    def port(self) -> int | None:
        """The bound port, or ``None`` before ``start``."""
        return self._port

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    @property
    def connection_count(self) -> int:
        """Connections being served now."""
        return len(self._conns)

    def check_startable(self) -> None:
        """Raise EngineStateError if the server was started or closed already."""
        if self._server is not None or self._closed:
            raise EngineStateError(f"{self._name} already started or closed")

    async def start(self, host: str, ports: Sequence[int], *, backlog: int) -> int:
        """Bind the first address ``host`` resolves to, on the first of ``ports`` that binds,
        and start accepting.

        Returns:
            The bound port.

        Raises:
            EngineStateError: already started or closed.
            DnsError: ``host`` does not resolve.
            EndpointError: none of ``ports`` could be bound.
        """
        self.check_startable()
        if not ports:
            raise InvalidArgumentError("no port to bind")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise DnsError(f"cannot resolve {self._name} host {host!r}: {exc}") from None
        family, stype, proto, _, addr = infos[0]
        sock = None
        last: OSError | None = None
        for port in ports:
            try:
                sock = bind_listener(family, stype, proto, (addr[0], port, *addr[2:]), backlog)
                break
            except OSError as exc:
                last = exc
        if sock is None:
            where = format_host_port(host, ports[0] if len(ports) == 1 else 0)
            tried = f" ({len(ports)} ports tried)" if len(ports) > 1 else ""
            raise EndpointError(f"cannot bind {self._name} to {where}{tried}: {last}")
        self.check_startable()  # close() may have run while we resolved
        try:
            # The backlog again: the server listens anew when it starts, by default with 100.
            self._server = await asyncio.start_server(self._on_connect, sock=sock, limit=self._stream_limit,
                                                      backlog=backlog)
        except BaseException:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        self._sock = sock
        return self._port

    def close_without_loop(self) -> None:
        """Release the listening socket when the loop that served it has ended (``close`` needs
        that loop).  Connections the dead loop held are beyond reach here."""
        self._closed = True
        self._server = None
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    async def close(self) -> None:
        """Stop listening, cancel every connection task and wait for them. Idempotent."""
        self._closed = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    def note_useful(self) -> None:
        """Called by a handler, on its connection's task, when a request was served and accepted:
        the connection then outranks connections that only hold their slot."""
        task = asyncio.current_task()
        standing = self._conns.get(task) if task is not None else None
        if standing is not None:
            standing.useful = True
            standing.since = asyncio.get_running_loop().time()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """The connection-cap policy: a new peer is always served.

        Below ``max_connections`` it simply joins.  At the cap the connection with the least
        claim to its slot is closed to make room: one that never had a request accepted
        (idle, unauthenticated, or only probing) before one that did, and among equals the
        one whose last useful request is oldest.  Holding a slot therefore takes useful work,
        and no set of connections can keep newcomers out.
        """
        if len(self._conns) < self._max_connections:
            return True
        victim, standing = min(self._conns.items(), key=lambda item: (item[1].useful, item[1].since))
        self._log.warning("%s: %d connections open; closing the %s one to serve %s", self._name, len(self._conns),
                          "least recently useful" if standing.useful else "idle", peer_name(writer))
        del self._conns[victim]
        victim.cancel()
        return True

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed or not self._admit(writer):
            self._log.warning("%s: refusing %s: %d connections open", self._name, peer_name(writer), len(self._conns))
            writer.transport.abort()
            writer.close()
            return
        self._conns[task] = _Standing(asyncio.get_running_loop().time())
        try:
            await self._handler(reader, writer)
        except asyncio.CancelledError:
            pass  # close() cancels us; end quietly so the loop logs nothing
        except Exception:  # noqa: BLE001 - one peer's failure never reaches the loop
            self._log.exception("%s: connection from %s failed", self._name, peer_name(writer))
        finally:
            self._conns.pop(task, None)
            await close_writer(writer)
