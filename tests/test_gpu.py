"""GPU memory: device pointers wherever host addresses go, two processes, every direction, by content.

Runs where a CUDA driver and device exist (the H200 machine); skipped elsewhere with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flagcx_mc import TransferEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.buffers import DeviceBuffer, HostBuffer, cuda_device_count

_COUNT, _WHY = cuda_device_count()
pytestmark = pytest.mark.skipif(_COUNT == 0, reason=f"no CUDA device here: {_WHY}")

SIZE = 64 << 20
SIZES = [4096, (1 << 20) + 7, SIZE]


@pytest.fixture(scope="module", params=["tcp", "auto"])
def gpu_pair(request):
    """Our engine (host and GPU buffers) and a node with a host region [0] and a GPU region [1]."""
    node = NodeProcess(regions=[SIZE])
    node.call("add_region", size=SIZE, device=0)
    eng = TransferEngine(transfer_timeout=30.0, transport=request.param)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    host, gpu = HostBuffer(SIZE), DeviceBuffer(SIZE, 0)
    assert eng.batch_register_memory([host.addr, gpu.addr], [SIZE, SIZE]) == 0
    yield eng, node, {"host": host, "gpu": gpu}
    eng.close()
    node.close()
    host.close()
    gpu.close()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("local_kind,remote_region", [("gpu", 1), ("host", 1), ("gpu", 0)])
def test_write_and_read_every_direction(gpu_pair, size, local_kind, remote_region):
    eng, node, bufs = gpu_pair
    local = bufs[local_kind]
    digest = local.fill_random(0, size)
    remote = _region_addr(node, remote_region)
    assert eng.transfer_sync_write(node.session, local.addr, remote, size) == 0
    assert node.call("digest", region=remote_region, offset=0, length=size)["digest"] == digest
    digest = node.call("fill", region=remote_region, offset=0, length=size)["digest"]
    local.fill(0, 0, size)
    assert eng.transfer_sync_read(node.session, local.addr, remote, size) == 0
    assert local.digest(0, size) == digest
    assert node.call("guards")["intact"]


def test_gpu_batches_scattered(gpu_pair):
    eng, node, bufs = gpu_pair
    gpu = bufs["gpu"]
    block, count = 64 << 10, 256
    gpu.fill_random(0, block * count)
    remote = _region_addr(node, 1)
    order = list(range(count))[::-1]
    assert eng.batch_transfer_sync_write(node.session, [gpu.addr + i * block for i in range(count)],
                                         [remote + j * block for j in order], [block] * count) == 0
    import hashlib

    expected = b"".join(gpu.read((count - 1 - j) * block, block) for j in range(count))
    got = node.call("digest", region=1, offset=0, length=block * count)["digest"]
    assert got == hashlib.sha256(expected).hexdigest()


@pytest.mark.parametrize("remote_region", [0, 1], ids=["to host", "to gpu"])
def test_small_writes_from_host_and_gpu_sources_mixed_in_one_batch(gpu_pair, remote_region):
    """4 KiB slices of one batch come from host and GPU memory in turn: over TCP they travel as
    vectors (the GPU sources staged, the vectors holding them copied, not spliced), and every
    block lands in its place; reads back into host memory are vectors too."""
    import hashlib

    eng, node, bufs = gpu_pair
    host, gpu = bufs["host"], bufs["gpu"]
    block, count = 4096, 768
    source = [gpu if i % 3 == 0 else host for i in range(count)]
    host.fill_random(0, block * count)
    gpu.fill_random(0, block * count)
    remote = _region_addr(node, remote_region)
    before = node.call("stats")["vectors_served"]
    assert eng.batch_transfer_sync_write(node.session, [source[i].addr + i * block for i in range(count)],
                                         [remote + i * block for i in range(count)], [block] * count) == 0
    expected = b"".join(source[i].read(i * block, block) for i in range(count))
    assert node.call("digest", region=remote_region, offset=0, length=block * count)["digest"] == \
        hashlib.sha256(expected).hexdigest()
    digest = node.call("fill", region=remote_region, offset=0, length=block * count)["digest"]
    host.fill(0, 0, block * count)
    assert eng.batch_transfer_sync_read(node.session, [host.addr + i * block for i in range(count)],
                                        [remote + i * block for i in range(count)], [block] * count) == 0
    assert host.digest(0, block * count) == digest
    if eng._state.config.transport == "tcp":
        assert node.call("stats")["vectors_served"] > before
        # GPU sources alone form vectors too
        before = node.call("stats")["vectors_served"]
        digest = gpu.fill_random(0, 64 * block)
        assert eng.batch_transfer_sync_write(node.session, [gpu.addr + i * block for i in range(64)],
                                             [remote + i * block for i in range(64)], [block] * 64) == 0
        assert node.call("digest", region=remote_region, offset=0, length=64 * block)["digest"] == digest
        assert node.call("stats")["vectors_served"] > before
    assert node.call("guards")["intact"]


@pytest.mark.parametrize("local_kind", ["host", "gpu"])
def test_gpu_runs_of_contiguous_writes_with_gaps(gpu_pair, local_kind):
    """Writes into GPU memory whose destinations follow each other are copied as one run on the
    target; a gap, a full run or the end of the batch closes a run.  Every byte lands, in
    order, and nothing lands in the gaps."""
    import hashlib

    eng, node, bufs = gpu_pair
    local = bufs[local_kind]
    block, count = 64 << 10, 300
    slots = [i + i // 7 for i in range(count)]  # runs of 7 contiguous blocks, then a one-block gap
    span = (slots[-1] + 1) * block
    node.call("set", region=1, byte=0xEE, offset=0, length=span)
    local.fill_random(0, block * count)
    remote = _region_addr(node, 1)
    assert eng.batch_transfer_sync_write(node.session, [local.addr + i * block for i in range(count)],
                                         [remote + s * block for s in slots], [block] * count) == 0
    expected = bytearray(b"\xee" * span)
    for i, s in enumerate(slots):
        expected[s * block:(s + 1) * block] = local.read(i * block, block)
    assert node.call("digest", region=1, offset=0, length=span)["digest"] == hashlib.sha256(expected).hexdigest()


def test_gpu_range_past_its_allocation_is_refused(gpu_pair):
    eng, node, bufs = gpu_pair
    assert eng.transfer_sync_write(node.session, bufs["gpu"].addr + SIZE - 8, _region_addr(node, 1), 16) == -3
    other = DeviceBuffer(1 << 20, 0)
    try:
        assert eng.register_memory(other.addr, 2 << 20) == -1  # longer than the allocation
    finally:
        other.close()


def _region_addr(node, index: int) -> int:
    """Address of a node region added after start (regions[] only lists the initial ones)."""
    info = node.call("region_info", region=index)
    return info["addr"]


def test_same_host_gpu_copies_bypass_the_network(gpu_pair, request):
    """With transport=auto, GPU -> GPU on one host goes through CUDA IPC: the target's data
    server never sees those bytes; with transport=tcp it does."""
    eng, node, bufs = gpu_pair
    gpu = bufs["gpu"]
    before = node.call("stats")["bytes_served_in"]
    digest = gpu.fill_random(0, 8 << 20)
    assert eng.transfer_sync_write(node.session, gpu.addr, _region_addr(node, 1), 8 << 20) == 0
    assert node.call("digest", region=1, offset=0, length=8 << 20)["digest"] == digest
    served = node.call("stats")["bytes_served_in"] - before
    if eng._state.config.transport == "auto":
        assert served == 0
    else:
        assert served == 8 << 20


@pytest.mark.skipif(_COUNT < 2, reason=f"needs two CUDA devices on one host, this machine has {_COUNT}")
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("size", [4096, (1 << 20) + 7, 64 << 20])
def test_prefill_on_one_gpu_decode_on_another(transport, size):
    """GPU 0 -> GPU 1 of one host: CUDA IPC with peer access, or staging over TCP."""
    node = NodeProcess(regions=[4096])
    node.call("add_region", size=64 << 20, device=1)
    eng = TransferEngine(transfer_timeout=30.0, transport=transport)
    src = DeviceBuffer(64 << 20, 0)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(src.addr, src.size) == 0
        remote = _region_addr(node, 1)
        digest = src.fill_random(0, size)
        assert eng.transfer_sync_write(node.session, src.addr, remote, size) == 0
        assert node.call("digest", region=1, offset=0, length=size)["digest"] == digest
        digest = node.call("fill", region=1, offset=0, length=size)["digest"]
        assert eng.transfer_sync_read(node.session, src.addr, remote, size) == 0
        assert src.digest(0, size) == digest
    finally:
        eng.close()
        node.close()
        src.close()


VMM_CHUNK = 2 << 20


@pytest.fixture(scope="module")
def vmm_node():
    """A node whose GPU regions are VMM memory in 2 MiB chunks: [1] shareable (POSIX fd handles),
    [2] not; both start a guard's width into their first chunk and span a dozen chunks."""
    node = NodeProcess(regions=[4096])
    node.call("add_region", size=24 << 20, device=0, vmm_chunk=VMM_CHUNK, shareable=True)
    node.call("add_region", size=24 << 20, device=0, vmm_chunk=VMM_CHUNK, shareable=False)
    yield node
    node.close()


@pytest.mark.parametrize("region,same_host", [(1, True), (2, False)], ids=["shareable", "not-shareable"])
@pytest.mark.parametrize("local_kind", ["gpu", "host"])
def test_vmm_memory_in_many_chunks_moves_every_direction(vmm_node, region, same_host, local_kind):
    """Memory made like torch's expandable segments registers as one region although
    cuMemGetAddressRange reports only the chunk holding a pointer.  A same-host peer maps
    shareable chunks (their file descriptors, taken with pidfd_getfd) and copies device to
    device: the target's data server sees none of the bytes.  Chunks that cannot be shared still
    move, through staging over TCP, never by process_vm_writev into GPU addresses."""
    node, size = vmm_node, 24 << 20
    remote = _region_addr(node, region)
    eng = TransferEngine(transfer_timeout=30.0, transport="auto")
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = DeviceBuffer(size, 0) if local_kind == "gpu" else HostBuffer(size)
    try:
        assert eng.register_memory(local.addr, size) == 0
        before = node.call("stats")
        digest = local.fill_random(0, size)
        assert eng.transfer_sync_write(node.session, local.addr, remote, size) == 0
        assert node.call("digest", region=region, offset=0, length=size)["digest"] == digest
        # scattered 64 KiB blocks, several straddling chunk boundaries
        offsets = [k * VMM_CHUNK - 32768 for k in range(1, 12)]
        digest = local.fill_random(0, size)
        assert eng.batch_transfer_sync_write(node.session, [local.addr + o for o in offsets],
                                             [remote + o for o in offsets], [65536] * len(offsets)) == 0
        for o in offsets:
            assert node.call("digest", region=region, offset=o, length=65536)["digest"] == local.digest(o, 65536)
        digest = node.call("fill", region=region, offset=0, length=size)["digest"]
        local.fill(0, 0, size)
        assert eng.transfer_sync_read(node.session, local.addr, remote, size) == 0
        assert local.digest(0, size) == digest
        assert node.call("guards")["intact"]
        after = node.call("stats")
        moved_by_server = (after["bytes_served_in"] - before["bytes_served_in"],
                           after["bytes_served_out"] - before["bytes_served_out"])
        assert moved_by_server == ((0, 0) if same_host else (size + 65536 * len(offsets), size))
    finally:
        eng.close()
        local.close()


def test_vmm_region_unregistered_and_registered_again_while_mapped():
    """A peer that mapped a VMM region's chunks writes nothing into it once it is unregistered
    (the call fails, the bytes stay), and maps it afresh when it is registered again.  The
    target's exported chunk descriptors close with the unregistration."""
    def driver_fds() -> int:  # exported chunks, like the driver's own handles, read as /dev/nvidiactl
        fd_dir = f"/proc/{node.pid}/fd"
        return sum(os.readlink(os.path.join(fd_dir, f)) == "/dev/nvidiactl" for f in os.listdir(fd_dir))

    node = NodeProcess(regions=[4096])
    eng = TransferEngine(transfer_timeout=30.0, transport="auto")
    src = DeviceBuffer(8 << 20, 0)
    try:
        node.call("add_region", size=8 << 20, device=0, vmm_chunk=VMM_CHUNK)
        remote = _region_addr(node, 1)
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(src.addr, 8 << 20) == 0
        digest = src.fill_random()
        assert eng.transfer_sync_write(node.session, src.addr, remote, 8 << 20) == 0
        assert node.call("digest", region=1)["digest"] == digest
        exported = driver_fds()
        assert node.call("unregister", region=1)["rc"] == 0
        assert exported - driver_fds() == 5  # 8 MiB after a guard's width into 2 MiB chunks: 5 chunks
        src.fill_random()
        assert eng.transfer_sync_write(node.session, src.addr, remote, 8 << 20) < 0
        assert node.call("digest", region=1)["digest"] == digest
        assert node.call("register", region=1)["rc"] == 0
        digest = src.fill_random()
        assert eng.transfer_sync_write(node.session, src.addr, remote, 8 << 20) == 0
        assert node.call("digest", region=1)["digest"] == digest
        assert node.call("stats")["bytes_served_in"] == 0  # both writes that landed were device copies
    finally:
        eng.close()
        node.close()
        src.close()


@pytest.mark.parametrize("vmm_chunk", [0, VMM_CHUNK], ids=["cudaMalloc", "vmm"])
def test_region_leaving_the_table_under_running_copies_keeps_the_context_sane(vmm_chunk):
    """Same-host GPU copies keep running while the target unregisters their region and another
    thread keeps refreshing the peer's table: every copy stays on the same-host path through the
    refreshes (a refresh that dropped the regions' slots, even briefly, would send calls over TCP:
    the served-bytes check sees that), no mapping is unmapped under a copy, and GPU transfers
    afterwards land exactly.  (A GPU mapping unmapped under a copy need not fault;
    test_same_host's shared-buffer twin of this test is the one that crashes then.)"""
    import threading
    import time

    size = 64 << 20
    node = NodeProcess(regions=[4096])
    eng = TransferEngine(transfer_timeout=30.0, transport="auto")
    src = DeviceBuffer(size, 0)
    try:
        node.call("add_region", size=size, device=0, vmm_chunk=vmm_chunk)
        node.call("add_region", size=size, device=0)
        doomed, spare = _region_addr(node, 1), _region_addr(node, 2)
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(src.addr, size) == 0
        src.fill_random()
        assert eng.transfer_sync_write(node.session, src.addr, doomed, size) == 0
        sessions, stop = eng._state.require_sessions(), threading.Event()

        def writer():
            while not stop.is_set():
                eng.transfer_sync_write(node.session, src.addr, doomed, size)  # fails once unregistered

        def refresher():
            while not stop.is_set():
                session = sessions.peek(node.session)
                if session is not None:
                    eng._run(sessions.refresh(node.session, session))

        threads = [threading.Thread(target=writer), threading.Thread(target=refresher)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert node.call("unregister", region=1)["rc"] == 0
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(60)
        digest = src.fill_random()
        assert eng.transfer_sync_write(node.session, src.addr, spare, size) == 0
        assert node.call("digest", region=2)["digest"] == digest
        assert src.digest() == digest
        assert node.call("stats")["bytes_served_in"] == 0  # device copies throughout
    finally:
        eng.close()
        node.close()
        src.close()


def test_torch_expandable_segments_register_whole_and_move_same_host():
    """A tensor of torch's expandable segments spans several 20 MiB chunks: it registers as one
    region, and a same-host peer maps its chunks where torch made them shareable (POSIX file
    descriptors; the target's data server then sees no byte), else stages them over TCP."""
    pytest.importorskip("torch")  # the child allocates the VMM memory through torch

    size = 64 << 20
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    script = os.path.join(os.path.dirname(__file__), "helpers", "gpu_vmm_child.py")
    child = subprocess.Popen([sys.executable, script, str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(child.stdout.readline())
        assert info["rc"] == 0
        eng = TransferEngine(transfer_timeout=30.0, transport="auto")
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = DeviceBuffer(size, 0)
        assert eng.register_memory(src.addr, size, "cuda:0") == 0
        digest = src.fill_random(0, size)
        assert eng.transfer_sync_write(info["session"], src.addr, info["addr"], size) == 0
        child.stdin.write("\n")
        child.stdin.flush()
        seen = json.loads(child.stdout.readline())
        assert seen["sha256"] == digest
        assert seen["served_in"] == (0 if info["posix_fd"] else size)
        src.fill(0, 0, size)
        assert eng.transfer_sync_read(info["session"], src.addr, info["addr"], size) == 0
        assert src.digest(0, size) == digest
        eng.close()
        src.close()
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()


# ---------------------------------------------------------------- which GPUs a process touches

def _smi(*query: str) -> list[list[str]]:
    """Rows of an nvidia-smi CSV query ([] where nvidia-smi is missing or fails)."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def _used_mib(uuid: str) -> int | None:
    rows = _smi("--query-gpu=uuid,memory.used")
    used = [int(row[1]) for row in rows if row[0] == uuid]
    return used[0] if used else None


def _gpus_of(pid: int) -> set[str]:
    """UUIDs of the GPUs nvidia-smi lists process `pid` on (empty also where the container's PID
    namespace hides it: callers check stats() and used memory as well)."""
    return {row[0] for row in _smi("--query-compute-apps=gpu_uuid,pid") if len(row) > 1 and row[1] == str(pid)}


def test_host_only_process_creates_no_cuda_context():
    """A process that registers only host memory makes no CUDA context, whether it writes to a
    peer's GPU over TCP or same host (where it cannot map the peer's memory without one: the
    peer stages those bytes through its own GPU): stats() lists none, nvidia-smi does not list
    the process, and the GPU's used memory does not grow by a context's worth."""
    from flagcx_mc._core import device_uuid

    uuid = device_uuid(0)
    target = NodeProcess(regions=[4096])
    target.call("add_region", size=SIZE, device=0)
    remote = _region_addr(target, 1)
    before = _used_mib(uuid)
    nodes = [NodeProcess(regions=[SIZE], config={"transport": t, "transfer_timeout": 30.0}) for t in ("tcp", "auto")]
    try:
        for node in nodes:
            served = target.call("stats")["bytes_served_in"]
            digest = node.call("fill", region=0)["digest"]
            assert node.call("transfer", op="write", target=target.session, items=[[0, 0, remote, SIZE]])["rc"] == 0
            assert target.call("digest", region=1, length=SIZE)["digest"] == digest
            assert target.call("stats")["bytes_served_in"] - served == SIZE  # staged by the target
            stats = node.call("stats")
            assert stats["cuda_contexts"] == [] and stats["cuda_context_uuids"] == []
            assert _gpus_of(node.pid) == set()
        after = _used_mib(uuid)
        if before is not None and after is not None:
            assert after - before < 128, f"used memory grew from {before} to {after} MiB"
    finally:
        for node in nodes:
            node.close()
        target.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_gpu_transfers_retain_exactly_the_device_they_use(transport):
    """A process whose memory is on the last GPU, writing to and reading from a peer's GPU over
    TCP (host staging) or same host (CUDA IPC), holds a context on that GPU alone (on an
    eight-GPU host, none on GPU 0)."""
    from flagcx_mc._core import device_uuid

    dev = _COUNT - 1
    target = NodeProcess(regions=[4096])
    target.call("add_region", size=SIZE, device=dev)
    node = NodeProcess(regions=[4096], config={"transport": transport, "transfer_timeout": 30.0})
    try:
        node.call("add_region", size=SIZE, device=dev)
        remote = _region_addr(target, 1)
        served = target.call("stats")["bytes_served_in"]
        digest = node.call("fill", region=1)["digest"]
        assert node.call("transfer", op="write", target=target.session, items=[[1, 0, remote, SIZE]])["rc"] == 0
        assert target.call("digest", region=1, length=SIZE)["digest"] == digest
        assert target.call("stats")["bytes_served_in"] - served == (SIZE if transport == "tcp" else 0)
        digest = target.call("fill", region=1, length=SIZE)["digest"]
        assert node.call("transfer", op="read", target=target.session, items=[[1, 0, remote, SIZE]])["rc"] == 0
        assert node.call("digest", region=1)["digest"] == digest
        for n in (node, target):
            stats = n.call("stats")
            assert stats["cuda_contexts"] == [dev] and stats["cuda_context_uuids"] == [device_uuid(dev)]
            assert _gpus_of(n.pid) <= {device_uuid(dev)}
    finally:
        node.close()
        target.close()


def test_peer_gpu_not_visible_here_falls_back_with_one_reason(monkeypatch, caplog):
    """A same-host peer whose descriptor names a GPU this process does not see (as with another
    CUDA_VISIBLE_DEVICES; here its UUID is replaced on the way in): the bytes still move, through
    host staging over TCP, verified by content, and the reason is logged once."""
    import dataclasses
    import logging

    from flagcx_mc.engine import sessions

    unseen = "GPU-ffffffff-0000-0000-0000-000000000000"
    real = sessions._set_regions

    def elsewhere(peer, desc, logged):
        if desc.native is not None:
            regions = tuple(dataclasses.replace(r, cuda=dataclasses.replace(r.cuda, uuid=unseen))
                            if r.cuda is not None else r for r in desc.native.regions)
            desc = dataclasses.replace(desc, native=dataclasses.replace(desc.native, regions=regions))
        real(peer, desc, logged)

    monkeypatch.setattr(sessions, "_set_regions", elsewhere)
    node = NodeProcess(regions=[4096])
    node.call("add_region", size=SIZE, device=0)
    eng = TransferEngine(transfer_timeout=30.0, transport="auto")
    src = DeviceBuffer(SIZE, 0)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(src.addr, SIZE) == 0
        remote = _region_addr(node, 1)
        with caplog.at_level(logging.WARNING, logger="flagcx_mc"):
            for _ in range(2):
                served = node.call("stats")["bytes_served_in"]
                digest = src.fill_random()
                assert eng.transfer_sync_write(node.session, src.addr, remote, SIZE) == 0
                assert node.call("digest", region=1, length=SIZE)["digest"] == digest
                assert node.call("stats")["bytes_served_in"] - served == SIZE
            digest = node.call("fill", region=1, length=SIZE)["digest"]
            assert eng.transfer_sync_read(node.session, src.addr, remote, SIZE) == 0
            assert src.digest() == digest
        reasons = [r.getMessage() for r in caplog.records if unseen in r.getMessage()]
        assert len(reasons) == 1, reasons
    finally:
        eng.close()
        node.close()
        src.close()
