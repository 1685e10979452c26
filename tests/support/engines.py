"""Two async engines on loopback for tests: a target with one buffer registered, an initiator
with the others; everything closed afterwards."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from flagcx_mc import AsyncTransferEngine, HostBuffer


@contextlib.asynccontextmanager
async def engine_pair(transport: str, remote: HostBuffer,
                      *local: HostBuffer) -> AsyncIterator[tuple[AsyncTransferEngine, AsyncTransferEngine]]:
    """``(target, initiator)``: ``remote`` registered on the target, ``local`` on the initiator;
    both engines closed, and every buffer, afterwards."""
    target = AsyncTransferEngine(transport=transport)
    try:
        async with AsyncTransferEngine(transport=transport) as eng:
            await target.initialize("127.0.0.1")
            await target.register_memory(remote.addr, remote.size)
            await eng.initialize("127.0.0.1")
            await eng.batch_register_memory([b.addr for b in local], [b.size for b in local])
            yield target, eng
    finally:
        await target.close()
        for b in (remote, *local):
            b.close()
