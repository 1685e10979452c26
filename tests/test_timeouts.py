"""Timeouts and dead peers: calls fail in time, and a failed call leaves the caller's buffers alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time

import pytest

from flagcx_mc import AsyncTransferEngine, HostBuffer, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.control.codec import Message, MessageType
from flagcx_mc.control.handshake import HandshakeServer
from flagcx_mc.engine.sessions import CONNECTS_AT_ONCE, SLOW_CONNECT_S
from flagcx_mc.metadata.descriptor import BufferDesc, NativeInfo, RegionDesc, SegmentDesc

# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = pytest.mark.uvloop

TIMEOUT = 1.0
BIG = 64 << 20  # far more than the socket buffers hold, so a frozen target stalls the sender


@pytest.fixture
def frozen_node():
    """A private node that tests may SIGSTOP; always resumed and reaped."""
    proc = NodeProcess(regions=[BIG])
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.close()


@pytest.fixture
async def fast_engine():
    buf = HostBuffer(BIG)
    async with AsyncTransferEngine(transfer_timeout=TIMEOUT, handshake_timeout=2.0) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(buf.addr, buf.size)
        yield eng, buf
    buf.close()


async def test_write_to_frozen_target_times_out_and_touches_nothing_after(fast_engine, frozen_node):
    eng, buf = fast_engine
    await eng.transfer_sync_write(frozen_node.session, buf.addr, frozen_node.addr(0), 4096)  # session open
    frozen_node.call("set", region=0, byte=0)
    buf.fill(0x11)
    frozen_node.freeze()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(errors.TransferTimeoutError):
        await eng.transfer_sync_write(frozen_node.session, buf.addr, frozen_node.addr(0), BIG)
    elapsed = loop.time() - start
    assert TIMEOUT <= elapsed < TIMEOUT + 1.5, elapsed
    # The call returned: the engine must not read the source any more.  Rewrite it, let the
    # target run again, and check that none of the new bytes ever arrive.
    buf.fill(0x22)
    os.kill(frozen_node.pid, signal.SIGCONT)
    await asyncio.sleep(0.5)
    assert frozen_node.call("count_byte", region=0, byte=0x22)["count"] == 0
    # The broken session is replaced on next use.
    digest = buf.fill_random(0, 1 << 20)
    await eng.transfer_sync_write(frozen_node.session, buf.addr, frozen_node.addr(0), 1 << 20)
    assert frozen_node.call("digest", region=0, offset=0, length=1 << 20)["digest"] == digest


async def test_read_from_frozen_target_times_out_and_writes_nothing_after(fast_engine, frozen_node):
    eng, buf = fast_engine
    frozen_node.call("set", region=0, byte=0x33)
    await eng.transfer_sync_read(frozen_node.session, buf.addr, frozen_node.addr(0), 4096)
    frozen_node.freeze()
    with pytest.raises(errors.TransferTimeoutError):
        await eng.transfer_sync_read(frozen_node.session, buf.addr, frozen_node.addr(0), BIG)
    buf.fill(0x44)
    os.kill(frozen_node.pid, signal.SIGCONT)
    await asyncio.sleep(0.5)
    assert buf.read(0, BIG).count(0x44) == BIG  # no late byte landed in the destination


async def test_killed_target_fails_fast_and_later_calls_fail_fast(fast_engine):
    eng, buf = fast_engine
    victim = NodeProcess(regions=[BIG])
    try:
        await eng.transfer_sync_write(victim.session, buf.addr, victim.addr(0), 4096)

        async def keep_writing():  # on a fast machine one 64 MiB write may end before the kill
            while True:
                await eng.transfer_sync_write(victim.session, buf.addr, victim.addr(0), BIG)

        transfer = asyncio.ensure_future(keep_writing())
        await asyncio.sleep(0.01)
        victim.proc.kill()
        victim.proc.wait(5)
        start = time.monotonic()
        with pytest.raises((errors.PeerConnectionError, errors.TransferTimeoutError)):
            await transfer
        with pytest.raises((errors.PeerConnectionError, errors.HandshakeTimeoutError)):
            await eng.transfer_sync_write(victim.session, buf.addr, victim.addr(0), 4096)
        assert time.monotonic() - start < TIMEOUT + 2.5
    finally:
        victim.kill()


async def test_a_stuck_handshake_does_not_delay_other_peers(fast_engine, frozen_node, node):
    eng, buf = fast_engine
    frozen_node.freeze()  # its rpc port accepts (kernel backlog) but never answers (stopped for sure)
    stuck = asyncio.ensure_future(eng.transfer_sync_write(frozen_node.session, buf.addr, frozen_node.addr(0), 64))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    digest = buf.fill_random(0, 4096)
    await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)
    assert not stuck.done()  # finished while the other handshake is still stuck: not queued behind it
    assert node.call("digest", region=1, offset=0, length=4096)["digest"] == digest
    with pytest.raises(errors.HandshakeTimeoutError):
        await stuck
    assert loop.time() - start < 2.0 + 0.5  # handshake_timeout bounds it


SILENT_REGION = RegionDesc(0x7F00_0000_0000, 1 << 20, 7)


async def _peers_with_silent_data_ports(stack: contextlib.AsyncExitStack, count: int) -> list[str]:
    """Peers whose handshake answers but whose data port never does (the kernel accepts, nobody
    reads): their session names."""
    names = []
    for _ in range(count):
        lsock = socket.create_server(("127.0.0.1", 0), backlog=8)
        stack.callback(lsock.close)
        port = lsock.getsockname()[1]
        desc = SegmentDesc(name=f"silent{port}", tcp_data_port=port,
                           buffers=(BufferDesc("cpu:0", SILENT_REGION.addr, SILENT_REGION.length),),
                           native=NativeInfo(1, port, (SILENT_REGION,), "another-host", 4242))

        async def metadata(message: Message, desc: SegmentDesc = desc) -> dict:
            return desc.to_json_dict()

        server = await stack.enter_async_context(HandshakeServer({MessageType.METADATA: metadata}))
        await server.start("127.0.0.1", 0)
        names.append(f"127.0.0.1:{server.port}")
    return names


async def test_peers_whose_data_ports_hang_do_not_hold_up_other_sessions(fast_engine, node):
    """Sessions connect their data streams a few at a time (CONNECTS_AT_ONCE); peers whose
    data port never answers must not keep a healthy peer's first call waiting for their
    handshake_timeout."""
    eng, buf = fast_engine
    region = SILENT_REGION
    async with contextlib.AsyncExitStack() as stack:
        names = await _peers_with_silent_data_ports(stack, CONNECTS_AT_ONCE)
        stuck = [asyncio.ensure_future(eng.transfer_sync_write(name, buf.addr, region.addr, 64)) for name in names]
        await asyncio.sleep(0.2)  # every one of them is connecting now
        loop = asyncio.get_running_loop()
        start = loop.time()
        digest = buf.fill_random(0, 4096)
        await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)
        waited = loop.time() - start
        assert node.call("digest", region=1, offset=0, length=4096)["digest"] == digest
        assert not any(s.done() for s in stuck)
        assert waited < SLOW_CONNECT_S + 0.7, waited  # not the 2 s of handshake_timeout
        for s in stuck:
            with pytest.raises(errors.FlagcxMcError):
                await s


async def test_peers_hanging_by_the_dozen_take_a_bounded_share_of_the_wait_threads():
    """Connects that gave their turn away run beside the turns, on the engine's wait executor;
    at most a quarter of its threads go to them, so dozens of hanging peers cannot take the
    threads that wait for completions.  Every such call still ends, with an error."""
    buf = HostBuffer(1 << 20)
    async with AsyncTransferEngine(transfer_timeout=TIMEOUT, handshake_timeout=1.5, wait_threads=16) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(buf.addr, buf.size)
        async with contextlib.AsyncExitStack() as stack:
            names = await _peers_with_silent_data_ports(stack, 12)
            stuck = [asyncio.ensure_future(eng.transfer_sync_write(name, buf.addr, SILENT_REGION.addr, 64))
                     for name in names]
            sessions = eng._state.require_sessions()
            most_slow = most_threads = 0
            for _ in range(30):  # 1.5 s: the first turns are slow, and their places are taken
                await asyncio.sleep(0.05)
                most_slow = max(most_slow, sessions.slow_connects)
                waiting = sum(t.name.startswith("flagcx-mc-wait") for t in threading.enumerate())
                most_threads = max(most_threads, waiting)
            assert most_slow == 16 // 4  # as many as allowed, and no more
            assert most_threads <= CONNECTS_AT_ONCE + 16 // 4 + 1, most_threads
            for s in stuck:
                with pytest.raises(errors.FlagcxMcError):
                    await s
    buf.close()
