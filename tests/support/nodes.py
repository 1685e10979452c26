"""Far-end processes the fault and session tests restart under one name."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from flagcx_mc._testing.node import NodeProcess

__all__ = ["free_rpc_port", "pinned_node", "wait_all_streams"]


def pinned_node(rpc_port: int, regions: list[int]) -> NodeProcess:
    """A node whose rpc port is pinned, so that a restarted target comes back under the same
    session name ("host:port").  The data port stays random, as in life."""
    return NodeProcess(regions=regions,
                       config={"rpc_port_range": [rpc_port, rpc_port], "data_port_range": [15000, 17000]})


def wait_all_streams(engine: Any, session: str, timeout: float = 5.0) -> int:
    """Wait until the engine's session has every stream connected (the first comes with the
    session, the others after its first large transfer); returns how many that is."""
    peer = engine._state.require_sessions().peek(session).peer
    deadline = time.monotonic() + timeout
    while peer.streams_ready < peer.streams:
        assert time.monotonic() < deadline, f"{session}: {peer.streams_ready} of {peer.streams} streams connected"
        time.sleep(0.02)
    return int(peer.streams)


def free_rpc_port() -> int:
    """A free port outside Mooncake's random rpc range (so no other engine takes it meanwhile)."""
    for port in range(20000 + os.getpid() % 5000, 30000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000..30000")
