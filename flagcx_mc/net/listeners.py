"""Small socket helpers shared by the asyncio servers (handshake, metadata)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from .addresses import format_host_port

__all__ = ["bind_listener", "peer_name", "close_server"]


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


async def close_server(server: "asyncio.AbstractServer | None", conns: "set[asyncio.Task[Any]]") -> None:
    """Stop listening, cancel every connection task and wait for them, then for the server."""
    if server is not None:
        server.close()
    tasks = list(conns)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    if server is not None:
        await server.wait_closed()
