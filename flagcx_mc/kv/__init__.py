"""KV-transfer toolkit for prefill/decode serving on top of a transfer engine.

- ``layout``: paged-KV planes and the fewest (src, dst, length) triplets for a request.
- ``messages``: the side channel's versioned, validated messages (orjson, sans-I/O).
- ``side_channel``: ``KVSender`` (prefill) and ``KVReceiver`` (decode) over ZMQ.
- ``ports``: collision-free listener ports and the bootstrap registry that publishes them.
"""

from __future__ import annotations

from .layout import (
    KV_BLOCKS,
    KV_FIRST,
    KV_INNER,
    BufferInfo,
    HeadSplit,
    KVLayout,
    LayoutError,
    Plane,
    TPRank,
    Triplets,
    buffer_info,
    group_contiguous,
    plan,
    plan_group,
    planes_of,
)
from .messages import MessageError, UnsupportedVersionError, WorkerKey
from .ports import (
    BootstrapRegistry,
    RegistryError,
    bind_free,
    check_disjoint,
    fixed_port,
    lookup_workers,
    port_span,
    register_worker,
)
from .side_channel import KVReceiver, KVSender, Outcome, SideChannelError, Status

__all__ = [
    "KV_BLOCKS",
    "KV_FIRST",
    "KV_INNER",
    "BufferInfo",
    "HeadSplit",
    "KVLayout",
    "LayoutError",
    "Plane",
    "TPRank",
    "Triplets",
    "buffer_info",
    "group_contiguous",
    "plan",
    "plan_group",
    "planes_of",
    "MessageError",
    "UnsupportedVersionError",
    "WorkerKey",
    "BootstrapRegistry",
    "RegistryError",
    "bind_free",
    "check_disjoint",
    "fixed_port",
    "lookup_workers",
    "port_span",
    "register_worker",
    "KVReceiver",
    "KVSender",
    "Outcome",
    "SideChannelError",
    "Status",
]
