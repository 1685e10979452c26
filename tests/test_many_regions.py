"""Engines with tens of thousands of registered regions: their descriptor does not fit one 1 MiB
handshake frame in the list form, yet flagcx_mc peers reach every region (compact table, pages),
Mooncake peers get the whole region list or a clear refusal, and the initiator's own table never
gets in the way of its handshakes."""

from __future__ import annotations

import logging
import time

import orjson
import pytest
from support.servers import mooncake_missing

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.control.codec import Message, MessageType
from flagcx_mc.control.handshake import HandshakeServer, request
from flagcx_mc.control.resolvers import P2PResolver
from flagcx_mc.metadata.descriptor import (
    NATIVE_KEY,
    PAGE_KEY,
    BufferDesc,
    NativeInfo,
    RegionDesc,
    SegmentDesc,
    decode_table,
)
from flagcx_mc.metadata.server import MetadataServer
from flagcx_mc.net.addresses import parse_host_port

BLOCK = 4096


def _adjacent(buf: HostBuffer, n: int) -> tuple[list[int], list[int]]:
    """``n`` regions of BLOCK bytes side by side from the start of ``buf``."""
    return [buf.addr + i * BLOCK for i in range(n)], [BLOCK] * n


async def _register_many(eng: AsyncTransferEngine, buf: HostBuffer, n: int) -> float:
    started = time.perf_counter()
    await eng.batch_register_memory(*_adjacent(buf, n))
    return time.perf_counter() - started


def _check_by_content(write, read, src: HostBuffer, target: HostBuffer, indices: list[int]) -> None:
    """Write random bytes into the target's regions ``indices``, read them back into another part
    of ``src``, and compare both the target's memory and what came back with what was sent."""
    k = len(indices)
    for j, i in enumerate(indices):
        src.fill_random(j * BLOCK, BLOCK)
        write(src.addr + j * BLOCK, target.addr + i * BLOCK)
    for j, i in enumerate(indices):
        read(src.addr + (k + j) * BLOCK, target.addr + i * BLOCK)
    for j, i in enumerate(indices):
        sent = src.read(j * BLOCK, BLOCK)
        assert target.read(i * BLOCK, BLOCK) == sent, f"region {i}"
        assert src.read((k + j) * BLOCK, BLOCK) == sent, f"region {i} read back"


async def _check_async(eng: AsyncTransferEngine, name: str, src: HostBuffer, target: HostBuffer,
                       indices: list[int]) -> None:
    k = len(indices)
    for j, i in enumerate(indices):
        src.fill_random(j * BLOCK, BLOCK)
        await eng.transfer_sync_write(name, src.addr + j * BLOCK, target.addr + i * BLOCK, BLOCK)
    for j, i in enumerate(indices):
        await eng.transfer_sync_read(name, src.addr + (k + j) * BLOCK, target.addr + i * BLOCK, BLOCK)
    for j, i in enumerate(indices):
        sent = src.read(j * BLOCK, BLOCK)
        assert target.read(i * BLOCK, BLOCK) == sent, f"region {i}"
        assert src.read((k + j) * BLOCK, BLOCK) == sent, f"region {i} read back"


@pytest.fixture
def bufs():
    made: list[HostBuffer] = []

    def make(size: int) -> HostBuffer:
        made.append(HostBuffer(size))
        return made[-1]

    yield make
    for buf in made:
        buf.close()


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_ten_thousand_regions(bufs, transport):
    n = 10_000
    target_buf, src = bufs(n * BLOCK), bufs(1 << 20)
    async with AsyncTransferEngine(transport=transport) as target, \
            AsyncTransferEngine(transport=transport) as initiator:
        await target.initialize("127.0.0.1")
        await initiator.initialize("127.0.0.1")
        took = await _register_many(target, target_buf, n)
        assert took < 20, f"registering {n} regions took {took:.1f} s"
        await initiator.register_memory(src.addr, src.size)
        await _check_async(initiator, target.session_name, src, target_buf, [0, n // 2, n - 1])
        session = initiator._state.require_sessions().peek(target.session_name)
        assert session is not None and session.desc.native is not None
        assert len(session.desc.native.regions) == n and len(session.desc.buffers) == n
        assert session.peer.same_host == (transport == "same-host")

        # Memory registered after the session opened: the table is read again, then used.
        more = bufs(16 * BLOCK)
        await target.batch_register_memory(*_adjacent(more, 16))
        await _check_async(initiator, target.session_name, src, more, [0, 15])
        assert len(initiator._state.require_sessions().peek(target.session_name).desc.native.regions) == n + 16


@pytest.fixture(scope="module")
def hundred_thousand():
    """A sync engine with 100,000 regions, and a sync engine with one."""
    n = 100_000
    big_buf, small_buf = HostBuffer(n * BLOCK, populate=False), HostBuffer(1 << 20)
    big, small = TransferEngine(), TransferEngine()
    try:
        assert big.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert small.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        started = time.perf_counter()
        assert big.batch_register_memory(*_adjacent(big_buf, n)) == 0
        took = time.perf_counter() - started
        assert took < 60, f"registering {n} regions took {took:.1f} s"
        assert small.register_memory(small_buf.addr, small_buf.size) == 0
        yield n, big, big_buf, small, small_buf
    finally:
        big.close()
        small.close()
        big_buf.close()
        small_buf.close()


def _sync_ops(eng: TransferEngine, name: str):
    def write(local: int, remote: int) -> None:
        assert eng.transfer_sync_write(name, local, remote, BLOCK) == 0

    def read(local: int, remote: int) -> None:
        assert eng.transfer_sync_read(name, local, remote, BLOCK) == 0

    return write, read


def test_hundred_thousand_regions_target(hundred_thousand):
    n, big, big_buf, small, small_buf = hundred_thousand
    name = f"127.0.0.1:{big.get_rpc_port()}"
    table = big._engine._state._segment.desc().native.to_json_dict(compact=True)
    assert len(orjson.dumps(table)) > 1 << 20  # even the compact table takes more than one frame
    _check_by_content(*_sync_ops(small, name), small_buf, big_buf, [0, n // 2, n - 1])


def test_hundred_thousand_regions_refresh(hundred_thousand):
    n, big, big_buf, small, small_buf = hundred_thousand
    name = f"127.0.0.1:{big.get_rpc_port()}"
    _check_by_content(*_sync_ops(small, name), small_buf, big_buf, [1])  # session open
    more = HostBuffer(8 * BLOCK)
    try:
        assert big.batch_register_memory(*_adjacent(more, 8)) == 0
        _check_by_content(*_sync_ops(small, name), small_buf, more, [7])
        assert big.batch_unregister_memory(_adjacent(more, 8)[0]) == 0
    finally:
        more.close()


def test_hundred_thousand_regions_initiator(hundred_thousand):
    """The engine with 100,000 regions opens a session to one with a single region."""
    n, big, big_buf, small, small_buf = hundred_thousand
    name = f"127.0.0.1:{small.get_rpc_port()}"
    big_buf.fill_random(0, 4 * BLOCK)
    _check_by_content(*_sync_ops(big, name), big_buf, small_buf, [0, 100, 255])


async def _raw_metadata(eng: AsyncTransferEngine, payload: dict) -> dict:
    host, port = parse_host_port(eng.session_name)
    return await request(host, port, MessageType.METADATA, payload)


async def test_pages_of_one_table_and_restarts(bufs):
    """Small frames make many pages; a table that changes between pages is read again, and one
    that never stops changing is given up on rather than used in part."""
    n = 3000
    target_buf = bufs((n + 64) * BLOCK)
    async with AsyncTransferEngine() as target:
        await target.initialize("127.0.0.1")
        await target.batch_register_memory(*_adjacent(target_buf, n))
        pages: list[int] = []

        class Counting(P2PResolver):
            async def _page(self, host, port, local, start, version):
                pages.append(start)
                return await super()._page(host, port, local, start, version)

        resolver = Counting(dict, timeout=5.0, max_length=8192)
        _, _, desc = await resolver.resolve(target.session_name)
        assert len(pages) > 4 and pages[0] == 0
        assert [(r.addr, r.length) for r in desc.native.regions] == list(zip(*_adjacent(target_buf, n), strict=True))
        assert [b.addr for b in desc.buffers] == [r.addr for r in desc.native.regions]

        added = [n]

        class Changing(P2PResolver):
            async def _page(self, host, port, local, start, version):
                if start and added[0] < n + 3:  # the table changes under the first three readings
                    await target.register_memory(target_buf.addr + added[0] * BLOCK, BLOCK)
                    added[0] += 1
                return await super()._page(host, port, local, start, version)

        _, _, desc = await Changing(dict, timeout=5.0, max_length=8192).resolve(target.session_name)
        assert len(desc.native.regions) == n + 3

        class Restless(P2PResolver):
            MAX_TABLE_READS = 3

            async def _page(self, host, port, local, start, version):
                if start:
                    await target.register_memory(target_buf.addr + added[0] * BLOCK, BLOCK)
                    added[0] += 1
                return await super()._page(host, port, local, start, version)

        with pytest.raises(errors.HandshakeRejectedError, match="changed"):
            await Restless(dict, timeout=5.0, max_length=8192).resolve(target.session_name)

        # A page asked for past the table's end is refused.
        with pytest.raises(errors.HandshakeRejectedError):
            await _raw_metadata(target, {PAGE_KEY: {"start": 10 * n}})


async def test_mooncake_requests_whole_list_or_refusal(bufs, caplog):
    """An initiator that does not ask for pages gets the list form while it fits, then Mooncake's
    keys alone (every buffer), then an error that says why; never part of the list."""
    target_buf = bufs(20_000 * BLOCK)
    async with AsyncTransferEngine() as target:
        await target.initialize("127.0.0.1")
        await target.batch_register_memory(*_adjacent(target_buf, 1000))
        reply = await _raw_metadata(target, {"name": "someone", "buffers": []})
        assert len(reply["buffers"]) == 1000 and len(reply[NATIVE_KEY]["regions"]) == 1000

        await target.batch_register_memory([a + 1000 * BLOCK for a in _adjacent(target_buf, 9000)[0]], [BLOCK] * 9000)
        reply = await _raw_metadata(target, {})
        assert NATIVE_KEY not in reply and len(reply["buffers"]) == 10_000
        desc = SegmentDesc.from_json_dict(reply)
        assert [b.addr for b in desc.buffers] == _adjacent(target_buf, 10_000)[0]

        await target.batch_register_memory([a + 10_000 * BLOCK for a in _adjacent(target_buf, 10_000)[0]],
                                           [BLOCK] * 10_000)
        with caplog.at_level(logging.WARNING), pytest.raises(errors.HandshakeRejectedError, match="do not fit"):
            await _raw_metadata(target, {})
        assert any("20000 registered regions do not fit" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(bool(mooncake_missing()), reason="Mooncake wheel not importable here")
def test_mooncake_peer_and_many_regions():
    """A real Mooncake engine writes into region 5,000 of 10,000 (Mooncake's keys alone fit), and
    is refused, not misled, by 20,000."""
    buf = HostBuffer(20_000 * BLOCK, populate=False)
    eng = TransferEngine()
    peer = NodeProcess(regions=[1 << 20], engine="mooncake")
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        addrs, lengths = _adjacent(buf, 10_000)
        assert eng.batch_register_memory(addrs, lengths) == 0
        digest = peer.call("fill", region=0, offset=0, length=BLOCK)["digest"]
        reply = peer.call("transfer", op="write", target=eng.session_name, items=[[0, 0, addrs[5000], BLOCK]])
        assert reply["rc"] == 0
        assert buf.digest(5000 * BLOCK, BLOCK) == digest
        eng.close()

        eng = TransferEngine()
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.batch_register_memory(*_adjacent(buf, 20_000)) == 0
        reply = peer.call("transfer", op="write", target=eng.session_name, items=[[0, 0, buf.addr, BLOCK]])
        assert reply["rc"] != 0
    finally:
        peer.close()
        eng.close()
        buf.close()


async def test_large_descriptor_in_http_store(bufs):
    """A metadata server takes a 10,000-region descriptor (regions as a table) and a peer reaches
    region 5,000 through it; a server whose body limit is too small refuses the registration,
    which is then undone."""
    n = 10_000
    target_buf, src = bufs(n * BLOCK), bufs(1 << 20)
    server = MetadataServer("127.0.0.1", 0)
    await server.start()
    try:
        async with AsyncTransferEngine() as target, AsyncTransferEngine() as initiator:
            await target.initialize("127.0.0.1:7101", server.url, "tcp", "")
            await initiator.initialize("127.0.0.1:7102", server.url, "tcp", "")
            await target.batch_register_memory(*_adjacent(target_buf, n))
            await initiator.register_memory(src.addr, src.size)
            await _check_async(initiator, "127.0.0.1:7101", src, target_buf, [0, n // 2, n - 1])
    finally:
        await server.close()
    small = MetadataServer("127.0.0.1", 0, max_body=64 << 10)
    await small.start()
    try:
        async with AsyncTransferEngine() as target:
            await target.initialize("127.0.0.1:7103", small.url, "tcp", "")
            with pytest.raises(errors.MetadataError):
                await target.batch_register_memory(*_adjacent(target_buf, n))
            assert target._state._core.region_table() == []
    finally:
        await small.close()


async def test_pages_signed_with_a_secret(bufs):
    """With a shared secret every page is a signed request and a signed reply."""
    n = 3000
    target_buf = bufs(n * BLOCK)
    async with AsyncTransferEngine(secret="pages") as target:
        await target.initialize("127.0.0.1")
        await target.batch_register_memory(*_adjacent(target_buf, n))
        _, _, desc = await P2PResolver(dict, timeout=5.0, secret=b"pages", max_length=8192).resolve(target.session_name)
        assert desc.native is not None and len(desc.native.regions) == n
        with pytest.raises(errors.HandshakeRejectedError):
            await P2PResolver(dict, timeout=5.0, max_length=8192).resolve(target.session_name)


async def test_target_without_pages():
    """A target that ignores the page request (flagcx_mc before pages) answers the list form whole,
    and that is the descriptor."""
    regions = tuple(RegionDesc(0x7F00_0000_0000 + i * BLOCK, BLOCK, i + 1) for i in range(50))
    buffers = tuple(BufferDesc("old", r.addr, r.length) for r in regions)
    native = NativeInfo(1, 16011, regions, "boot", 4242)
    desc = SegmentDesc(name="old", tcp_data_port=16011, buffers=buffers, native=native)

    async def metadata(message: Message) -> dict:
        return desc.to_json_dict()

    async with HandshakeServer({MessageType.METADATA: metadata}) as server:
        await server.start("127.0.0.1", 0)
        _, _, got = await P2PResolver(dict, timeout=5.0).resolve(f"127.0.0.1:{server.port}")
    assert got.native is not None and got.native.regions == regions and got.buffers == desc.buffers


_GOOD_TABLE = {"n": 2, "addr": [4096, 0], "length": [4096, 0], "key": "AQAAAAIAAAA=", "slot": [1, 1], "gen": [1, 0]}


@pytest.mark.parametrize("change", [
    {"key": "AQAAAA=="},  # one key for two regions
    {"key": "not base64!"},
    {"addr": [4096]},
    {"length": [4096, True]},
    {"addr": [2**64 - 4096, 0]},  # the second region would start at 2**64
    {"slot": [-5, 0]},
    {"cuda": {"2": {"dev": 0}}},  # no region 2
    {"shm": {"0": [3, 1]}},  # not the region's length
    {"version": "v", "start": 1, "total": 2},  # runs past the table's end
])
def test_malformed_tables_are_refused(change):
    table = {**_GOOD_TABLE, **change}
    with pytest.raises(errors.MalformedJsonError):
        decode_table(table, "t")


def test_table_decodes():
    regions, page = decode_table(_GOOD_TABLE, "t")
    assert page is None
    assert regions == [RegionDesc(4096, 4096, 1, 0, 1), RegionDesc(8192, 4096, 2, 1, 1)]
