"""Registering memory commits none of it: a pool nobody touched costs milliseconds and no
resident memory to register (Mooncake registers a 100 GiB pool in no time), a shared file
mapping is not dirtied and a private one not copied.  Bytes written into it later land."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._core import CoreEngine
from flagcx_mc.config import EngineConfig

MiB = 1 << 20
GiB = 1 << 30


def _vm_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _mapped_kib(addr: int, length: int) -> int:
    """KiB of the range whose pages have a page table entry (mincore).  Unlike Rss this counts
    a page the kernel has since remapped to the shared zero page (6.12+ splits zero-filled
    huge pages under memory pressure), so it says whether the range was faulted in at all."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    vec = ctypes.create_string_buffer(-(-length // page))
    if libc.mincore(addr, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw) * page // 1024


def _mapping_kib(addr: int) -> dict:
    """Rss, Anonymous and the dirty counters (KiB) of every mapping that holds part of the
    region starting at ``addr`` (madvise may split one mapping into several)."""
    totals = {"Rss": 0, "Anonymous": 0, "AnonHugePages": 0, "Shared_Dirty": 0, "Private_Dirty": 0}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
                continue
            key = line.split(":", 1)[0]
            if inside and key in totals:
                totals[key] += int(line.split()[1])
    return totals


class _Mapping:
    """1 GiB nobody has touched: anonymous, a shared file mapping or a private one."""

    def __init__(self, kind: str, size: int, tmp_path) -> None:
        self.kind, self.size, self.file = kind, size, None
        if kind == "anonymous":
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self.path = tmp_path / "pool"
            self.file = open(self.path, "w+b")
            self.file.truncate(size)  # sparse: no block allocated
            flags = mmap.MAP_SHARED if kind == "shared file" else mmap.MAP_PRIVATE
            self.map = mmap.mmap(self.file.fileno(), size, flags=flags)
        self.view = (ctypes.c_char * size).from_buffer(self.map)
        self.addr = ctypes.addressof(self.view)

    def close(self) -> None:
        del self.view
        self.map.close()
        if self.file is not None:
            self.file.close()


@pytest.fixture(params=["anonymous", "shared file", "private file"])
def untouched(request, tmp_path):
    m = _Mapping(request.param, GiB, tmp_path)
    yield m
    m.close()


@pytest.mark.timeout(120)
def test_registering_untouched_memory_commits_none_of_it(untouched):
    target, initiator = TransferEngine(transfer_timeout=20.0), TransferEngine(transfer_timeout=20.0)
    try:
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        rss0 = _vm_rss_kib()
        t0 = time.monotonic()
        assert target.register_memory(untouched.addr, untouched.size) == 0
        seconds = time.monotonic() - t0
        time.sleep(0.5)  # the background huge-page thread runs meanwhile: it must commit nothing either
        grew_mib = (_vm_rss_kib() - rss0) / 1024
        mapping = _mapping_kib(untouched.addr)
        assert seconds < 0.5, f"registering 1 GiB of {untouched.kind} memory took {seconds:.2f} s"
        assert grew_mib < 64, f"registering 1 GiB of {untouched.kind} memory grew RSS by {grew_mib:.0f} MiB"
        assert mapping["Rss"] < 64 * 1024 and mapping["Anonymous"] == 0, mapping  # nothing copied either
        assert mapping["Shared_Dirty"] == 0 and mapping["Private_Dirty"] == 0, mapping
        if untouched.kind != "anonymous":
            assert os.stat(untouched.path).st_blocks == 0  # no page of the file written back or allocated

        # Then bytes land where a peer writes them, and read back what is there.
        with HostBuffer(4 * MiB) as buf:
            assert initiator.register_memory(buf.addr, buf.size) == 0
            payload = os.urandom(MiB)
            buf.write(0, payload)
            where = untouched.addr + 512 * MiB + 12345
            assert initiator.transfer_sync_write(target.session_name, buf.addr, where, MiB) == 0
            assert ctypes.string_at(where, MiB) == payload
            assert initiator.transfer_sync_read(target.session_name, buf.addr + MiB, untouched.addr, 2 * MiB) == 0
            assert buf.read(MiB, 2 * MiB) == bytes(2 * MiB)
            if untouched.kind == "shared file":
                assert os.pread(untouched.file.fileno(), MiB, 512 * MiB + 12345) == payload
            assert initiator.unregister_memory(buf.addr) == 0
        assert target.unregister_memory(untouched.addr) == 0
    finally:
        initiator.close()
        target.close()


@pytest.mark.timeout(60)
def test_huge_pages_only_for_chunks_touched_whole():
    """The background collapse turns wholly touched 2 MiB chunks into huge pages and leaves chunks
    with untouched pages alone (collapsing one would fill it: 2 MiB for one 4 KiB page touched)."""
    core = CoreEngine("127.0.0.1")
    try:
        with HostBuffer(80 * MiB, populate=False) as buf:
            base = (buf.addr + 2 * MiB - 1) & ~(2 * MiB - 1)
            ctypes.memset(base, 7, 16 * MiB)  # 8 whole chunks
            for chunk in range(8, 38):  # then one page in each of 30 chunks
                ctypes.memset(base + chunk * 2 * MiB, 7, 4096)
            core.register(buf.addr, buf.size)
            deadline = time.monotonic() + 10
            while _mapping_kib(buf.addr).get("AnonHugePages", 0) < 16 * 1024 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            # 16 MiB touched whole and 30 pages: had the partial chunks been collapsed, 76 MiB.
            assert _mapping_kib(buf.addr)["Rss"] < 40 * 1024
            assert ctypes.string_at(base + 37 * 2 * MiB, 4096) == b"\x07" * 4096
            core.unregister(buf.addr)
    finally:
        core.close()


@pytest.mark.timeout(60)
def test_prefault_all_still_faults_the_region_in(monkeypatch):
    """prefault="all" (FLAGCX_MC_PREFAULT=all) keeps the eager populate, for callers that want
    first-touch costs paid at registration."""
    monkeypatch.setenv("FLAGCX_MC_PREFAULT", "all")
    core = CoreEngine("127.0.0.1")
    try:
        with HostBuffer(64 * MiB, populate=False) as buf:
            assert _mapped_kib(buf.addr, buf.size) == 0
            core.register(buf.addr, buf.size)
            assert _mapped_kib(buf.addr, buf.size) >= 60 * 1024
            core.unregister(buf.addr)
    finally:
        core.close()


def test_prefault_modes_from_keywords_and_environment(monkeypatch):
    assert EngineConfig.from_env().prefault == "touched"
    for value, mode in [("1", "touched"), ("0", "off"), ("off", "off"), ("touched", "touched"),
                        ("all", "all"), ("2", "all"), ("ALL", "all")]:
        monkeypatch.setenv("FLAGCX_MC_PREFAULT", value)
        assert EngineConfig.from_env().prefault == mode, value
    monkeypatch.delenv("FLAGCX_MC_PREFAULT")
    assert EngineConfig.from_env(prefault=True).prefault == "touched"
    assert EngineConfig.from_env(prefault=False).prefault == "off"
    assert EngineConfig.from_env(prefault="all").prefault == "all"
    from flagcx_mc import errors

    with pytest.raises(errors.InvalidArgumentError):
        EngineConfig.from_env(prefault="sometimes")
