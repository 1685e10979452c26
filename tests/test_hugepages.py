"""Registered host memory ends up in huge pages (fmc_hugepages.c), contents kept, and the
background collapsing never holds up unregistering or closing."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time

import pytest

from flagcx_mc import HostBuffer
from flagcx_mc._core import CoreEngine

MiB = 1 << 20


def _thp_collapse_works() -> str:
    """Why this machine cannot collapse anonymous memory into huge pages ('' when it can)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return "no transparent huge pages"
    if "[never]" in mode:
        return "transparent huge pages are off"
    libc = ctypes.CDLL(None, use_errno=True)
    probe = mmap.mmap(-1, 4 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = (ctypes.c_char * (4 * MiB)).from_buffer(probe)
        start = (ctypes.addressof(view) + 2 * MiB - 1) & ~(2 * MiB - 1)
        ctypes.memset(ctypes.addressof(view), 1, 4 * MiB)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(2 * MiB), 14)  # MADV_HUGEPAGE
        rc = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(2 * MiB), 25)  # MADV_COLLAPSE
        del view
        return "" if rc == 0 else f"MADV_COLLAPSE refused here (errno {ctypes.get_errno()})"
    finally:
        probe.close()


_WHY = _thp_collapse_works()


def _huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds ``addr``, in KiB."""
    inside = False
    with open(f"/proc/{os.getpid()}/smaps") as smaps:
        for line in smaps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _wait_for_huge(addr: int, want_kib: int, seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    kib = _huge_kib(addr)
    while kib < want_kib and time.monotonic() < deadline:
        time.sleep(0.05)
        kib = _huge_kib(addr)
    return kib


@pytest.fixture
def core():
    c = CoreEngine("127.0.0.1")
    yield c
    c.close()


@pytest.mark.skipif(bool(_WHY), reason=_WHY or "")
@pytest.mark.timeout(60)
def test_memory_touched_before_registration_is_collapsed_with_its_contents(core):
    with HostBuffer(64 * MiB) as buf:  # populated: 4 KiB pages, as a framework leaves a KV cache
        digest = buf.fill_random()
        assert _huge_kib(buf.addr) == 0
        core.register(buf.addr, buf.size)
        # All whole 2 MiB pages inside the buffer (the mapping need not start on one).
        assert _wait_for_huge(buf.addr, 62 * 1024) >= 62 * 1024
        assert buf.digest() == digest
        core.unregister(buf.addr)


@pytest.mark.skipif(bool(_WHY), reason=_WHY or "")
@pytest.mark.timeout(60)
def test_memory_that_cannot_be_collapsed_does_not_stop_the_rest(core, tmp_path):
    """A file mapping (the kernel refuses to collapse it) registered first: anonymous memory
    registered after it is still collapsed."""
    path = tmp_path / "region"
    path.write_bytes(b"\x5a" * (8 * MiB))
    with open(path, "r+b") as f, HostBuffer(16 * MiB) as buf:
        shared = mmap.mmap(f.fileno(), 8 * MiB, flags=mmap.MAP_SHARED)
        view = (ctypes.c_char * (8 * MiB)).from_buffer(shared)
        try:
            core.register(ctypes.addressof(view), 8 * MiB)
            digest = buf.fill_random()
            core.register(buf.addr, buf.size)
            assert _wait_for_huge(buf.addr, 14 * 1024) >= 14 * 1024
            assert buf.digest() == digest and bytes(shared[:4]) == b"\x5a" * 4
            core.unregister(buf.addr)
            core.unregister(ctypes.addressof(view))
        finally:
            del view
            shared.close()


@pytest.mark.skipif(bool(_WHY), reason=_WHY or "")
@pytest.mark.timeout(60)
def test_prefault_off_leaves_the_pages_alone(monkeypatch):
    monkeypatch.setenv("FLAGCX_MC_PREFAULT", "0")  # read when the engine is made
    core = CoreEngine("127.0.0.1")
    try:
        with HostBuffer(16 * MiB) as buf:
            core.register(buf.addr, buf.size)
            time.sleep(0.5)
            assert _huge_kib(buf.addr) == 0
            core.unregister(buf.addr)
    finally:
        core.close()


@pytest.mark.timeout(60)
def test_unregister_and_close_do_not_wait_for_a_long_collapse():
    """Registering 1 GiB queues a long background job; unregistering it at once returns within a
    chunk's time, the memory can then be unmapped, and closing the engine ends the thread."""
    core = CoreEngine("127.0.0.1")
    try:
        with HostBuffer(1024 * MiB) as big, HostBuffer(256 * MiB) as other:
            digest = other.fill_random()
            core.register(big.addr, big.size)
            core.register(other.addr, other.size)  # queued behind it
            time.sleep(0.05)
            t0 = time.monotonic()
            core.unregister(big.addr)
            assert time.monotonic() - t0 < 1.0
            core.unregister(other.addr)
            assert other.digest() == digest
        # Both are unmapped now; a job still queued for them finds them unregistered and stops.
        t0 = time.monotonic()
    finally:
        core.close()
    assert time.monotonic() - t0 < 5.0
