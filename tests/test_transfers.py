"""Two engines in two processes on 127.0.0.1: writes and reads verified by content."""

from __future__ import annotations

import asyncio
import random

import pytest

from flagcx_mc import errors

# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = pytest.mark.uvloop

SIZES = [1, 7, 4096, 65536 + 3, 1 << 20, (4 << 20) + 1, 64 << 20]


@pytest.mark.parametrize("size", SIZES)
async def test_write_then_read_one_block(engine, node, local_buf, size):
    digest = local_buf.fill_random(0, size)
    await engine.transfer_sync_write(node.session, local_buf.addr, node.addr(0, 5), size)
    assert node.call("digest", region=0, offset=5, length=size)["digest"] == digest

    remote_digest = node.call("fill", region=0, offset=11, length=size)["digest"]
    await engine.transfer_sync_read(node.session, local_buf.addr, node.addr(0, 11), size)
    assert local_buf.digest(0, size) == remote_digest
    assert node.call("guards")["intact"]


@pytest.mark.parametrize("count,block", [(1, 4096), (1024, 4096), (10_000, 512), (64, 1 << 20)])
async def test_batches_scattered(engine, node, local_buf, count, block):
    # Scatter: remote slots in shuffled order, so a mix-up of descriptors shows in the checksum.
    slots = list(range(count))
    random.shuffle(slots)
    local = [local_buf.addr + i * block for i in range(count)]
    remote = [node.addr(0, s * block) for s in slots]
    local_buf.fill_random(0, count * block)
    await engine.batch_transfer_sync_write(node.session, local, remote, [block] * count)
    expected = bytearray(count * block)
    for i, s in enumerate(slots):
        expected[s * block:(s + 1) * block] = local_buf.read(i * block, block)
    import hashlib

    got = node.call("digest", region=0, offset=0, length=count * block)["digest"]
    assert got == hashlib.sha256(expected).hexdigest()

    # And back: read the shuffled slots into order, which must reproduce the original.
    original = local_buf.digest(0, count * block)
    local_buf.fill(0, 0, count * block)
    await engine.batch_transfer_sync_read(node.session, local, remote, [block] * count)
    assert local_buf.digest(0, count * block) == original


async def test_many_concurrent_tasks(engine, node, local_buf):
    block, tasks = 256 << 10, 48
    local_buf.fill_random(0, block * tasks)

    async def one(i):
        await engine.transfer_sync_write(node.session, local_buf.addr + i * block, node.addr(0, i * block), block)

    await asyncio.gather(*(one(i) for i in range(tasks)))
    assert node.call("digest", region=0, offset=0, length=block * tasks)["digest"] == local_buf.digest(0, block * tasks)


async def test_empty_batch_is_a_no_op(engine, node, local_buf):
    """Empty batches succeed without contacting the peer: no session is opened, no byte moves."""
    remote_before = node.call("fill", region=1)["digest"]
    local_before = local_buf.fill_random(0, 4096)
    assert await engine.batch_transfer_sync_write(node.session, [], [], []) is None
    assert await engine.batch_transfer_sync_read(node.session, [], [], []) is None
    assert engine._state.require_sessions().peek(node.session) is None
    assert node.call("digest", region=1)["digest"] == remote_before
    assert local_buf.digest(0, 4096) == local_before
    assert node.call("guards")["intact"]


async def test_mismatched_lists_are_invalid(engine, node, local_buf):
    with pytest.raises(errors.InvalidArgumentError):
        await engine.batch_transfer_sync_write(node.session, [local_buf.addr], [node.addr(0)], [1, 2])
    with pytest.raises(errors.InvalidArgumentError):
        await engine.batch_transfer_sync_write(node.session, [local_buf.addr], [-1], [4])
    with pytest.raises(errors.InvalidArgumentError):
        await engine.batch_transfer_sync_write(node.session, [local_buf.addr], [node.addr(0)], [1.5])


@pytest.mark.parametrize("where", ["before_region", "straddles_end", "far_away", "wraps_2_64"])
async def test_write_outside_remote_region_is_refused(engine, node, local_buf, where):
    size = 8192
    base, length = node.regions[1]
    remote = {
        "before_region": base - 4096,
        "straddles_end": base + length - 4096,
        "far_away": 0x10,
        "wraps_2_64": (1 << 64) - 4096,
    }[where]
    before = node.call("digest", region=1)["digest"]
    local_buf.fill_random(0, size)
    with pytest.raises(errors.AddressNotRegisteredError):
        await engine.transfer_sync_write(node.session, local_buf.addr, remote, size)
    with pytest.raises(errors.AddressNotRegisteredError):
        await engine.transfer_sync_read(node.session, local_buf.addr, remote, size)
    assert node.call("digest", region=1)["digest"] == before
    assert node.call("guards")["intact"]


async def test_local_range_must_be_registered(engine, node, local_buf):
    with pytest.raises(errors.AddressNotRegisteredError):
        await engine.transfer_sync_write(node.session, local_buf.addr + local_buf.size - 100, node.addr(1), 200)
    with pytest.raises(errors.AddressNotRegisteredError):
        await engine.transfer_sync_read(node.session, 0x1000, node.addr(1), 64)


async def test_memory_registered_after_first_contact_is_reachable(engine, node, local_buf):
    await engine.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 64)  # session now cached
    new = node.call("add_region", size=1 << 16)
    digest = local_buf.fill_random(0, 1 << 16)
    await engine.transfer_sync_write(node.session, local_buf.addr, new["addr"], 1 << 16)
    assert node.call("digest", region=new["index"])["digest"] == digest


async def test_unregistered_remote_region_is_refused_after_refresh(engine, node, local_buf):
    new = node.call("add_region", size=1 << 16)
    await engine.transfer_sync_write(node.session, local_buf.addr, new["addr"], 4096)
    assert node.call("unregister", region=new["index"])["rc"] == 0
    node.call("set", region=new["index"], byte=0x5A)
    local_buf.fill(0x11, 0, 4096)
    with pytest.raises(errors.AddressNotRegisteredError):
        await engine.transfer_sync_write(node.session, local_buf.addr, new["addr"], 4096)
    assert node.call("count_byte", region=new["index"], byte=0x11)["count"] == 0


async def test_unknown_session_fails_fast(engine, local_buf):
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(errors.DnsError):
        await engine.transfer_sync_write("no-such-host.invalid:15000", local_buf.addr, 0x1000, 8)
    with pytest.raises(errors.PeerConnectionError):
        await engine.transfer_sync_write("127.0.0.1:1", local_buf.addr, 0x1000, 8)
    with pytest.raises(errors.InvalidArgumentError):
        await engine.transfer_sync_write("not a session", local_buf.addr, 0x1000, 8)
    assert loop.time() - start < 8


async def test_concurrent_first_transfers_share_one_session(engine, node, local_buf):
    local_buf.fill_random(0, 32 * 4096)
    await asyncio.gather(*(
        engine.transfer_sync_write(node.session, local_buf.addr + i * 4096, node.addr(1, i * 4096), 4096)
        for i in range(32)
    ))
    assert engine._state.require_sessions().peek(node.session) is not None
    # Earlier tests' engines may still be closing their connections: wait for them to go.  One
    # session, and small calls: its first stream only (the others come with a larger transfer).
    deadline = asyncio.get_running_loop().time() + 5
    while node.call("stats")["server_connections"] != 1:
        assert asyncio.get_running_loop().time() < deadline, "one session must open exactly one stream"
        await asyncio.sleep(0.05)
    assert node.call("digest", region=1, offset=0, length=32 * 4096)["digest"] == local_buf.digest(0, 32 * 4096)
