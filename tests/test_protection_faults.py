"""Memory whose protection changed after registration (mprotect) fails the transfers that touch
it, over TCP, with an error code: the kernel's refusal (EFAULT) instead of a SIGSEGV in the
target or the initiator.  Both processes stay up and keep serving their other regions."""

from __future__ import annotations

import pytest
from support.servers import mooncake_missing

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine, errors
from flagcx_mc._testing.node import NodeProcess

KiB = 1024
MiB = 1 << 20


@pytest.fixture
def node():
    """Regions [0] and [1] get their protection changed; [2] stays writable.  One per test: a
    node killed by one test must not fail the next."""
    proc = NodeProcess(regions=[MiB, MiB, MiB], config={"transfer_timeout": 10.0})
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def ours():
    eng = TransferEngine(transfer_timeout=10.0)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = HostBuffer(4 * MiB)
    assert eng.register_memory(buf.addr, buf.size) == 0
    yield eng, buf
    eng.close()
    buf.close()


@pytest.fixture
def protect(node):
    """protect(region, access) on the node; every region is made "rw" again afterwards."""
    yield lambda region, access: node.call("protect", region=region, access=access)
    for region in range(3):
        node.call("protect", region=region, access="rw")


def _node_still_serves(node, ours) -> None:
    """The node answers commands, and a write to and a read from its untouched region land."""
    eng, buf = ours
    digest = buf.fill_random(3 * MiB, 64 * KiB)
    assert eng.transfer_sync_write(node.session, buf.addr + 3 * MiB, node.addr(2), 64 * KiB) == 0
    assert node.call("digest", region=2, offset=0, length=64 * KiB)["digest"] == digest
    remote = node.call("fill", region=2, offset=0, length=64 * KiB)["digest"]
    assert eng.transfer_sync_read(node.session, buf.addr + 3 * MiB, node.addr(2), 64 * KiB) == 0
    assert buf.digest(3 * MiB, 64 * KiB) == remote


# Sizes: one small request (its payload comes through the target's buffered reader), one large
# enough to be received straight into place (and sent zero-copy), and a vector of small blocks.
SHAPES = [(64, 1), (256 * KiB, 1), (4 * KiB, 16)]


@pytest.mark.parametrize("block,count", SHAPES)
def test_write_into_a_region_made_read_only_fails_and_the_target_lives(node, ours, protect, block, count):
    eng, buf = ours
    node.call("set", byte=0x5A, region=0)
    protect(0, "r")
    buf.fill_random(0, block * count)
    local = [buf.addr + i * block for i in range(count)]
    rc = eng.batch_transfer_sync_write(node.session, local, [node.addr(0, 4 * KiB + i * block) for i in range(count)],
                                       [block] * count)
    assert rc < 0
    _node_still_serves(node, ours)
    protect(0, "rw")
    assert node.call("count_byte", region=0, byte=0x5A)["count"] == MiB  # nothing landed
    # Writable again: the same write lands.
    digest = buf.digest(0, block * count)
    rc = eng.batch_transfer_sync_write(node.session, local, [node.addr(0, i * block) for i in range(count)],
                                       [block] * count)
    assert rc == 0 and node.call("digest", region=0, offset=0, length=block * count)["digest"] == digest


def test_vector_with_one_read_only_destination_lands_the_others(node, ours, protect):
    """A vector spanning a writable and a read-only region: the read-only entries are refused,
    the others land, and the call fails."""
    eng, buf = ours
    node.call("set", byte=0x11, region=0)
    node.call("set", byte=0x22, region=2, offset=0, length=64 * KiB)
    protect(0, "r")
    buf.fill_random(0, 16 * 4 * KiB)
    local = [buf.addr + i * 4 * KiB for i in range(16)]
    remote = [node.addr(2 if i % 2 else 0, i * 4 * KiB) for i in range(16)]
    assert eng.batch_transfer_sync_write(node.session, local, remote, [4 * KiB] * 16) < 0
    for i in range(1, 16, 2):
        remote = node.call("digest", region=2, offset=i * 4 * KiB, length=4 * KiB)["digest"]
        assert remote == buf.digest(i * 4 * KiB, 4 * KiB)
    protect(0, "rw")
    assert node.call("count_byte", region=0, byte=0x11)["count"] == MiB
    _node_still_serves(node, ours)


@pytest.mark.parametrize("block,count", SHAPES)
def test_read_from_a_region_made_inaccessible_fails_and_the_target_lives(node, ours, protect, block, count):
    eng, buf = ours
    protect(1, "")
    local = [buf.addr + i * block for i in range(count)]
    rc = eng.batch_transfer_sync_read(node.session, local, [node.addr(1, i * block) for i in range(count)],
                                      [block] * count)
    assert rc < 0
    protect(1, "rw")
    _node_still_serves(node, ours)


@pytest.mark.parametrize("block,count", SHAPES)
def test_read_into_a_local_buffer_made_read_only_fails_and_the_initiator_lives(node, ours, protect, block, count):
    """The node is the initiator here: its destination region is read-only."""
    eng, buf = ours
    theirs = buf.fill_random(0, block * count)
    node.call("set", byte=0x33, region=0)
    protect(0, "r")
    items = [[0, i * block, buf.addr + i * block, block] for i in range(count)]
    assert node.call("transfer", op="read", target=eng.session_name, items=items)["rc"] < 0
    # The initiator is alive and its other region takes the same read.
    items = [[2, i * block, buf.addr + i * block, block] for i in range(count)]
    assert node.call("transfer", op="read", target=eng.session_name, items=items)["rc"] == 0
    assert node.call("digest", region=2, offset=0, length=block * count)["digest"] == theirs
    protect(0, "rw")
    assert node.call("count_byte", region=0, byte=0x33)["count"] == MiB
    _node_still_serves(node, ours)


@pytest.mark.parametrize("block,count", SHAPES)
def test_write_from_a_source_made_inaccessible_fails_and_the_initiator_lives(node, ours, protect, block, count):
    """The node is the initiator: the source of its write cannot be read."""
    eng, buf = ours
    buf.fill(0x44, 0, block * count)
    protect(0, "")
    items = [[0, i * block, buf.addr + i * block, block] for i in range(count)]
    assert node.call("transfer", op="write", target=eng.session_name, items=items)["rc"] < 0
    protect(0, "rw")
    digest = node.call("fill", region=2, offset=0, length=block * count)["digest"]
    items = [[2, i * block, buf.addr + i * block, block] for i in range(count)]
    assert node.call("transfer", op="write", target=eng.session_name, items=items)["rc"] == 0
    assert buf.digest(0, block * count) == digest
    _node_still_serves(node, ours)


async def test_async_engine_raises_a_typed_error(node, protect):
    protect(0, "r")
    with HostBuffer(MiB) as buf:
        async with AsyncTransferEngine(transfer_timeout=10.0) as eng:
            await eng.initialize("127.0.0.1")
            await eng.register_memory(buf.addr, buf.size)
            with pytest.raises(errors.FlagcxMcError):
                await eng.transfer_sync_write(node.session, buf.addr, node.addr(0), 64)
            digest = buf.fill_random(0, 64)
            await eng.transfer_sync_write(node.session, buf.addr, node.addr(2), 64)
            assert node.call("digest", region=2, offset=0, length=64)["digest"] == digest


@pytest.mark.skipif(bool(mooncake_missing()), reason="Mooncake wheel not importable here")
def test_mooncake_initiator_writing_into_a_read_only_region_gets_a_refusal(node, ours, protect):
    """Mooncake's framing, target side: the write is refused (v2 status), the target lives."""
    node.call("set", byte=0x66, region=0)
    protect(0, "r")
    with NodeProcess(regions=[MiB], engine="mooncake") as mooncake:
        mooncake.call("fill", region=0)
        reply = mooncake.call("transfer", op="write", target=node.session, items=[[0, 0, node.addr(0), 64]])
        assert reply["rc"] != 0
        digest = mooncake.call("digest", region=0, offset=0, length=64 * KiB)["digest"]
        reply = mooncake.call("transfer", op="write", target=node.session, items=[[0, 0, node.addr(2), 64 * KiB]])
        assert reply["rc"] == 0
        assert node.call("digest", region=2, offset=0, length=64 * KiB)["digest"] == digest
    protect(0, "rw")
    assert node.call("count_byte", region=0, byte=0x66)["count"] == MiB
    _node_still_serves(node, ours)

