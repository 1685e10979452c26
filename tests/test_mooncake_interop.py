"""Wire interop with unmodified Mooncake nodes (the PyPI wheel), both directions, by content."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from support.servers import mooncake_missing

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine, errors
from flagcx_mc._testing.node import NodeProcess

_WHY = mooncake_missing()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"Mooncake wheel not importable here: {_WHY}")

SIZES = [4096, 65536, 1 << 20, 64 << 20]


@pytest.fixture(scope="module")
def mooncake_node():
    proc = NodeProcess(regions=[64 << 20], engine="mooncake")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def ours():
    eng = TransferEngine(transfer_timeout=20.0)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = HostBuffer(64 << 20)
    assert eng.register_memory(buf.addr, buf.size) == 0
    yield eng, buf
    eng.close()
    buf.close()


@pytest.mark.parametrize("size", SIZES)
def test_we_write_and_read_mooncake_memory(ours, mooncake_node, size):
    eng, buf = ours
    digest = buf.fill_random(0, size)
    assert eng.transfer_sync_write(mooncake_node.session, buf.addr, mooncake_node.addr(0), size) == 0
    assert mooncake_node.call("digest", region=0, offset=0, length=size)["digest"] == digest
    digest = mooncake_node.call("fill", region=0, offset=0, length=size)["digest"]
    assert eng.transfer_sync_read(mooncake_node.session, buf.addr, mooncake_node.addr(0), size) == 0
    assert buf.digest(0, size) == digest


@pytest.mark.parametrize("block,count", [(4096, 1024), (1 << 20, 16)])
def test_we_batch_to_mooncake(ours, mooncake_node, block, count):
    eng, buf = ours
    local = [buf.addr + i * block for i in range(count)]
    remote = [mooncake_node.addr(0, (count - 1 - i) * block) for i in range(count)]  # reversed order
    buf.fill_random(0, block * count)
    assert eng.batch_transfer_sync_write(mooncake_node.session, local, remote, [block] * count) == 0
    expected = b"".join(buf.read((count - 1 - j) * block, block) for j in range(count))
    got = mooncake_node.call("digest", region=0, offset=0, length=block * count)["digest"]
    assert got == hashlib.sha256(expected).hexdigest()
    buf.fill(0, 0, block * count)
    assert eng.batch_transfer_sync_read(mooncake_node.session, local, remote, [block] * count) == 0
    assert hashlib.sha256(b"".join(buf.read((count - 1 - j) * block, block) for j in range(count))).hexdigest() == \
        mooncake_node.call("digest", region=0, offset=0, length=block * count)["digest"]


@pytest.mark.parametrize("size", SIZES)
def test_mooncake_writes_and_reads_our_memory(ours, mooncake_node, size):
    eng, buf = ours
    digest = mooncake_node.call("fill", region=0, offset=0, length=size)["digest"]
    reply = mooncake_node.call("transfer", op="write", target=eng.session_name, items=[[0, 0, buf.addr, size]])
    assert reply["rc"] == 0 and buf.digest(0, size) == digest
    digest = buf.fill_random(0, size)
    reply = mooncake_node.call("transfer", op="read", target=eng.session_name, items=[[0, 0, buf.addr, size]])
    assert reply["rc"] == 0
    assert mooncake_node.call("digest", region=0, offset=0, length=size)["digest"] == digest


def test_mooncake_batch_into_us(ours, mooncake_node):
    eng, buf = ours
    block, count = 4096, 1024
    digest = mooncake_node.call("fill", region=0, offset=0, length=block * count)["digest"]
    items = [[0, i * block, buf.addr + i * block, block] for i in range(count)]
    assert mooncake_node.call("transfer", op="write", target=eng.session_name, items=items)["rc"] == 0
    assert buf.digest(0, block * count) == digest


def test_refusals_both_ways(ours, mooncake_node):
    eng, buf = ours
    buf.fill(0x3C, 0, 8192)
    # Mooncake writing outside our regions is refused and nothing lands.
    reply = mooncake_node.call("transfer", op="write", target=eng.session_name, items=[[0, 0, buf.addr - 4096, 8192]])
    assert reply["rc"] != 0
    assert buf.read(0, 8192) == b"\x3c" * 8192
    # And we refuse locally before sending anything outside Mooncake's buffers.
    assert eng.transfer_sync_write(mooncake_node.session, buf.addr, mooncake_node.addr(0) - 8, 64) == -3


@pytest.mark.parametrize("how", ["keyword", "environment"])
async def test_mooncake_framing_can_be_turned_off(mooncake_node, local_buf, monkeypatch, how):
    if how == "keyword":
        settings = {"accept_mooncake_wire": False}
    else:
        monkeypatch.setenv("FLAGCX_MC_ACCEPT_MOONCAKE_WIRE", "0")
        settings = {}
    async with AsyncTransferEngine(**settings) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, 1 << 20)
        local_buf.fill(0x11, 0, 4096)
        # (off the loop: the Mooncake node handshakes with this very loop)
        reply = await asyncio.to_thread(mooncake_node.call, "transfer", op="write", target=eng.session_name,
                                        items=[[0, 0, local_buf.addr, 4096]], timeout=20)
        assert reply["rc"] != 0
        assert local_buf.read(0, 4096) == b"\x11" * 4096


async def test_native_protocol_between_flagcx_mc_nodes(engine, node, local_buf):
    await engine.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 64)
    session = engine._state.require_sessions().peek(node.session)
    assert session is not None and session.desc.native is not None  # negotiated native, not Mooncake's framing


def test_mooncake_v1_peer_is_refused_for_safety():
    from flagcx_mc.engine.sessions import SessionCache
    from flagcx_mc.metadata.descriptor import SegmentDesc

    desc = SegmentDesc(name="x:1", tcp_data_port=5, tcp_proto_version=1)
    with pytest.raises(errors.NotSupportedError, match="v1"):
        SessionCache._check_peer_kind("x:1", desc)
