"""Engines that find each other through a metadata server (HTTP, Redis, etcd) instead of P2P names."""

from __future__ import annotations

import asyncio

import pytest
from support.servers import REDIS_PASSWORD, free_port, mooncake_missing, need_redis_package

from flagcx_mc import AsyncTransferEngine, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.metadata.http_store import HttpMetadataStore
from flagcx_mc.metadata.keys import rpc_meta_key, segment_key
from flagcx_mc.metadata.server import MetadataServer


@pytest.fixture
async def http_metadata():
    server = MetadataServer("127.0.0.1", 0)
    await server.start()
    yield server.url
    await server.close()


@pytest.fixture
def redis_metadata(redis_port, monkeypatch):
    need_redis_package()
    monkeypatch.setenv("MC_REDIS_PASSWORD", REDIS_PASSWORD)
    return f"redis://127.0.0.1:{redis_port}"


@pytest.fixture
def etcd_metadata(etcd_port):
    return f"etcd://127.0.0.1:{etcd_port}"


async def _node(url: str, name: str, size: int = 4 << 20) -> NodeProcess:
    return await asyncio.to_thread(NodeProcess, host=name, regions=[size], metadata_server=url,
                                   env={"MC_REDIS_PASSWORD": REDIS_PASSWORD, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})


async def _exercise(url: str, local_buf) -> None:
    async with AsyncTransferEngine(transfer_timeout=10.0) as eng:
        await eng.initialize("127.0.0.1:7001", url, "tcp", "")
        assert eng.session_name == "127.0.0.1:7001"  # the segment name is local_hostname verbatim
        await eng.register_memory(local_buf.addr, 8 << 20)
        target = await _node(url, "decode-0")
        try:
            digest = local_buf.fill_random(0, 4 << 20)
            await eng.transfer_sync_write("decode-0", local_buf.addr, target.addr(0), 4 << 20)
            got = await asyncio.to_thread(target.call, "digest", region=0)
            assert got["digest"] == digest
            # Memory the target registers later is published and reachable.
            new = await asyncio.to_thread(target.call, "add_region", size=1 << 20)
            digest = local_buf.fill_random(0, 1 << 20)
            await eng.transfer_sync_write("decode-0", local_buf.addr, new["addr"], 1 << 20)
            assert (await asyncio.to_thread(target.call, "digest", region=new["index"]))["digest"] == digest
            # The target reaches us by our segment name too (reads back what we hold).
            reply = await asyncio.to_thread(target.call, "transfer", op="read", target="127.0.0.1:7001",
                                            items=[[0, 0, local_buf.addr, 1 << 20]])
            assert reply["rc"] == 0
            got = await asyncio.to_thread(target.call, "digest", region=0, offset=0, length=1 << 20)
            assert got["digest"] == digest
        finally:
            await asyncio.to_thread(target.kill)
        # A restarted peer under the same name (new ports, new table) is found without restarting us.
        restarted = await _node(url, "decode-0")
        try:
            digest = local_buf.fill_random(0, 4 << 20)
            await eng.transfer_sync_write("decode-0", local_buf.addr, restarted.addr(0), 4 << 20)
            assert (await asyncio.to_thread(restarted.call, "digest", region=0))["digest"] == digest
        finally:
            await asyncio.to_thread(restarted.close)
        with pytest.raises(errors.MetadataError):
            await eng.transfer_sync_write("nobody", local_buf.addr, 0x1000, 8)


async def test_http_metadata_server(http_metadata, local_buf):
    await _exercise(http_metadata, local_buf)


async def test_redis_metadata_server(redis_metadata, local_buf):
    await _exercise(redis_metadata, local_buf)


async def test_segment_is_withdrawn_on_close(http_metadata, local_buf):
    from flagcx_mc.metadata.http_store import HttpMetadataStore

    async with AsyncTransferEngine() as eng:
        await eng.initialize("prefill-3", http_metadata, "tcp", "")
        async with HttpMetadataStore(http_metadata) as store:
            assert (await store.get(segment_key("prefill-3")))["name"] == "prefill-3"
    async with HttpMetadataStore(http_metadata) as store:
        assert await store.get(segment_key("prefill-3")) is None


async def test_etcd_metadata_server(etcd_metadata, local_buf):
    await _exercise(etcd_metadata, local_buf)


async def test_a_bare_address_is_an_etcd_server_as_in_mooncake(etcd_port, local_buf):
    """Mooncake reads a metadata_server without a scheme as etcd; so do we (and publish there)."""
    from flagcx_mc.metadata.etcd_store import EtcdMetadataStore

    async with AsyncTransferEngine() as eng:
        await eng.initialize("prefill-bare", f"127.0.0.1:{etcd_port}", "tcp", "")
        async with EtcdMetadataStore(f"etcd://127.0.0.1:{etcd_port}") as store:
            assert (await store.get(segment_key("prefill-bare")))["name"] == "prefill-bare"


@pytest.fixture(params=["http", "etcd"])  # the PyPI wheel has no Redis plugin (it aborts on redis://)
def mooncake_capable_metadata(request):
    return request.getfixturevalue(f"{request.param}_metadata")


async def test_an_unmodified_mooncake_node_through_a_metadata_server(mooncake_capable_metadata, local_buf):
    """A Mooncake engine and ours on one metadata server find each other by segment name, both ways."""
    url = mooncake_capable_metadata
    why = await asyncio.to_thread(mooncake_missing)
    if why:
        pytest.skip(f"Mooncake wheel not importable here: {why}")
    name = f"127.0.0.1:{free_port()}"
    target = await asyncio.to_thread(NodeProcess, host=name, regions=[4 << 20], engine="mooncake",
                                     metadata_server=url, env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    try:
        async with AsyncTransferEngine(transfer_timeout=10.0) as eng:
            await eng.initialize("127.0.0.1:7003", url, "tcp", "")
            await eng.register_memory(local_buf.addr, 8 << 20)
            digest = local_buf.fill_random(0, 4 << 20)
            await eng.transfer_sync_write(name, local_buf.addr, target.addr(0), 4 << 20)
            assert (await asyncio.to_thread(target.call, "digest", region=0))["digest"] == digest
            # Mooncake resolves our name on the metadata server and reads from our memory.
            digest = local_buf.fill_random(4 << 20, 1 << 20)
            reply = await asyncio.to_thread(target.call, "transfer", op="read", target="127.0.0.1:7003",
                                            items=[[0, 0, local_buf.addr + (4 << 20), 1 << 20]])
            assert reply["rc"] == 0
            got = await asyncio.to_thread(target.call, "digest", region=0, offset=0, length=1 << 20)
            assert got["digest"] == digest
    finally:
        await asyncio.to_thread(target.close)


async def test_a_live_name_cannot_be_taken(http_metadata, local_buf):
    """The refused engine leaves the name's entries to their owner, who stays reachable by name."""
    from flagcx_mc import HostBuffer

    async with AsyncTransferEngine() as first, AsyncTransferEngine() as second, \
            AsyncTransferEngine(transfer_timeout=10.0) as third:
        await first.initialize("shared-name", http_metadata, "tcp", "")
        with HostBuffer(1 << 20) as owned:
            await first.register_memory(owned.addr, owned.size)
            with pytest.raises(errors.MetadataError, match="in use by a live engine"):
                await second.initialize("shared-name", http_metadata, "tcp", "")
            await third.initialize("writer", http_metadata, "tcp", "")
            await third.register_memory(local_buf.addr, 1 << 20)
            digest = local_buf.fill_random(0, 1 << 20)
            await third.transfer_sync_write("shared-name", local_buf.addr, owned.addr, 1 << 20)
            assert owned.digest(0, 1 << 20) == digest


async def test_closing_leaves_a_name_another_engine_has_claimed(http_metadata, local_buf, caplog):
    """An engine taken for dead and replaced under its name neither overwrites the new owner's
    descriptor when its regions change nor unpublishes the new owner when it closes."""
    newer = {"ip_or_host_name": "10.9.9.9", "rpc_port": 15999}
    async with HttpMetadataStore(http_metadata) as store:
        async with AsyncTransferEngine() as old:
            await old.initialize("taken-over", http_metadata, "tcp", "")
            await store.delete(rpc_meta_key("taken-over"))  # the new owner's publish, as a restart does it
            await store.put(rpc_meta_key("taken-over"), newer)
            await store.put(segment_key("taken-over"), {"name": "taken-over", "owner": "newer"})
            await old.register_memory(local_buf.addr, 1 << 20)
            assert "now held by the engine at 10.9.9.9:15999" in caplog.text
            assert (await store.get(segment_key("taken-over")))["owner"] == "newer"
        assert await store.get(rpc_meta_key("taken-over")) == newer
        assert (await store.get(segment_key("taken-over")))["owner"] == "newer"


async def test_a_failed_initialize_can_be_tried_again():
    """A metadata server that cannot be reached fails initialize and leaves nothing behind."""
    async with AsyncTransferEngine() as eng:
        with pytest.raises(errors.PeerConnectionError, match="etcd://127.0.0.1"):
            await eng.initialize("named", f"etcd://127.0.0.1:{free_port()}", "tcp", "")
        await eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        assert eng.session_name == f"127.0.0.1:{await eng.get_rpc_port()}"


async def test_registration_fails_whole_when_the_metadata_server_cannot_take_it(local_buf, caplog):
    """Memory that could not be published is not left registered (a retry works once the server is
    back); memory that left the table stays unregistered whatever the server says."""
    server = MetadataServer("127.0.0.1", 0)
    await server.start()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    async with AsyncTransferEngine() as eng:
        await eng.initialize("flaky-meta", server.url, "tcp", "")
        await server.close()
        with pytest.raises(errors.PeerConnectionError):
            await eng.register_memory(local_buf.addr, 1 << 20)
        with pytest.raises(errors.PeerConnectionError):
            await eng.batch_register_memory([local_buf.addr, local_buf.addr + (2 << 20)], [1 << 20, 1 << 20])
        with pytest.raises(errors.PeerConnectionError):
            await eng.allocate_managed_buffer(1 << 20)
        assert not _registered(eng, local_buf.addr)  # (the managed pool keeps its chunk)
        server = MetadataServer("127.0.0.1", port)
        await server.start()
        try:
            await eng.register_memory(local_buf.addr, 1 << 20)  # no overlap: the failed one was undone
            async with HttpMetadataStore(server.url) as store:  # restarted empty: we are back on it
                desc = await store.get(segment_key("flaky-meta"))
                assert local_buf.addr in [b["addr"] for b in desc["buffers"]]  # beside the managed pool's chunk
                assert (await store.get(rpc_meta_key("flaky-meta")))["rpc_port"] == await eng.get_rpc_port()
        finally:
            await server.close()
        await eng.unregister_memory(local_buf.addr)  # the server is gone again: still unregistered
        assert "still lists unregistered memory" in caplog.text
        assert not _registered(eng, local_buf.addr)


def _registered(eng: AsyncTransferEngine, addr: int) -> bool:
    return any(base <= addr < base + length for base, length, _ in eng._state.require_core().region_table())


async def test_concurrent_registrations_publish_the_latest_table(http_metadata, local_buf):
    """Two registrations at once: the metadata server ends up with both regions, even when the
    first one's update is the slower to land."""
    async with AsyncTransferEngine() as eng:
        await eng.initialize("busy-meta", http_metadata, "tcp", "")
        store = eng._state.store._store
        put, delayed = store.put, []

        async def slow_first_put(key, value):
            if key == segment_key("busy-meta") and not delayed:
                delayed.append(key)
                await asyncio.sleep(0.3)
            await put(key, value)

        store.put = slow_first_put
        a, b = local_buf.addr, local_buf.addr + (4 << 20)
        await asyncio.gather(eng.register_memory(a, 1 << 20), eng.register_memory(b, 1 << 20))
        async with HttpMetadataStore(http_metadata) as reader:
            desc = await reader.get(segment_key("busy-meta"))
        assert delayed and sorted(x["addr"] for x in desc["buffers"]) == [a, b]
