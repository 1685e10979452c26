"""The engine: both facades over one shared state, and what they share.

- ``async_engine``: ``AsyncTransferEngine``, every Mooncake method as a coroutine;
- ``sync_engine``: ``TransferEngine``, Mooncake's exact signatures and int returns;
- ``sessions``: peers resolved once, a transport chosen, connections kept and refreshed;
- ``requests`` / ``batches``: validated transfer requests and async batch ids;
- ``metrics``: per-peer counters and histograms; ``managed``: engine-allocated buffers.
"""

from __future__ import annotations

from .async_engine import AsyncTransferEngine
from .sync_engine import TransferEngine

__all__ = ["AsyncTransferEngine", "TransferEngine"]
