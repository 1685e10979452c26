"""Far-end processes the fault and session tests restart under one name."""

from __future__ import annotations

import os
import socket

from flagcx_mc._testing.node import NodeProcess

__all__ = ["free_rpc_port", "pinned_node"]


def pinned_node(rpc_port: int, regions: list[int]) -> NodeProcess:
    """A node whose rpc port is pinned, so that a restarted target comes back under the same
    session name ("host:port").  The data port stays random, as in life."""
    return NodeProcess(regions=regions,
                       config={"rpc_port_range": [rpc_port, rpc_port], "data_port_range": [15000, 17000]})


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
