"""The same-host path: process_vm_writev/readv into a peer on this kernel, with the target's
registry still in charge, and a clean fallback to TCP where the kernel says no."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from support.layouts import round_trip_runs_and_gaps

from flagcx_mc import AsyncTransferEngine, HostBuffer, errors
from flagcx_mc._testing.node import NodeProcess

SIZES = [1, 4096, (1 << 20) + 7, 64 << 20]


@pytest.fixture
async def sh_engine(local_buf):
    async with AsyncTransferEngine(transfer_timeout=5.0, transport="same-host") as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        yield eng


@pytest.fixture(scope="module")
def sh_node():
    proc = NodeProcess(regions=[65 << 20, 1 << 20])
    yield proc
    proc.close()


@pytest.mark.parametrize("size", SIZES)
async def test_same_host_write_and_read(sh_engine, sh_node, local_buf, size):
    digest = local_buf.fill_random(0, size)
    await sh_engine.transfer_sync_write(sh_node.session, local_buf.addr, sh_node.addr(0, 3), size)
    assert sh_node.call("digest", region=0, offset=3, length=size)["digest"] == digest
    assert sh_engine._state.require_sessions().peek(sh_node.session).peer.same_host
    remote = sh_node.call("fill", region=0, offset=0, length=size)["digest"]
    await sh_engine.transfer_sync_read(sh_node.session, local_buf.addr, sh_node.addr(0), size)
    assert local_buf.digest(0, size) == remote
    assert sh_node.call("guards")["intact"]


async def test_same_host_batches_and_refusals(sh_engine, sh_node, local_buf):
    block, count = 4096, 1024
    local_buf.fill_random(0, block * count)
    slots = list(range(count))[::-1]
    await sh_engine.batch_transfer_sync_write(sh_node.session, [local_buf.addr + i * block for i in range(count)],
                                              [sh_node.addr(0, s * block) for s in slots], [block] * count)
    expected = b"".join(local_buf.read((count - 1 - j) * block, block) for j in range(count))
    import hashlib

    got = sh_node.call("digest", region=0, offset=0, length=block * count)["digest"]
    assert got == hashlib.sha256(expected).hexdigest()
    with pytest.raises(errors.AddressNotRegisteredError):
        await sh_engine.transfer_sync_write(sh_node.session, local_buf.addr, sh_node.addr(1) - 8, 64)
    assert sh_node.call("guards")["intact"]


async def test_runs_of_adjacent_blocks_land_exactly_on_the_same_host_path(sh_engine, sh_node, local_buf):
    """process_vm_writev/readv get back-to-back blocks as one range per side: runs that differ per
    side, gaps, backwards runs and a block named twice still land exactly."""
    await round_trip_runs_and_gaps(sh_engine, sh_node, local_buf, seed=5)
    assert sh_engine._state.require_sessions().peek(sh_node.session).peer.same_host


async def test_a_frozen_target_still_receives_same_host_writes(sh_engine, local_buf):
    target = await asyncio.to_thread(NodeProcess, regions=[1 << 20])
    try:
        await sh_engine.transfer_sync_write(target.session, local_buf.addr, target.addr(0), 8)
        target.freeze()
        digest = local_buf.fill_random(0, 1 << 20)
        await sh_engine.transfer_sync_write(target.session, local_buf.addr, target.addr(0), 1 << 20)
        os.kill(target.pid, signal.SIGCONT)
        assert (await asyncio.to_thread(target.call, "digest", region=0))["digest"] == digest
    finally:
        os.kill(target.pid, signal.SIGCONT)
        await asyncio.to_thread(target.close)


def test_fallback_to_tcp_when_the_kernel_refuses():
    """A target the kernel does not let us reach (non-dumpable, and we lack CAP_SYS_PTRACE): the
    initiator must fall back to TCP, say why, and still deliver every byte."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_SYS_PTRACE from a child")
    target = NodeProcess(regions=[1 << 20], env={"FLAGCX_MC_NODE_NONDUMPABLE": "1"})
    try:
        initiator = NodeProcess(regions=[1 << 20], env={"FLAGCX_MC_TRANSPORT": "auto"},
                                argv_prefix=["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"])
        try:
            digest = initiator.call("fill", region=0)["digest"]
            items = [[0, 0, target.addr(0), 1 << 20]]
            reply = initiator.call("transfer", op="write", target=target.session, items=items)
            assert reply["rc"] == 0
            assert target.call("digest", region=0)["digest"] == digest
        finally:
            initiator.close()
        # Demanding the same-host path there is a clear error instead.
        strict = NodeProcess(regions=[4096], env={"FLAGCX_MC_TRANSPORT": "same-host"},
                             argv_prefix=["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"])
        try:
            reply = strict.call("transfer", op="write", target=target.session, items=[[0, 0, target.addr(0), 4096]])
            assert reply["rc"] == -303
        finally:
            strict.close()
    finally:
        target.close()


async def test_transport_tcp_keeps_the_network_path(node, local_buf):
    async with AsyncTransferEngine(transport="tcp") as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, 1 << 20)
        digest = local_buf.fill_random(0, 1 << 20)
        await eng.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 1 << 20)
        assert node.call("digest", region=1)["digest"] == digest
        assert not eng._state.require_sessions().peek(node.session).peer.same_host


def test_many_threads_same_host(sh_node):
    """vLLM's pattern (10 threads, one session) on the same-host path: every byte where it belongs."""
    from concurrent.futures import ThreadPoolExecutor

    from flagcx_mc import TransferEngine

    eng = TransferEngine(transfer_timeout=10.0, transport="same-host")
    buf = HostBuffer(40 << 20)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        buf.fill_random()
        block = 4 << 20

        def worker(t):
            return [eng.transfer_sync_write(sh_node.session, buf.addr + t * block, sh_node.addr(0, t * block), block)
                    for _ in range(5)]

        with ThreadPoolExecutor(10) as pool:
            assert list(pool.map(worker, range(10))) == [[0] * 5] * 10
        assert sh_node.call("digest", region=0, offset=0, length=10 * block)["digest"] == buf.digest(0, 10 * block)
        assert eng._state.require_sessions().peek(sh_node.session).peer.same_host
    finally:
        eng.close()
        buf.close()


def test_managed_buffers_are_shared_mappings_on_one_host():
    """A peer's managed (memfd) memory is mapped here and copied with memcpy; content exact both
    ways; unregister_memory refuses it (free_managed_buffer releases it); a freed dedicated buffer
    is refused afterwards."""
    from flagcx_mc import TransferEngine

    owner, user = TransferEngine(transport="same-host"), TransferEngine(transport="same-host")
    buf = HostBuffer(8 << 20)
    try:
        assert owner.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert user.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert user.register_memory(buf.addr, buf.size) == 0
        small, big = owner.allocate_managed_buffer(1 << 20), owner.allocate_managed_buffer(300 << 20)
        assert small and big
        for target in (small, big):
            digest = buf.fill_random(0, 1 << 20)
            assert user.transfer_sync_write(owner.session_name, buf.addr, target, 1 << 20) == 0
            import hashlib

            assert hashlib.sha256(owner.read_bytes_from_buffer(target, 1 << 20)).hexdigest() == digest
            buf.fill(0, 0, 1 << 20)
            assert user.transfer_sync_read(owner.session_name, buf.addr, target, 1 << 20) == 0
            assert buf.digest(0, 1 << 20) == digest
        peer = user._state.require_sessions().peek(owner.session_name).peer
        assert peer.same_host and peer.shared_regions >= 1
        # its pool chunk holds other buffers too: unregister_memory refuses it, the buffer stays
        assert owner.unregister_memory(small) < 0 and owner.batch_unregister_memory([small]) < 0
        assert user.transfer_sync_write(owner.session_name, buf.addr, small, 1 << 20) == 0
        assert owner.free_managed_buffer(big, 300 << 20) == 0
        assert user.transfer_sync_write(owner.session_name, buf.addr, big, 4096) == -3
    finally:
        user.close()
        owner.close()
        buf.close()


def _ragged_batch(rng, count, region_len, max_block):
    """`count` tasks of odd sizes at non-overlapping, unaligned offsets of one region."""
    sizes = [rng.randrange(1, max_block) for _ in range(count)]
    gaps = [rng.randrange(0, 5000) for _ in range(count)]
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        offsets.append(at + gap)
        at += gap + size
    assert at <= region_len
    order = list(range(count))
    rng.shuffle(order)  # not in address order: parts cut across unrelated places
    return [offsets[i] for i in order], [sizes[i] for i in order]


@pytest.mark.parametrize("op", ["write", "read"])
def test_large_calls_are_copied_in_parts_and_land_exactly(sh_node, op):
    """A large same-host call is cut into parts copied by several threads (cuts fall inside tasks,
    tasks go to two regions): every byte lands where it belongs, nothing outside the ranges."""
    import hashlib
    import random

    from flagcx_mc import TransferEngine

    rng = random.Random(7 if op == "write" else 8)
    eng = TransferEngine(transfer_timeout=10.0, transport="same-host")
    buf = HostBuffer(80 << 20)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        offs0, sizes0 = _ragged_batch(rng, 60, 40 << 20, 600 << 10)
        offs1, sizes1 = _ragged_batch(rng, 5, 1 << 20, 100 << 10)
        tasks = ([(0, o, s) for o, s in zip(offs0, sizes0, strict=True)]
                 + [(1, o, s) for o, s in zip(offs1, sizes1, strict=True)])
        tasks.append((0, 41 << 20, (9 << 20) + 3))  # one task bigger than a part: cut inside it
        rng.shuffle(tasks)
        local, at = [], 0
        for _, _, size in tasks:
            local.append(at)
            at += size + 11
        remote = [sh_node.addr(region, off) for region, off, _ in tasks]
        if op == "write":
            buf.fill_random(0, at)
            sh_node.call("set", region=0, byte=0)
            assert eng.batch_transfer_sync_write(sh_node.session, [buf.addr + o for o in local], remote,
                                                 [s for _, _, s in tasks]) == 0
            for (region, off, size), lo in zip(tasks, local, strict=True):
                got = sh_node.call("digest", region=region, offset=off, length=size)["digest"]
                assert got == hashlib.sha256(buf.read(lo, size)).hexdigest(), (region, off, size)
        else:
            expect = {0: sh_node.call("fill", region=0)["digest"], 1: sh_node.call("fill", region=1)["digest"]}
            assert expect
            buf.fill(0, 0, at)
            assert eng.batch_transfer_sync_read(sh_node.session, [buf.addr + o for o in local], remote,
                                                [s for _, _, s in tasks]) == 0
            for (region, off, size), lo in zip(tasks, local, strict=True):
                got = sh_node.call("digest", region=region, offset=off, length=size)["digest"]
                assert hashlib.sha256(buf.read(lo, size)).hexdigest() == got, (region, off, size)
                assert buf.read(lo + size, 11) == bytes(11)  # the gaps between local ranges untouched
        assert sh_node.call("guards")["intact"]
        assert eng._state.require_sessions().peek(sh_node.session).peer.same_host
    finally:
        eng.close()
        buf.close()


def _forked_child_copies(session, remote, conn):
    from flagcx_mc import TransferEngine

    eng = TransferEngine(transfer_timeout=10.0, transport="same-host")
    buf = HostBuffer(8 << 20)
    try:
        ok = (eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
              and eng.register_memory(buf.addr, buf.size) == 0)
        digest = buf.fill_random(0, 8 << 20)
        ok = ok and eng.transfer_sync_write(session, buf.addr, remote, 8 << 20) == 0
        conn.send((ok, digest))
    finally:
        eng.close()
        buf.close()


def test_a_forked_child_copies_in_parts_too(sh_node):
    """The copy helpers are threads of the parent; a child forked after they started must not wait
    for them (it starts its own)."""
    import multiprocessing

    from flagcx_mc import TransferEngine

    eng = TransferEngine(transfer_timeout=10.0, transport="same-host")
    buf = HostBuffer(8 << 20)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        assert eng.transfer_sync_write(sh_node.session, buf.addr, sh_node.addr(0), 8 << 20) == 0  # helpers run
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=_forked_child_copies, args=(sh_node.session, sh_node.addr(0, 16 << 20), child_end))
        child.start()
        try:
            assert parent_end.poll(60), "the forked child's same-host copy did not finish"
            ok, digest = parent_end.recv()
            assert ok
            assert sh_node.call("digest", region=0, offset=16 << 20, length=8 << 20)["digest"] == digest
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    finally:
        eng.close()
        buf.close()


def test_a_shared_mapping_is_never_unmapped_under_a_running_copy():
    """A peer's region leaves its table (and a refresh drops its mapping here) while same-host
    copies into that mapping are running: the mapping goes only after the last copy (a mapping
    dropped under a running copy kills the child with SIGSEGV)."""
    child = os.path.join(os.path.dirname(__file__), "helpers", "same_host_unmap_child.py")
    done = subprocess.run([sys.executable, child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip().endswith("ok")


def test_hundreds_of_initiating_engines_reach_one_target_on_the_same_host_path():
    """160 engines (in five processes) make their first call into one target at once, each
    demanding the same-host path: every one gets a busy word of its own and lands its bytes."""
    from flagcx_mc.tools.bench.peers import measure_first_contact

    row = measure_first_contact("flagcx_mc", 160, config={"transport": "same-host"})
    assert row["error"] is None and row["verified"], row


def _busy_owners(pid: int, fd: int):
    """The owner pids of a target's busy words, mapped from its control block (the memfd the
    handshake names): its size says how many words there are (a u64 magic, 4096 u64 slot
    states, then N u64 busy words and N int owners)."""
    import mmap as mmap_module

    with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
        block = mmap_module.mmap(f.fileno(), 0)
    words = (len(block) - 8 - 4096 * 8) // 12
    return block, memoryview(block)[8 + 4096 * 8 + 8 * words:][:4 * words].cast("i")


async def test_a_full_control_block_reclaims_dead_owners_and_refuses_live_ones(local_buf):
    """When every busy word is taken, a new initiator takes those of dead processes; with all
    owners alive, demanding the same-host path fails with a clear error and auto falls back to
    TCP, landing every byte."""
    target = NodeProcess(regions=[1 << 20])
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    block = owners = None
    try:
        async def write(transport: str, offset: int) -> AsyncTransferEngine:
            eng = AsyncTransferEngine(transfer_timeout=5.0, transport=transport)
            try:
                await eng.initialize("127.0.0.1")
                await eng.register_memory(local_buf.addr, local_buf.size)
                digest = local_buf.fill_random(offset, 4096)
                await eng.transfer_sync_write(target.session, local_buf.addr + offset, target.addr(0, offset), 4096)
            except BaseException:
                await eng.close()
                raise
            assert target.call("digest", region=0, offset=offset, length=4096)["digest"] == digest
            return eng

        first = await write("same-host", 0)
        native = first._state.require_sessions().peek(target.session).desc.native
        await first.close()
        block, owners = _busy_owners(native.pid, native.shm_fd)
        for i in range(len(owners)):
            owners[i] = dead.pid
        eng = await write("same-host", 4096)
        assert eng._state.require_sessions().peek(target.session).peer.same_host
        assert sum(1 for o in owners if o == os.getpid()) >= 1  # took dead owners' words
        await eng.close()
        for i in range(len(owners)):
            owners[i] = alive.pid
        with pytest.raises(errors.NotSupportedError, match="no free same-host initiator slot"):
            await write("same-host", 8192)
        eng = await write("auto", 12288)
        assert not eng._state.require_sessions().peek(target.session).peer.same_host
        await eng.close()
    finally:
        if owners is not None:
            owners.release()
        if block is not None:
            block.close()
        alive.kill()
        alive.wait()
        target.close()
