"""GPU memory over native TCP: paged KV layouts (K and V per layer, random block ids), every mix of
GPU and host memory, both directions, each way of staging (copy kernel, driver batch, single
copies), concurrent callers sharing a small staging pool, blocks larger than a staging chunk, a
peer killed mid-transfer and calls that time out with pieces in every stage of the pipeline, all
checked byte for byte.

Runs where a CUDA driver and device exist (the H200 machine); skipped elsewhere with the reason."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest

from flagcx_mc import TransferEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.buffers import DeviceBuffer, HostBuffer, cuda_device_count
from flagcx_mc.tools.bench.layouts import block_plan, cache_bytes

_COUNT, _WHY = cuda_device_count()
pytestmark = pytest.mark.skipif(_COUNT == 0, reason=f"no CUDA device here: {_WHY}")

LAYERS = 8
SIZE = 64 << 20


def _pair(gpu_copy: str, timeout: float = 30.0, **settings):
    node = NodeProcess(regions=[SIZE], config={"transport": "tcp", "gpu_copy": gpu_copy, **settings})
    node.call("add_region", size=SIZE, device=0)
    eng = TransferEngine(transfer_timeout=timeout, transport="tcp", gpu_copy=gpu_copy, **settings)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    host, gpu = HostBuffer(SIZE), DeviceBuffer(SIZE, 0)
    assert eng.batch_register_memory([host.addr, gpu.addr], [SIZE, SIZE]) == 0
    return eng, node, {"host": host, "gpu": gpu}


def _close(eng, node, bufs) -> None:
    eng.close()
    node.close()
    for b in bufs.values():
        b.close()


@pytest.fixture(scope="module", params=["auto", "batch", "single"])
def pair(request):
    eng, node, bufs = _pair(request.param)
    yield eng, node, bufs
    _close(eng, node, bufs)


def _node_blocks_digest(node, region: int, offsets: list[int], block: int) -> str:
    h = hashlib.sha256()
    for off in offsets:
        h.update(bytes.fromhex(node.call("digest", region=region, offset=off, length=block)["digest"]))
    return h.hexdigest()


def _local_blocks_digest(buf, offsets: list[int], block: int) -> str:
    h = hashlib.sha256()
    for off in offsets:
        h.update(hashlib.sha256(buf.read(off, block)).digest())
    return h.hexdigest()


@pytest.mark.parametrize("block", [16 << 10, 64 << 10])
@pytest.mark.parametrize("local_kind,remote_region", [("gpu", 1), ("gpu", 0), ("host", 1)],
                         ids=["gpu-gpu", "gpu-host", "host-gpu"])
def test_paged_layout_every_mix_both_directions(pair, block, local_kind, remote_region):
    eng, node, bufs = pair
    local = bufs[local_kind]
    count = 2 * LAYERS * 16
    span = cache_bytes("paged", block, count, LAYERS)
    loc, rem = block_plan("paged", block, count, LAYERS, seed=block)
    remote = node.call("region_info", region=remote_region)["addr"]
    local.fill_random(0, span)
    node.call("set", region=remote_region, byte=0, offset=0, length=span)
    assert eng.batch_transfer_sync_write(node.session, [local.addr + o for o in loc], [remote + o for o in rem],
                                         [block] * count) == 0
    assert _node_blocks_digest(node, remote_region, rem, block) == _local_blocks_digest(local, loc, block)
    # Blocks not in the plan stay zero on the target: nothing lands outside its destinations.
    untouched = sorted(set(range(0, span, block)) - set(rem))[:8]
    zero = hashlib.sha256(bytes(block)).hexdigest()
    assert all(node.call("digest", region=remote_region, offset=o, length=block)["digest"] == zero for o in untouched)
    # Read back into zeroed local memory, from blocks the target filled afresh.
    node.call("fill", region=remote_region, offset=0, length=span)
    local.fill(0, 0, span)
    assert eng.batch_transfer_sync_read(node.session, [local.addr + o for o in loc], [remote + o for o in rem],
                                        [block] * count) == 0
    assert _local_blocks_digest(local, loc, block) == _node_blocks_digest(node, remote_region, rem, block)
    assert node.call("guards")["intact"]


def test_ten_concurrent_callers_scattered(pair):
    """10 threads move disjoint shares of one paged plan at once, writes then reads."""
    eng, node, bufs = pair
    gpu = bufs["gpu"]
    block, count = 32 << 10, 2 * LAYERS * 40
    span = cache_bytes("paged", block, count, LAYERS)
    loc, rem = block_plan("paged", block, count, LAYERS, seed=3)
    remote = node.call("region_info", region=1)["addr"]
    gpu.fill_random(0, span)
    node.call("set", region=1, byte=0, offset=0, length=span)
    codes: list[int] = []

    def run(op, c: int) -> None:
        fn = eng.batch_transfer_sync_write if op == "write" else eng.batch_transfer_sync_read
        for _ in range(3):
            codes.append(fn(node.session, [gpu.addr + o for o in loc[c::10]], [remote + o for o in rem[c::10]],
                            [block] * len(loc[c::10])))

    for op in ("write", "read"):
        if op == "read":
            node.call("fill", region=1, offset=0, length=span)
            gpu.fill(0, 0, span)
        threads = [threading.Thread(target=run, args=(op, c)) for c in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert codes and all(rc == 0 for rc in codes), codes
        codes.clear()
        assert _node_blocks_digest(node, 1, rem, block) == _local_blocks_digest(gpu, loc, block)


def test_read_timed_out_mid_transfer_leaves_local_gpu_memory_alone():
    """A read whose target stops answering fails with a timeout, and once it has returned no byte
    lands in the local GPU buffer any more, even when the target wakes up and sends the rest."""
    eng, node, bufs = _pair("auto", timeout=5.0)
    try:
        gpu = bufs["gpu"]
        block, count = 64 << 10, 2 * LAYERS * 32
        span = cache_bytes("paged", block, count, LAYERS)
        loc, rem = block_plan("paged", block, count, LAYERS, seed=5)
        remote = node.call("region_info", region=1)["addr"]
        node.call("fill", region=1, offset=0, length=span)
        assert eng.transfer_sync_read(node.session, gpu.addr, remote, 4096) == 0  # connected
        gpu.fill(0x11, 0, span)
        node.freeze()
        t0 = time.monotonic()
        rc = eng.batch_transfer_sync_read(node.session, [gpu.addr + o for o in loc], [remote + o for o in rem],
                                          [block] * count)
        assert rc != 0 and time.monotonic() - t0 < 30
        after = gpu.digest(0, span)
        os.kill(node.pid, signal.SIGCONT)
        time.sleep(1.0)
        assert gpu.digest(0, span) == after
    finally:
        _close(eng, node, bufs)


def test_peer_killed_mid_write_fails_the_call_and_the_engine_goes_on():
    eng, node, bufs = _pair("auto")
    other = None
    try:
        gpu = bufs["gpu"]
        remote = node.call("region_info", region=1)["addr"]
        gpu.fill_random(0, SIZE)
        codes: list[int] = []

        def writes() -> None:
            for _ in range(200):
                rc = eng.transfer_sync_write(node.session, gpu.addr, remote, SIZE)
                codes.append(rc)
                if rc != 0:
                    return

        t = threading.Thread(target=writes)
        t.start()
        time.sleep(0.5)
        node.kill()
        t.join(timeout=60)
        assert not t.is_alive() and codes and codes[-1] != 0
        other = NodeProcess(regions=[SIZE], config={"transport": "tcp"})
        other.call("add_region", size=SIZE, device=0)
        dest = other.call("region_info", region=1)["addr"]
        digest = gpu.digest(0, SIZE)
        assert eng.transfer_sync_write(other.session, gpu.addr, dest, SIZE) == 0
        assert other.call("digest", region=1, offset=0, length=SIZE)["digest"] == digest
    finally:
        if other is not None:
            other.close()
        _close(eng, node, bufs)


def test_small_staging_pool_shared_by_ten_callers():
    """Both engines have the smallest staging pool (two chunks a direction), 8 streams and 10
    callers want more: callers wait for chunks in turn and every block still lands in place,
    written and read back, scattered small blocks and blocks of several chunks alike."""
    eng, node, bufs = _pair("auto", gpu_staging=4 << 20, slice_size=4 << 20)
    try:
        gpu = bufs["gpu"]
        remote = node.call("region_info", region=1)["addr"]
        for block, count in ((16 << 10, 2 * LAYERS * 40), (2 << 20, 20)):
            layout = "paged" if block < (1 << 20) else "contiguous"
            span = cache_bytes(layout, block, count, LAYERS)
            loc, rem = block_plan(layout, block, count, LAYERS, seed=7)
            if layout == "contiguous":
                rem = list(reversed(rem))  # each block elsewhere on the other side
            codes: list[int] = []

            def run(op: str, c: int, loc: list[int], rem: list[int], block: int, codes: list[int]) -> None:
                fn = eng.batch_transfer_sync_write if op == "write" else eng.batch_transfer_sync_read
                for _ in range(2):
                    codes.append(fn(node.session, [gpu.addr + o for o in loc[c::10]],
                                    [remote + o for o in rem[c::10]], [block] * len(loc[c::10])))

            for op in ("write", "read"):
                if op == "write":
                    gpu.fill_random(0, span)
                    node.call("set", region=1, byte=0, offset=0, length=span)
                else:
                    node.call("fill", region=1, offset=0, length=span)
                    gpu.fill(0, 0, span)
                threads = [threading.Thread(target=run, args=(op, c, loc, rem, block, codes)) for c in range(10)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                assert not any(t.is_alive() for t in threads)
                assert len(codes) == 20 and all(rc == 0 for rc in codes), codes
                codes.clear()
                assert _node_blocks_digest(node, 1, rem, block) == _local_blocks_digest(gpu, loc, block)
        assert node.call("guards")["intact"]
    finally:
        _close(eng, node, bufs)


@pytest.mark.parametrize("local_kind,remote_region", [("gpu", 1), ("host", 1), ("gpu", 0)],
                         ids=["gpu-gpu", "host-gpu", "gpu-host"])
def test_blocks_of_many_chunks_both_directions(local_kind, remote_region):
    """8 MiB blocks with 4 MiB slices: a request longer than a staging chunk is received,
    gathered and sent in pieces on the target, and GPU-local slices are cut to one chunk."""
    eng, node, bufs = _pair("auto", slice_size=4 << 20)
    try:
        local = bufs[local_kind]
        block, count = 8 << 20, 4
        remote = node.call("region_info", region=remote_region)["addr"]
        loc = [i * block for i in range(count)]
        rem = [(count - 1 - i) * block + 4096 for i in range(count)]  # reversed, not chunk-aligned
        local.fill_random(0, count * block)
        node.call("set", region=remote_region, byte=0, offset=0, length=count * block + 4096)
        assert eng.batch_transfer_sync_write(node.session, [local.addr + o for o in loc], [remote + o for o in rem],
                                             [block] * count) == 0
        assert _node_blocks_digest(node, remote_region, rem, block) == _local_blocks_digest(local, loc, block)
        node.call("fill", region=remote_region, offset=0, length=count * block + 4096)
        local.fill(0, 0, count * block)
        assert eng.batch_transfer_sync_read(node.session, [local.addr + o for o in loc], [remote + o for o in rem],
                                            [block] * count) == 0
        assert _local_blocks_digest(local, loc, block) == _node_blocks_digest(node, remote_region, rem, block)
    finally:
        _close(eng, node, bufs)


def test_write_timed_out_mid_pipeline_reads_no_source_afterwards():
    """A write to a target that stops reading times out with pieces in every stage (gathered and
    waiting for the socket, gathers queued, slices not yet staged).  Once the call has returned,
    nothing reads the local GPU source any more: a pattern written there right after never
    reaches the target, even when it wakes up and takes what was sent."""
    eng, node, bufs = _pair("auto", timeout=3.0)
    try:
        gpu = bufs["gpu"]
        remote = node.call("region_info", region=1)["addr"]
        block, count = 1 << 20, 48
        assert eng.transfer_sync_write(node.session, gpu.addr, remote, 4096) == 0  # connected
        gpu.fill_random(0, block * count)
        node.call("set", region=1, byte=0, offset=0, length=block * count)
        node.freeze()
        t0 = time.monotonic()
        rc = eng.batch_transfer_sync_write(node.session, [gpu.addr + i * block for i in range(count)],
                                           [remote + i * block for i in range(count)], [block] * count)
        assert rc != 0 and time.monotonic() - t0 < 30
        gpu.fill(0x5A, 0, block * count)
        os.kill(node.pid, signal.SIGCONT)
        time.sleep(1.0)
        pattern = hashlib.sha256(bytes([0x5A]) * (64 << 10)).hexdigest()
        landed = [node.call("digest", region=1, offset=o, length=64 << 10)["digest"]
                  for o in range(0, block * count, 64 << 10)]
        assert pattern not in landed
        # The engine goes on: a fresh session carries the next write.
        digest = gpu.digest(0, block)
        assert eng.transfer_sync_write(node.session, gpu.addr, remote, block) == 0
        assert node.call("digest", region=1, offset=0, length=block)["digest"] == digest
    finally:
        _close(eng, node, bufs)
