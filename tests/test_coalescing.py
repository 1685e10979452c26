"""Calls that coroutines start together over TCP leave as one batch (engine/coalesce.py): every
call still gets its own bytes, its own error and its own count, a cancelled one returns while the
rest of its group goes on, a peer killed under a group fails each call with a typed error, and a lone
coroutine's calls are not held back."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from support.engines import engine_pair

from flagcx_mc import AsyncTransferEngine, HostBuffer, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.engine import coalesce

pytestmark = [pytest.mark.uvloop, pytest.mark.timeout(60)]

BLOCK = 64 << 10


def _grouped(eng: AsyncTransferEngine) -> tuple[int, int]:
    stats = eng.stats()
    return stats["call_groups"], stats["grouped_calls"]


async def test_concurrent_calls_share_batches_and_keep_their_bytes():
    n = 48
    src, dst, back = HostBuffer(n * BLOCK), HostBuffer(n * BLOCK), HostBuffer(n * BLOCK)
    async with engine_pair("tcp", dst, src, back) as (target, eng):
        src.fill_random()
        name = target.session_name
        slot = [(i * 29) % n for i in range(n)]  # a permutation: block i lands in slot[i]
        await asyncio.gather(*(eng.transfer_sync_write(name, src.addr + i * BLOCK, dst.addr + slot[i] * BLOCK, BLOCK)
                               for i in range(n)))
        groups, calls = _grouped(eng)
        assert groups >= 1 and calls >= 2 * groups, (groups, calls)
        for i in range(n):
            assert dst.read(slot[i] * BLOCK, BLOCK) == src.read(i * BLOCK, BLOCK), i
        await asyncio.gather(*(eng.transfer_sync_read(name, back.addr + i * BLOCK, dst.addr + slot[i] * BLOCK, BLOCK)
                               for i in range(n)))
        assert back.read(0, n * BLOCK) == src.read(0, n * BLOCK)
        assert _grouped(eng)[0] > groups  # the reads were grouped too
        peer = eng.stats()["peers"][name]
        assert peer["transfers"] == 2 * n and peer["failures"] == 0  # each call counted once
        assert peer["bytes_written"] == n * BLOCK and peer["bytes_read"] == n * BLOCK


async def test_batches_and_single_calls_group_together():
    """Multi-range batch calls and single-range calls in one group: each range in its place."""
    n, per = 12, 5
    block = 4096
    src, dst = HostBuffer(n * per * block), HostBuffer(n * per * block)
    async with engine_pair("tcp", dst, src) as (target, eng):
        src.fill_random()
        name = target.session_name

        def call(i: int):
            base = i * per * block
            if i % 2:
                return eng.transfer_sync_write(name, src.addr + base, dst.addr + base, per * block)
            addrs = [base + (per - 1 - j) * block for j in range(per)]  # reversed within the call
            return eng.batch_transfer_sync_write(name, [src.addr + base + j * block for j in range(per)],
                                                 [dst.addr + a for a in addrs], [block] * per)

        await asyncio.gather(*(call(i) for i in range(n)))
        assert _grouped(eng)[0] >= 1
        for i in range(n):
            base = i * per * block
            for j in range(per):
                where = base + (j if i % 2 else per - 1 - j) * block
                assert dst.read(where, block) == src.read(base + j * block, block), (i, j)


async def test_a_bad_call_fails_alone_in_its_group():
    n = 16
    src, dst = HostBuffer(n * BLOCK), HostBuffer(n * BLOCK)
    async with engine_pair("tcp", dst, src) as (target, eng):
        src.fill_random()
        name = target.session_name
        bad = 5
        calls = [eng.transfer_sync_write(name, src.addr + i * BLOCK,
                                         dst.addr + (dst.size if i == bad else i * BLOCK), BLOCK) for i in range(n)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[bad], errors.AddressNotRegisteredError), results[bad]
        for i in range(n):
            if i != bad:
                assert results[i] is None, (i, results[i])
                assert dst.read(i * BLOCK, BLOCK) == src.read(i * BLOCK, BLOCK), i
        assert dst.read(bad * BLOCK, BLOCK) == bytes(BLOCK)  # nothing written for the bad call
        assert eng.stats()["peers"][name]["failures"] == 1


async def test_a_cancelled_call_leaves_its_group_intact():
    """The target is stopped (SIGSTOP) before the calls start, so the first group is still in
    flight when one of its calls is cancelled, whatever the machine's speed."""
    n = 12
    target = NodeProcess(regions=[(n + 1) * BLOCK], config={"transport": "tcp"})
    src, back = HostBuffer(n * BLOCK), HostBuffer(n * BLOCK)
    eng = AsyncTransferEngine(transport="tcp")
    tasks: list[asyncio.Future] = []
    try:
        await eng.initialize("127.0.0.1")
        await eng.batch_register_memory([src.addr, back.addr], [src.size, back.size])
        src.fill_random()
        target.call("set", region=0, byte=0)
        name = target.session
        await eng.transfer_sync_write(name, src.addr, target.addr(0, n * BLOCK), 64)  # the session is open
        target.freeze()
        tasks = [asyncio.ensure_future(eng.transfer_sync_write(name, src.addr + i * BLOCK, target.addr(0, i * BLOCK),
                                                               BLOCK)) for i in range(n)]
        # Every task joins: the first eight leave as one group as soon as they hold 512 KiB, the
        # other four form the second group, which leaves once the turn is over.
        await asyncio.sleep(0)
        tasks[10].cancel()
        await asyncio.sleep(0)
        tasks[7].cancel()  # cancelled after its group left: its own tasks are cancelled in the core
        await asyncio.wait({tasks[7], tasks[10]}, timeout=5.0)
        assert tasks[10].cancelled() and tasks[7].cancelled(), (tasks[10], tasks[7])
        assert not any(t.done() for i, t in enumerate(tasks) if i not in (10, 7)), "others ended with the cancel"
        os.kill(target.pid, signal.SIGCONT)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20.0)
        await eng.transfer_sync_read(name, back.addr, target.addr(0), n * BLOCK)
        for i in range(n):
            if i not in (10, 7):
                assert results[i] is None and back.read(i * BLOCK, BLOCK) == src.read(i * BLOCK, BLOCK), i
        assert back.read(10 * BLOCK, BLOCK) == bytes(BLOCK)  # left out before its group was sent
        # Call 7 was stopped mid-way: its block holds some, all or none of its own bytes, nothing else.
        landed, wanted = back.read(7 * BLOCK, BLOCK), src.read(7 * BLOCK, BLOCK)
        assert all(got in (0, want) for got, want in zip(landed, wanted, strict=True))
        await eng.transfer_sync_write(name, src.addr, target.addr(0), n * BLOCK)  # the engine goes on
        assert target.call("digest", region=0, length=n * BLOCK)["digest"] == src.digest(0, n * BLOCK)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGCONT)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await eng.close()
        target.close()
        src.close()
        back.close()


async def test_a_lone_coroutine_goes_straight_to_the_core():
    n = 4 * coalesce.PROBE_EVERY
    block = 4096
    src, dst = HostBuffer(n * block), HostBuffer(n * block)
    async with engine_pair("tcp", dst, src) as (target, eng):
        src.fill_random()
        for i in range(n):
            await eng.transfer_sync_write(target.session_name, src.addr + i * block, dst.addr + i * block, block)
        assert dst.read(0, n * block) == src.read(0, n * block)
        assert _grouped(eng) == (0, 0)
        coalescer = eng._state._coalescer
        assert coalescer._lone >= coalesce.LONE_GROUPS  # it stopped opening groups


def test_merge_keeps_every_range_in_order():
    from flagcx_mc.engine.requests import OP_WRITE, SingleTransfer, TransferRequest

    reqs = [SingleTransfer(OP_WRITE, 1, 2, 3),
            TransferRequest.build(OP_WRITE, [10, 11], [20, 21], [30, 31]),
            SingleTransfer(OP_WRITE, 4, 5, 6)]
    merged = coalesce.merge(reqs)
    assert (merged.count, merged.total_bytes) == (4, 3 + 30 + 31 + 6)
    expected = TransferRequest.build(OP_WRITE, [1, 10, 11, 4], [2, 20, 21, 5], [3, 30, 31, 6])
    assert merged.packed == expected.packed
    singles = coalesce.merge([SingleTransfer(OP_WRITE, 1, 2, 3), SingleTransfer(OP_WRITE, 4, 5, 6)])
    assert singles.packed == TransferRequest.build(OP_WRITE, [1, 4], [2, 5], [3, 6]).packed


async def test_a_peer_killed_under_a_group_fails_every_call_and_nothing_else():
    """The peer dies (SIGKILL) while a group of calls is in flight to it: each call raises a
    typed error well before its deadline, and the engine goes on with another peer."""
    import os
    import signal
    import time

    from flagcx_mc._testing.node import NodeProcess

    n, block = 16, 1 << 20
    node = NodeProcess(regions=[n * block], config={"transfer_timeout": 30.0})
    src, dst = HostBuffer(n * block), HostBuffer(n * block)
    try:
        async with engine_pair("tcp", dst, src) as (target, eng):
            await eng.transfer_sync_write(node.session, src.addr, node.addr(0), 4096)  # the session is open
            await asyncio.to_thread(node.freeze)  # nothing is answered: the group stays in flight
            calls = [asyncio.ensure_future(eng.transfer_sync_write(node.session, src.addr + i * block,
                                                                   node.addr(0, i * block), block)) for i in range(n)]
            await asyncio.sleep(0.2)
            assert _grouped(eng)[0] >= 1 and not any(c.done() for c in calls)
            t0 = time.monotonic()
            os.kill(node.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
            assert time.monotonic() - t0 < 10
            assert all(isinstance(r, errors.PeerConnectionError) for r in results), results
            src.fill_random()
            await eng.transfer_sync_write(target.session_name, src.addr, dst.addr, n * block)  # another peer
            assert dst.read(0, n * block) == src.read(0, n * block)
    finally:
        node.close()


async def test_sixteen_64k_calls_leave_as_two_groups_with_the_right_bytes():
    """Sixteen coroutines' 64 KiB writes: the first eight leave once they hold 512 KiB, so the
    rest cross behind them as a second group, and every byte lands."""
    n = 16
    src, dst = HostBuffer(n * BLOCK), HostBuffer(n * BLOCK)
    async with engine_pair("tcp", dst, src) as (target, eng):
        src.fill_random()
        name = target.session_name
        await eng.transfer_sync_write(name, src.addr, dst.addr, 64)  # the session is open
        before = eng.stats()
        await asyncio.gather(*(eng.transfer_sync_write(name, src.addr + i * BLOCK, dst.addr + (n - 1 - i) * BLOCK,
                                                       BLOCK) for i in range(n)))
        after = eng.stats()
        assert after["grouped_calls"] - before["grouped_calls"] == n
        assert after["call_groups"] - before["call_groups"] == 2
        for i in range(n):
            assert dst.read((n - 1 - i) * BLOCK, BLOCK) == src.read(i * BLOCK, BLOCK), i
