"""Vector requests: many small slices in one request, payloads scattered straight into place.

Batches of small blocks travel as vectors when both ends take them (negotiated per connection;
FLAGCX_MC_VECTORS=0 keeps an initiator on single requests).  Content is verified both ways, the
target's counters show which path carried the bytes, and an entry the target refuses fails only
its own task while the rest of the vector lands.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time

import pytest
from support.layouts import round_trip_runs_and_gaps

from flagcx_mc import AsyncTransferEngine, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.engine.requests import OP_WRITE, TransferRequest

# Mixed sizes, small ones (vector entries go up to 64 KiB) and a few that travel alone.
BLOCKS = [1, 3, 512, 4096, 4096, 9000, 65536, 65537, 300_000]


def _layout(n: int, seed: int):
    """n blocks of random BLOCKS sizes at shuffled, non-overlapping remote offsets."""
    rng = random.Random(seed)
    lens = [rng.choice(BLOCKS) for _ in range(n)]
    offsets, pos = [], 0
    for length in lens:
        offsets.append(pos)
        pos += length
    remote_order = list(range(n))
    rng.shuffle(remote_order)
    remote_offsets, rpos = [0] * n, 0
    for i in remote_order:
        remote_offsets[i] = rpos
        rpos += lens[i]
    return lens, offsets, remote_offsets, pos


@pytest.fixture
async def initiator(local_buf, monkeypatch, request):
    if request.param == "single":
        monkeypatch.setenv("FLAGCX_MC_VECTORS", "0")  # read when the data connections open
    async with AsyncTransferEngine(transfer_timeout=10.0) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        yield request.param, eng


@pytest.mark.parametrize("initiator", ["vectors", "single"], indirect=True)
async def test_mixed_small_blocks_land_exactly_on_either_path(initiator, node, local_buf):
    path, engine = initiator
    lens, offsets, remote_offsets, total = _layout(700, seed=7)
    local = [local_buf.addr + o for o in offsets]
    remote = [node.addr(0, o) for o in remote_offsets]
    before = node.call("stats")

    local_buf.fill_random(0, total)
    await engine.batch_transfer_sync_write(node.session, local, remote, lens)
    expected = bytearray(total)
    for length, lo, ro in zip(lens, offsets, remote_offsets, strict=True):
        expected[ro:ro + length] = local_buf.read(lo, length)
    assert node.call("digest", region=0, offset=0, length=total)["digest"] == hashlib.sha256(expected).hexdigest()

    sent = local_buf.digest(0, total)
    local_buf.fill(0, 0, total)
    await engine.batch_transfer_sync_read(node.session, local, remote, lens)
    assert local_buf.digest(0, total) == sent
    assert node.call("guards")["intact"]

    after = node.call("stats")
    vectors = after["vectors_served"] - before["vectors_served"]
    requests = after["requests_served"] - before["requests_served"]
    if path == "vectors":
        assert vectors > 0 and requests < len(lens), (vectors, requests)  # many slices per request
    else:
        assert vectors == 0 and requests >= 2 * len(lens), (vectors, requests)


async def test_a_refused_entry_fails_only_its_task(engine, local_buf):
    """The target unregisters one region after the initiator read its table: the vector that
    interleaves both regions lands in the live one, and the batch reports the refusal."""
    block, n = 4096, 64
    with NodeProcess(regions=[n * block, n * block], config={"transfer_timeout": 10.0}) as target:
        warm = local_buf.fill_random(0, block)
        await engine.transfer_sync_write(target.session, local_buf.addr, target.addr(0), block)
        assert target.call("digest", region=0, offset=0, length=block)["digest"] == warm
        target.call("set", region=0, byte=0)
        dead_base = target.addr(1)
        assert target.call("unregister", region=1)["rc"] == 0

        local = [local_buf.addr + i * block for i in range(n)]
        remote = [target.addr(0, i * block) if i % 2 == 0 else dead_base + i * block for i in range(n)]
        local_buf.fill_random(0, n * block)
        # Through the core, which keeps each task's outcome (the facades report the batch's).
        session = await engine._state.require_sessions().get(target.session)
        batch = TransferRequest.build(OP_WRITE, local, remote, [block] * n).submit(session)
        rc, why = await asyncio.to_thread(batch.wait, 10_000)
        assert rc == errors.RemoteRefusedError.code, why
        statuses = [batch.task_status(i) for i in range(n)]
        assert all(s == 0 for s in statuses[0::2]), statuses  # the live region's tasks succeeded
        assert all(s == errors.RemoteRefusedError.code for s in statuses[1::2]), statuses
        for i in range(0, n, 2):
            got = target.call("digest", region=0, offset=i * block, length=block)["digest"]
            assert got == local_buf.digest(i * block, block), f"task {i}"
        stats = target.call("stats")
        assert stats["requests_refused"] >= n // 2 and stats["vectors_served"] >= 1, stats
        assert target.call("guards")["intact"]


async def test_vectors_across_many_regions_both_ways(engine, local_buf):
    """Entries that alternate between many target regions: each one is checked and pinned on its
    own (only the first region of a flush window is held), and every byte lands where it should."""
    regions, block, per_region = 24, 4096, 16
    with NodeProcess(regions=[block * per_region] * regions, config={"transfer_timeout": 10.0}) as target:
        count = regions * per_region
        # Task i goes to region i % regions, slot i // regions: consecutive tasks change region.
        remote = [target.addr(i % regions, (i // regions) * block) for i in range(count)]
        local = [local_buf.addr + i * block for i in range(count)]
        local_buf.fill_random(0, count * block)
        before = target.call("stats")["vectors_served"]
        await engine.batch_transfer_sync_write(target.session, local, remote, [block] * count)
        for r in range(regions):
            expected = b"".join(local_buf.read(i * block, block) for i in range(r, count, regions))
            got = target.call("digest", region=r)["digest"]
            assert got == hashlib.sha256(expected).hexdigest(), f"region {r}"
        sent = local_buf.digest(0, count * block)
        local_buf.fill(0, 0, count * block)
        await engine.batch_transfer_sync_read(target.session, local, remote, [block] * count)
        assert local_buf.digest(0, count * block) == sent
        assert target.call("stats")["vectors_served"] > before
        assert target.call("guards")["intact"]


async def test_runs_of_adjacent_blocks_land_exactly_and_gaps_stay_untouched(engine, node, local_buf):
    """The kernel gets back-to-back payloads as one range (fmc_iov_merge: zero-copy sends, scatter
    reads); runs that differ per side, gaps, backwards runs and a block sent twice must still put
    every byte exactly where its own entry says, and nothing in between."""
    await round_trip_runs_and_gaps(engine, node, local_buf, seed=11)


@pytest.mark.parametrize("streams,blocks", [(8, 1024), (4, 1024), (8, 64), (8, 128)])
async def test_a_batch_of_small_blocks_puts_every_stream_to_work(node, local_buf, streams, blocks):
    """A batch is cut into one share per stream (each stream's bytes are received by one target
    thread), of at most as many streams as this process has CPUs, never into shares under 256 KiB
    nor over a slice (1 MiB): 4 MiB of 4 KiB blocks is 8 vectors on 8 streams with 8 CPUs (it
    was 4 runs of 1 MiB, leaving half the streams idle), 4 on 2 CPUs; 256 KiB stays on one
    stream."""
    spread = min(streams, len(os.sched_getaffinity(0)))
    total = blocks * 4096
    share = min(max(-(-total // spread), 256 << 10), 1 << 20)
    vectors = -(-total // share)
    block = 4096
    async with AsyncTransferEngine(transfer_timeout=10.0, streams_per_peer=streams) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        local = [local_buf.addr + i * block for i in range(blocks)]
        remote = [node.addr(0, (blocks - 1 - i) * block) for i in range(blocks)]  # reversed: scattered
        # Connect outside the count: the session, then the streams this batch would use (one per
        # 256 KiB), which the first such batch has connected for the ones after it.
        await eng.batch_transfer_sync_write(node.session, local, remote, [block] * blocks)
        peer = eng._state.require_sessions().peek(node.session).peer
        deadline = time.monotonic() + 5
        while peer.streams_ready < min(peer.streams, -(-total // (256 << 10))):
            assert time.monotonic() < deadline, "the batch's streams were not connected"
            await asyncio.sleep(0.02)
        before = node.call("stats")
        local_buf.fill_random(0, blocks * block)
        await eng.batch_transfer_sync_write(node.session, local, remote, [block] * blocks)
        after = node.call("stats")
        for i in range(0, blocks, 97):
            got = node.call("digest", region=0, offset=(blocks - 1 - i) * block, length=block)["digest"]
            assert got == local_buf.digest(i * block, block), f"block {i}"
    assert after["vectors_served"] - before["vectors_served"] == vectors
    assert after["bytes_served_in"] - before["bytes_served_in"] == blocks * block


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("streams,block,slice_size", [(4, 4 << 20, 4 << 20), (8, 3 << 20, 8 << 20),
                                                     (8, 5 << 20, 1 << 20), (4, 512 << 10, 1 << 20)])
async def test_one_large_block_spreads_over_the_streams_like_small_blocks(node, local_buf, op, streams, block,
                                                                          slice_size):
    """A batch of one block is cut into the same per-stream shares as the same bytes in small
    blocks (not into slice_size pieces, which left all but a few streams idle), each share one
    request; every byte lands."""
    spread = min(streams, len(os.sched_getaffinity(0)))
    share = min(max(-(-block // spread), 256 << 10), slice_size)
    async with AsyncTransferEngine(transfer_timeout=10.0, streams_per_peer=streams, slice_size=slice_size) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        local, remote = [local_buf.addr], [node.addr(0, 4096)]
        await eng.batch_transfer_sync_write(node.session, local, remote, [block])  # connects the streams
        peer = eng._state.require_sessions().peek(node.session).peer
        deadline = time.monotonic() + 5
        while peer.streams_ready < min(peer.streams, -(-block // (256 << 10))):
            assert time.monotonic() < deadline, "the batch's streams were not connected"
            await asyncio.sleep(0.02)
        local_buf.fill_random(0, block)
        want = local_buf.digest(0, block)
        if op == "read":
            await eng.batch_transfer_sync_write(node.session, local, remote, [block])
            local_buf.fill(0, 0, block)
        before = node.call("stats")
        call = eng.batch_transfer_sync_write if op == "write" else eng.batch_transfer_sync_read
        await call(node.session, local, remote, [block])
        after = node.call("stats")
    assert local_buf.digest(0, block) == want
    assert node.call("digest", region=0, offset=4096, length=block)["digest"] == want
    assert after["requests_served"] - before["requests_served"] == -(-block // share)


async def test_a_read_of_thousands_of_small_blocks_travels_as_vectors_only(engine, node, local_buf):
    """8192 blocks of 4 KiB read in one call: every stream's share holds far more entries than
    one send round's vector tables (512), and a read adds no payload bytes to end a round, so
    the rest must go in the next rounds as vectors too, not as a request per block (each then
    too small to be answered zero-copy).  Every block lands from its scattered remote place."""
    blocks, block = 8192, 4096
    rng = random.Random(5)
    order = list(range(blocks))
    rng.shuffle(order)
    local = [local_buf.addr + i * block for i in range(blocks)]
    remote = [node.addr(0, order[i] * block) for i in range(blocks)]
    local_buf.fill_random(0, blocks * block)
    await engine.batch_transfer_sync_write(node.session, local, remote, [block] * blocks)
    sent = [local_buf.digest(i * block, block) for i in range(0, blocks, 61)]
    local_buf.fill(0, 0, blocks * block)
    before = node.call("stats")
    await engine.batch_transfer_sync_read(node.session, local, remote, [block] * blocks)
    after = node.call("stats")
    assert [local_buf.digest(i * block, block) for i in range(0, blocks, 61)] == sent
    requests = after["requests_served"] - before["requests_served"]
    vectors = after["vectors_served"] - before["vectors_served"]
    assert requests == vectors and vectors <= blocks // 64, (requests, vectors)
