"""Which GPUs a process touches, and how it finds a peer's GPU: on the CPU machine, through a fake
CUDA driver (tests/helpers/fake_libcuda.c, loaded with FLAGCX_MC_LIBCUDA) whose devices are host
memory named by UUID.  Each engine runs in a node process of its own, since a process loads its
driver once.  The fake refuses to open an IPC handle on a device other than the one with the
handle's UUID, and logs every context it gives out and every pinned allocation, so the tests see
which devices the core chose."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.metadata.descriptor import GpuShare, RegionDesc, gpu_uuid_bytes, gpu_uuid_text

U0, U1, U2 = ("00112233445566778899aabbccddeef0", "00112233445566778899aabbccddeef1",
              "00112233445566778899aabbccddeef2")
SIZE = 4 << 20


def _text(u: str) -> str:
    return gpu_uuid_text(bytes.fromhex(u))


class _Fake:
    """Environment of one node process on the fake driver, and what the driver saw there."""

    def __init__(self, driver: str, tmp_path, name: str, uuids: list[str], ipc_fail: bool = False) -> None:
        self.log = str(tmp_path / f"{name}.log")
        self.env = {"FLAGCX_MC_LIBCUDA": driver, "FAKE_CUDA_UUIDS": ",".join(uuids), "FAKE_CUDA_LOG": self.log,
                    "FAKE_CUDA_IPC_FAIL": "1" if ipc_fail else "0"}

    def events(self, kind: str) -> list[str]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [line.split()[1] for line in f if line.split()[0] == kind]

    def faults(self) -> list[str]:
        return self.events("nocontext") + self.events("wrongdevice")


def _node(fake: _Fake, transport: str = "auto") -> NodeProcess:
    return NodeProcess(regions=[SIZE], config={"transport": transport, "transfer_timeout": 20.0}, env=fake.env)


def _write_and_check(src: NodeProcess, src_region: int, dst: NodeProcess, dst_region: int) -> int:
    """Write SIZE bytes of src's region into dst's and back the other way; returns the bytes dst's
    data server moved (0: the same-host path carried them)."""
    before = dst.call("stats")
    digest = src.call("fill", region=src_region)["digest"]
    remote = dst.call("region_info", region=dst_region)["addr"]
    rc = src.call("transfer", op="write", target=dst.session, items=[[src_region, 0, remote, SIZE]])["rc"]
    assert rc == 0
    assert dst.call("digest", region=dst_region)["digest"] == digest
    digest = dst.call("fill", region=dst_region)["digest"]
    src.call("set", region=src_region, byte=0)
    assert src.call("transfer", op="read", target=dst.session, items=[[src_region, 0, remote, SIZE]])["rc"] == 0
    assert src.call("digest", region=src_region)["digest"] == digest
    assert src.call("guards")["intact"] and dst.call("guards")["intact"]
    after = dst.call("stats")
    return sum(after[k] - before[k] for k in ("bytes_served_in", "bytes_served_out"))


def test_uuid_text_round_trip_and_descriptor_keeps_the_ordinal():
    raw = bytes.fromhex(U1)
    assert gpu_uuid_text(raw) == "GPU-00112233-4455-6677-8899-aabbccddeef1"
    assert gpu_uuid_bytes(gpu_uuid_text(raw)) == raw and gpu_uuid_bytes("GPU-12") is None
    from flagcx_mc.metadata.descriptor import _gpu_share, _region_json

    r = RegionDesc(addr=4096, length=4096, key=7, cuda=GpuShare(3, gpu_uuid_text(raw)))
    out = _region_json(r)
    assert out["cuda"] == {"dev": 3, "uuid": gpu_uuid_text(raw)}  # older peers still read "dev"
    assert _gpu_share(out["cuda"], 4096, 4096, "r") == r.cuda
    assert _gpu_share({"dev": 3}, 4096, 4096, "r") == GpuShare(3)  # from an older peer


def test_uuid_names_the_device_in_each_process(fake_driver, tmp_path):
    """The target sees one GPU (its ordinal 0); the initiator sees two, the target's as ordinal
    1, and uses that one.  The target's descriptor says ordinal 0 and the UUID: the initiator
    opens the handle under its ordinal 1 (by the ordinal it would take GPU 0, a device it does
    not use), copies device to device (the target's server moves nothing), and holds a context on
    ordinal 1 alone."""
    fa, fb = _Fake(fake_driver, tmp_path, "a", [U0, U1]), _Fake(fake_driver, tmp_path, "b", [U1])
    a, b = _node(fa), _node(fb)
    try:
        b.call("add_region", size=SIZE, device=0)
        a.call("add_region", size=SIZE, device=1)
        assert _write_and_check(a, 1, b, 1) == 0
        stats = a.call("stats")
        assert stats["cuda_contexts"] == [1] and stats["cuda_context_uuids"] == [_text(U1)]
        assert set(fa.events("retain")) == {U1} and fa.events("ipcopen") == [U1]
        assert b.call("stats")["cuda_contexts"] == [0]
        assert set(fb.events("retain")) == {U1}
        assert fa.faults() == [] and fb.faults() == []
    finally:
        a.close()
        b.close()


def test_peer_gpu_mapped_under_this_process_own_gpu(fake_driver, tmp_path):
    """Both GPUs are visible here, but this process uses only GPU U0: the target's memory on U1
    is mapped under U0's context (peer access) rather than making a context on U1."""
    fa, fb = _Fake(fake_driver, tmp_path, "a", [U0, U1]), _Fake(fake_driver, tmp_path, "b", [U0, U1])
    a, b = _node(fa), _node(fb)
    try:
        b.call("add_region", size=SIZE, device=1)
        a.call("add_region", size=SIZE, device=0)
        assert _write_and_check(a, 1, b, 1) == 0
        assert a.call("stats")["cuda_contexts"] == [0]
        assert set(fa.events("retain")) == {U0} and fa.events("ipcopen") == [U0]
        assert fa.faults() == [] and fb.faults() == []
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("local", ["gpu", "host"])
def test_peer_gpu_not_visible_here_moves_through_staging(fake_driver, tmp_path, local):
    """The target's GPU is not among this process's devices: the region still moves, through
    host staging over TCP, and this process makes no context for the peer's GPU."""
    fa, fb = _Fake(fake_driver, tmp_path, "a", [U0]), _Fake(fake_driver, tmp_path, "b", [U2])
    a, b = _node(fa), _node(fb)
    try:
        b.call("add_region", size=SIZE, device=0)
        region = 0
        if local == "gpu":
            region = a.call("add_region", size=SIZE, device=0)["index"]
        assert _write_and_check(a, region, b, 1) == 2 * SIZE
        assert a.call("stats")["cuda_contexts"] == ([0] if local == "gpu" else [])
        assert set(fa.events("retain")) <= {U0}
        assert fa.faults() == [] and fb.faults() == []
    finally:
        a.close()
        b.close()


def test_ipc_refused_falls_back_to_staging(fake_driver, tmp_path):
    """Both see the same GPU but the driver will not open the handle: the bytes go over TCP."""
    fa = _Fake(fake_driver, tmp_path, "a", [U0], ipc_fail=True)
    fb = _Fake(fake_driver, tmp_path, "b", [U0])
    a, b = _node(fa), _node(fb)
    try:
        b.call("add_region", size=SIZE, device=0)
        a.call("add_region", size=SIZE, device=0)
        assert _write_and_check(a, 1, b, 1) == 2 * SIZE
        assert a.call("stats")["cuda_contexts"] == [0]
        assert fa.faults() == [] and fb.faults() == []
    finally:
        a.close()
        b.close()


def test_host_only_process_creates_no_context(fake_driver, tmp_path):
    """A process that registers only host memory, on a host with GPUs, makes no CUDA context:
    neither registering, nor moving bytes to a peer's host memory (same host) or, over TCP, to a
    peer's GPU memory."""
    fa, fb = _Fake(fake_driver, tmp_path, "a", [U0, U1]), _Fake(fake_driver, tmp_path, "b", [U0])
    a, b = _node(fa, transport="tcp"), _node(fb)
    same_host = _node(fa)
    try:
        b.call("add_region", size=SIZE, device=0)
        assert _write_and_check(a, 0, b, 1) == 2 * SIZE
        assert _write_and_check(same_host, 0, b, 0) == 0
        for node in (a, same_host):
            stats = node.call("stats")
            assert stats["cuda_contexts"] == [] and stats["cuda_context_uuids"] == []
        assert fa.events("retain") == [] and fa.events("pinned") == []
        assert fb.events("retain") == [U0]
    finally:
        a.close()
        same_host.close()
        b.close()


def test_staging_is_pinned_under_the_device_it_serves(fake_driver, tmp_path):
    """GPU memory of ordinal 1 only, over TCP, both directions, on both sides: every pinned
    staging buffer is made under ordinal 1's context, and ordinal 0 is never touched."""
    fa, fb = _Fake(fake_driver, tmp_path, "a", [U0, U1]), _Fake(fake_driver, tmp_path, "b", [U2, U1])
    a, b = _node(fa, transport="tcp"), _node(fb, transport="tcp")
    try:
        a.call("add_region", size=SIZE, device=1)
        b.call("add_region", size=SIZE, device=1)
        assert _write_and_check(a, 1, b, 1) == 2 * SIZE
        assert _write_and_check(a, 1, b, 0) == 2 * SIZE  # the target stages nothing: host memory
        assert fa.events("pinned") and set(fa.events("pinned")) == {U1}
        assert fb.events("pinned") and set(fb.events("pinned")) == {U1}
        assert set(fa.events("retain")) == {U1} and set(fb.events("retain")) == {U1}
        assert a.call("stats")["cuda_contexts"] == [1] and b.call("stats")["cuda_contexts"] == [1]
        assert fa.faults() == [] and fb.faults() == []
    finally:
        a.close()
        b.close()


_CHOICE_SCRIPT = """
import json
from flagcx_mc._core import cuda_contexts, lib, mapping_device, resolve_peer_device
from flagcx_mc.buffers import DeviceBuffer
from flagcx_mc.metadata.descriptor import GpuShare, gpu_uuid_text

def uuid(h):
    return gpu_uuid_text(bytes.fromhex(h))

shares = {"u0": GpuShare(5, uuid(%(u0)r)), "u1": GpuShare(0, uuid(%(u1)r)), "u2": GpuShare(0, uuid(%(u2)r)),
          "dev1": GpuShare(1), "dev7": GpuShare(7)}
out = {"resolve": {k: resolve_peer_device(s) for k, s in shares.items()},
       "map_before": {k: mapping_device(s) for k, s in shares.items()},
       "contexts_before": cuda_contexts()[0]}
buf = DeviceBuffer(4096, 1)  # this process now uses its ordinal 1
out["map_after"] = {k: mapping_device(s) for k, s in shares.items()}
out["contexts_after"] = cuda_contexts()[0]
out["codes"] = [lib.FMC_MAP_NOT_VISIBLE, lib.FMC_MAP_NO_CONTEXT]
buf.close()
print(json.dumps(out))
"""


def test_device_choice_by_uuid_ordinal_and_contexts_held(fake_driver, tmp_path):
    """The choice itself, in a process that sees U1 and U0 (in that order): UUIDs resolve to
    this process's ordinals whatever the peer's ordinal; a peer without UUIDs is taken at its
    ordinal if that exists here; nothing is mapped before the process uses a GPU; then the
    peer's GPU where it is the one used, else the one used."""
    import json
    import sys

    fake = _Fake(fake_driver, tmp_path, "choice", [U1, U0])
    env = dict(os.environ, **fake.env)
    proc = subprocess.run([sys.executable, "-c", _CHOICE_SCRIPT % {"u0": U0, "u1": U1, "u2": U2}],
                          env=env, capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    not_visible, no_context = out["codes"]
    assert out["resolve"] == {"u0": 1, "u1": 0, "u2": -1, "dev1": 1, "dev7": -1}
    assert out["contexts_before"] == []
    assert out["map_before"] == {"u0": no_context, "u1": no_context, "u2": not_visible, "dev1": no_context,
                                 "dev7": not_visible}
    assert out["contexts_after"] == [1]
    assert out["map_after"] == {"u0": 1, "u1": 1, "u2": not_visible, "dev1": 1, "dev7": not_visible}
    assert fake.events("retain") == [U0]  # ordinal 1 here is U0


class _FakePeer:
    """A CorePeer stand-in that reports a fixed reason for every GPU region."""

    same_host = True

    def __init__(self, reason: str) -> None:
        self.reason, self.gpu_calls = reason, 0

    def set_regions(self, regions) -> None:
        pass

    def set_region_slots(self, slots) -> None:
        pass

    def set_region_gpu(self, addr: int, share: GpuShare) -> str:
        self.gpu_calls += 1
        return self.reason


def test_fallback_reason_logged_once_per_peer(caplog):
    """Many GPU regions on an invisible GPU, refreshed again and again: one warning."""
    from flagcx_mc.engine.sessions import _set_regions
    from flagcx_mc.metadata.descriptor import NativeInfo, SegmentDesc

    share = GpuShare(0, _text(U2), ipc="00" * 64, base=4096)
    regions = tuple(RegionDesc(addr=4096 * (i + 1), length=4096, key=i, slot=i, cuda=share) for i in range(8))
    native = NativeInfo(version=1, data_port=1, regions=regions, boot_id="x", pid=1)
    desc = SegmentDesc(name="peer", protocol="tcp", native=native)
    peer, logged = _FakePeer(f"the peer's GPU {share.uuid} is not visible in this process"), set()
    with caplog.at_level(logging.WARNING, logger="flagcx_mc"):
        for _ in range(3):
            _set_regions(peer, desc, logged)
    assert peer.gpu_calls == 24
    warnings = [r for r in caplog.records if "staging" in r.getMessage()]
    assert len(warnings) == 1 and share.uuid in warnings[0].getMessage()
