"""Unregister during incoming traffic: later operations are refused and nothing lands after it returns."""

from __future__ import annotations

import asyncio

import pytest

from flagcx_mc import AsyncTransferEngine, errors


@pytest.fixture(params=["tcp", "same-host"])
async def engine(request, local_buf):
    """Both ways a byte can reach the target: its data server (TCP), or a same-host copy that
    the target's control block fences."""
    async with AsyncTransferEngine(transfer_timeout=10.0, transport=request.param) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        yield eng


async def test_unregister_under_write_traffic(engine, local_buf):
    from flagcx_mc._testing.node import NodeProcess

    target = await asyncio.to_thread(NodeProcess, regions=[32 << 20])
    try:
        local_buf.fill(0x77, 0, 32 << 20)
        results = []
        stop = asyncio.Event()

        async def writer():
            while not stop.is_set():
                try:
                    await engine.transfer_sync_write(target.session, local_buf.addr, target.addr(0), 32 << 20)
                    results.append(0)
                except errors.FlagcxMcError as exc:
                    results.append(exc.code)
                    await asyncio.sleep(0.01)

        task = asyncio.ensure_future(writer())
        while not results:
            await asyncio.sleep(0.01)
        reply = await asyncio.to_thread(target.call, "unregister", region=0)
        assert reply["rc"] == 0
        # Once unregister returned, the region belongs to its owner again: overwrite it and make
        # sure none of the initiator's bytes (0x77) arrive any more.
        await asyncio.to_thread(target.call, "set", region=0, byte=0x00)
        failures_before = sum(1 for r in results if r != 0)
        await asyncio.sleep(0.5)
        stop.set()
        await task
        assert (await asyncio.to_thread(target.call, "count_byte", region=0, byte=0x77))["count"] == 0
        assert sum(1 for r in results if r != 0) > failures_before  # later writes were refused
        assert results[0] == 0  # and the traffic really ran before
        # The target keeps serving: a new region works.
        new = await asyncio.to_thread(target.call, "add_region", size=1 << 20)
        digest = local_buf.fill_random(0, 1 << 20)
        await engine.transfer_sync_write(target.session, local_buf.addr, new["addr"], 1 << 20)
        assert (await asyncio.to_thread(target.call, "digest", region=new["index"]))["digest"] == digest
    finally:
        await asyncio.to_thread(target.close)
