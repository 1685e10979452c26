"""Regions are described in the order they were registered, as Mooncake describes them: the
segment descriptor's ``buffers`` list (what Mooncake initiators read) and
``get_first_buffer_address`` name the first region registered, not the lowest address."""

from __future__ import annotations

import asyncio

import pytest
from support.servers import mooncake_missing

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine
from flagcx_mc._core import CoreEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.control.codec import MessageType
from flagcx_mc.control.handshake import request
from flagcx_mc.net.addresses import parse_host_port

MiB = 1 << 20


@pytest.fixture
def halves():
    """One mapping cut in two: (high, low) addresses of 1 MiB each, high registered first."""
    with HostBuffer(2 * MiB) as buf:
        yield buf, buf.addr + MiB, buf.addr


def test_region_table_lists_regions_in_registration_order():
    with HostBuffer(4 * MiB) as buf:
        a, b, c, d = (buf.addr + i * MiB for i in (2, 0, 3, 1))
        core = CoreEngine("127.0.0.1")
        try:
            for addr in (a, b, c):
                core.register(addr, MiB)
            assert [r[0] for r in core.region_table()] == [a, b, c]
            assert len(core.region_slots()) == 3
            core.unregister(b)
            core.register(d, MiB)
            core.register(b, MiB)  # registered again: now the last
            assert [r[0] for r in core.region_table()] == [a, c, d, b]
            assert len(core.region_slots()) == 4
        finally:
            core.close()


def test_sync_first_buffer_is_the_first_registered(halves):
    buf, high, low = halves
    a, b = TransferEngine(transfer_timeout=10.0), TransferEngine(transfer_timeout=10.0)
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert a.register_memory(high, MiB) == 0 and a.register_memory(low, MiB) == 0
        with HostBuffer(MiB) as mine:
            assert b.register_memory(mine.addr, MiB) == 0
            assert b.get_first_buffer_address(a.session_name) == high
            # The table arriving out of address order still routes by address.
            digest = mine.fill_random()
            assert b.transfer_sync_write(a.session_name, mine.addr, low, MiB) == 0
            assert buf.digest(0, MiB) == digest
    finally:
        a.close()
        b.close()


def test_batch_registration_keeps_the_order_of_its_arguments(halves):
    _, high, low = halves
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert a.batch_register_memory([high, low], [MiB, MiB]) == 0
        assert b.get_first_buffer_address(a.session_name) == high
    finally:
        a.close()
        b.close()


async def test_async_first_buffer_is_the_first_registered(halves):
    _, high, low = halves
    async with AsyncTransferEngine() as a, AsyncTransferEngine() as b:
        await a.initialize("127.0.0.1")
        await b.initialize("127.0.0.1")
        await a.register_memory(high, MiB)
        await a.register_memory(low, MiB)
        assert await b.get_first_buffer_address(a.session_name) == high


@pytest.mark.skipif(bool(mooncake_missing()), reason="Mooncake wheel not importable here")
def test_mooncake_initiator_sees_buffers_in_registration_order(halves):
    buf, high, low = halves
    eng = TransferEngine(transfer_timeout=20.0)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(high, MiB) == 0 and eng.register_memory(low, MiB) == 0
        # The descriptor as a Mooncake peer receives it (its Metadata handshake message).
        host, port = parse_host_port(eng.session_name)
        desc = asyncio.run(request(host, port, MessageType.METADATA, {}))
        assert [b["addr"] for b in desc["buffers"]] == [high, low]
        with NodeProcess(regions=[MiB], engine="mooncake") as node:
            assert node.call("first_buffer_address", segment=eng.session_name)["addr"] == high
            digest = node.call("fill", region=0)["digest"]
            reply = node.call("transfer", op="write", target=eng.session_name, items=[[0, 0, low, MiB]])
            assert reply["rc"] == 0 and buf.digest(0, MiB) == digest
    finally:
        eng.close()
