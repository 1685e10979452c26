"""Async transfer coroutines submit from the loop and complete inline or through one poller:
content under many concurrent coroutines on both transports, cancel while the poller waits, a
deadline expiring there, close() with coroutines waiting."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from support.engines import engine_pair

from flagcx_mc import AsyncTransferEngine, HostBuffer, errors
from flagcx_mc._testing.node import NodeProcess

pytestmark = [pytest.mark.uvloop, pytest.mark.timeout(60)]

BLOCK = 64 << 10
N = 256
BIG = 8 << 20


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
@pytest.mark.parametrize("block", [4096, BLOCK, 512 << 10])
async def test_many_coroutines_move_the_right_bytes(transport, block):
    n = N if block < (512 << 10) else 24
    src, dst, back = HostBuffer(n * block), HostBuffer(n * block), HostBuffer(n * block)
    async with engine_pair(transport, dst, src, back) as (target, eng):
        src.fill_random()
        order = list(range(n))
        order.reverse()  # block i of src lands in slot n-1-i of dst
        await asyncio.gather(*(eng.transfer_sync_write(target.session_name, src.addr + i * block,
                                                       dst.addr + order[i] * block, block) for i in range(n)))
        for i in range(0, n, 7):
            assert dst.read(order[i] * block, block) == src.read(i * block, block)
        await asyncio.gather(*(eng.transfer_sync_read(target.session_name, back.addr + i * block,
                                                      dst.addr + order[i] * block, block) for i in range(n)))
        assert back.read(0, n * block) == src.read(0, n * block)
        peers = eng.stats()["peers"]
        assert peers[target.session_name]["transfers"] >= 2 * n + 0  # every success counted


@pytest.mark.parametrize("block", [4096, 256 << 10])
async def test_one_coroutine_back_to_back(block):
    """A lone coroutine's small TCP calls go out from the loop (what the socket does not take at
    once is left to the sender thread) and may end there: every byte still lands in order."""
    n = 64
    src, dst, back = HostBuffer(n * block), HostBuffer(n * block), HostBuffer(n * block)
    async with engine_pair("tcp", dst, src, back) as (target, eng):
        src.fill_random()
        for i in range(n):
            await eng.transfer_sync_write(target.session_name, src.addr + i * block, dst.addr + i * block, block)
        assert dst.read(0, n * block) == src.read(0, n * block)
        for i in range(n):
            await eng.transfer_sync_read(target.session_name, back.addr + i * block, dst.addr + i * block, block)
        assert back.read(0, n * block) == src.read(0, n * block)


@pytest.fixture(scope="module")
def frozen_node():
    proc = NodeProcess(regions=[BIG, 1 << 20], config={"transfer_timeout": 30.0})
    yield proc
    proc.close()


async def _engine_on(node: NodeProcess, buf: HostBuffer, **config) -> AsyncTransferEngine:
    eng = AsyncTransferEngine(transport="tcp", **config)
    await eng.initialize("127.0.0.1")
    await eng.register_memory(buf.addr, buf.size)
    await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)  # session open
    return eng


async def test_deadline_expires_in_the_poller(frozen_node):
    """Calls stuck on a frozen peer end with TransferTimeoutError at their deadline, not later,
    and the engine reconnects afterwards."""
    node = frozen_node
    buf = HostBuffer(2 * BIG)
    eng = await _engine_on(node, buf, transfer_timeout=1.5)
    try:
        await asyncio.to_thread(node.freeze)
        try:
            t0 = time.monotonic()
            calls = [eng.transfer_sync_write(node.session, buf.addr + i * 4096, node.addr(1, i * 4096), 4096)
                     for i in range(16)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(node.pid, signal.SIGCONT)
        # The first deadline to pass cuts the streams the calls share, which may fail a call whose
        # own deadline is a moment later with PeerConnectionError (as on the sync path).
        assert all(isinstance(r, (errors.TransferTimeoutError, errors.PeerConnectionError)) for r in results), results
        assert any(isinstance(r, errors.TransferTimeoutError) for r in results), results
        assert elapsed < 8.0
        await asyncio.sleep(0.5)
        await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)  # reconnects
    finally:
        await eng.close()
        buf.close()


async def test_lone_writes_fill_a_frozen_peers_socket(frozen_node):
    """Lone small writes sent from the loop into a frozen peer: the socket fills, the rest of a
    call waits on the sender thread, the deadline ends the call, and the engine reconnects."""
    node = frozen_node
    buf = HostBuffer(2 * BIG)
    eng = await _engine_on(node, buf, transfer_timeout=1.0)
    block = 256 << 10
    try:
        await asyncio.to_thread(node.freeze)
        try:
            failed = []
            t0 = time.monotonic()
            for i in range(BIG // block):
                try:
                    await eng.transfer_sync_write(node.session, buf.addr + i * block, node.addr(0, i * block), block)
                except (errors.TransferTimeoutError, errors.PeerConnectionError) as exc:
                    failed.append(exc)  # the stream is cut: the next call would reconnect
                    break
            elapsed = time.monotonic() - t0
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert len(failed) == 1 and elapsed < 8.0
        await asyncio.sleep(0.5)
        await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)  # reconnects
    finally:
        await eng.close()
        buf.close()


@pytest.mark.parametrize("how", ["transfer", "batch"])
async def test_cancel_while_the_poller_waits(frozen_node, how):
    """A cancelled call returns only once its batch ended: after it returns, bytes written into
    the source never reach the peer.  ``get_batch_transfer_status`` cancels its batch rather than
    wait for the 20 s deadline."""
    node = frozen_node
    buf = HostBuffer(2 * BIG)
    eng = await _engine_on(node, buf, transfer_timeout=2.0 if how == "transfer" else 20.0)
    try:
        await asyncio.to_thread(node.call, "set", region=0, byte=0x00)
        buf.fill(0x11, 0, BIG)
        await asyncio.to_thread(node.freeze)
        try:
            if how == "transfer":
                call = eng.transfer_sync_write(node.session, buf.addr, node.addr(0), BIG)
            else:
                batch_id = await eng.batch_transfer_async_write(node.session, [buf.addr], [node.addr(0)], [BIG])
                call = eng.get_batch_transfer_status([batch_id])
            task = asyncio.ensure_future(call)
            await asyncio.sleep(0.3)
            assert not task.done()
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - t0 < 5.0
            buf.fill(0x22, 0, BIG)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        await asyncio.sleep(0.5)
        assert (await asyncio.to_thread(node.call, "count_byte", region=0, byte=0x22))["count"] == 0
    finally:
        await eng.close()
        buf.close()


async def test_close_fails_waiting_coroutines_promptly(frozen_node):
    node = frozen_node
    buf = HostBuffer(2 * BIG)
    eng = await _engine_on(node, buf, transfer_timeout=20.0)
    try:
        await asyncio.to_thread(node.freeze)
        try:
            tasks = [asyncio.ensure_future(eng.transfer_sync_write(node.session, buf.addr + i * 4096,
                                                                   node.addr(1, i * 4096), 4096)) for i in range(32)]
            tasks.append(asyncio.ensure_future(eng.transfer_sync_write(node.session, buf.addr, node.addr(0), BIG)))
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in tasks)
            t0 = time.monotonic()
            await eng.close()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - t0 < 5.0
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert all(isinstance(r, errors.FlagcxMcError) for r in results), results
    finally:
        await eng.close()
        buf.close()


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_many_async_batches_complete_through_the_poller(transport):
    """Batches started from the loop (no executor hop) and waited for together: every byte lands."""
    n, block = 48, 64 << 10
    src, dst = HostBuffer(n * block), HostBuffer(n * block)
    async with engine_pair(transport, dst, src) as (target, eng):
        src.fill_random()
        ids = [await eng.batch_transfer_async_write(target.session_name, [src.addr + i * block],
                                                    [dst.addr + (n - 1 - i) * block], [block]) for i in range(n)]
        await eng.get_batch_transfer_status(ids)
        for i in range(n):
            assert dst.read((n - 1 - i) * block, block) == src.read(i * block, block)
        with pytest.raises(errors.InvalidArgumentError):
            await eng.get_batch_transfer_status(ids[:1])  # forgotten once done


class _FakeBatch:
    """A batch whose end the test decides (poll: 0 running, 1 done)."""

    def __init__(self) -> None:
        self.state = 0

    def poll(self) -> int:
        return self.state

    def wait_done(self, timeout_ms: int) -> int:
        return self.state


class _FakeCore:
    """The core's count of ended batches and the wait for the next end, as the poller sees them."""

    def __init__(self) -> None:
        import threading

        self.ended = 0
        self.cv = threading.Condition()
        self.lingered = 0

    def end(self, batch: _FakeBatch) -> None:
        with self.cv:
            batch.state = 1
            self.ended += 1
            self.cv.notify_all()

    def count(self) -> int:
        with self.cv:
            return self.ended

    def wait_end(self, seen: int, seconds: float) -> bool:
        with self.cv:
            self.lingered += 1
            return self.cv.wait_for(lambda: self.ended != seen, seconds)


async def test_lingering_poller_sees_new_batches_by_their_end():
    """Between batches the poller waits for any batch's end, not for the loop to hand it one: a
    batch handed over meanwhile is resolved when it ends, one that ended before the poller looked
    is resolved by the hand-over itself, and the poller ends after lingering with nothing to do."""
    from concurrent.futures import ThreadPoolExecutor

    from flagcx_mc.engine import completions

    loop = asyncio.get_running_loop()
    core = _FakeCore()
    with ThreadPoolExecutor(1) as executor:
        poller = completions.Completions(loop, lambda: executor, core.count, core.wait_end)
        first = _FakeBatch()
        waiting = poller.wait(first, time.monotonic() + 10)
        core.end(first)
        assert await asyncio.wait_for(waiting, 1) == (0, "")
        await asyncio.sleep(completions._LINGER_S / 5)  # the poller lingers now
        assert poller._running
        later = _FakeBatch()
        waiting = poller.wait(later, time.monotonic() + 10)
        await asyncio.sleep(0.001)
        assert not waiting.done()
        core.end(later)  # its end, not the hand-over, wakes the poller
        assert await asyncio.wait_for(waiting, 1) == (0, "")
        done_before = _FakeBatch()
        done_before.state = 1  # ended before the poller could see it in its inbox
        resolved = poller.wait(done_before, time.monotonic() + 10)
        assert resolved.done() and resolved.result() == (0, "")  # no wait for the linger to run out
        deadline = time.monotonic() + 2
        while poller._running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert not poller._running  # lingered, then ended: an idle engine holds no thread
        assert core.lingered >= 2


async def test_close_ends_a_lingering_poller_at_once():
    src, dst = HostBuffer(4 << 20), HostBuffer(4 << 20)
    async with engine_pair("tcp", dst, src) as (target, eng):
        src.fill_random()
        await asyncio.gather(*(eng.transfer_sync_write(target.session_name, src.addr + i * BLOCK,
                                                       dst.addr + i * BLOCK, BLOCK) for i in range(16)))
        assert dst.read(0, 16 * BLOCK) == src.read(0, 16 * BLOCK)
        t0 = time.monotonic()
        await eng.close()
        assert time.monotonic() - t0 < 1.0
