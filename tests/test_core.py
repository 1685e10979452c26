"""The compiled core: it loads, its version and codes match the Python side, its registry rules hold."""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from pathlib import Path

import pytest

import flagcx_mc
from flagcx_mc import HostBuffer, errors
from flagcx_mc._core import CoreEngine, CorePeer, core_version
from flagcx_mc._fmc_cffi import lib  # type: ignore[import-not-found]

CDEFS = Path(__file__).resolve().parents[1] / "_cffi_build" / "core_cdefs.h"


def test_version_baked_into_core_matches_package():
    assert core_version() == flagcx_mc.__version__


def test_every_core_code_maps_to_its_exception():
    codes = {name: int(value) for name, value in re.findall(r"(FMC_ERR_\w+)\s*=\s*(-\d+)", CDEFS.read_text())}
    assert codes, "no error codes found in core_cdefs.h"
    for name, code in codes.items():
        assert getattr(lib, name) == code
        exc = errors.error_for_code(code)
        assert exc.code == code and type(exc) is not errors.UnknownCoreError, name
    assert isinstance(errors.error_for_code(-9999), errors.UnknownCoreError)
    with pytest.raises(errors.AddressOverlappedError):
        errors.check_rc(-7)
    assert errors.check_rc(5) == 5



def test_device_buffers_check_their_arguments_and_explain_a_missing_driver():
    """GPU allocation lives in the core: shapes it cannot map are refused before any driver call,
    and without a driver every call says so (NotSupportedError through DeviceBuffer)."""
    from flagcx_mc._fmc_cffi import ffi  # type: ignore[import-not-found]
    from flagcx_mc.buffers import DeviceBuffer, cuda_device_count

    ptr = ffi.new("uint64_t *")
    bad = lib.FMC_ERR_INVALID_ARGUMENT
    assert lib.fmc_cuda_device_count(ffi.NULL) == bad
    assert lib.fmc_cuda_buffer_alloc(0, 0, ptr) == bad
    assert lib.fmc_cuda_buffer_alloc(0, 4096, ffi.NULL) == bad
    assert lib.fmc_cuda_buffer_alloc_vmm(0, 3 << 20, 3 << 20, 1, ptr) == bad  # chunk not a multiple of 2 MiB
    assert lib.fmc_cuda_buffer_alloc_vmm(0, 6 << 20, 4 << 20, 1, ptr) == bad  # not whole chunks
    assert lib.fmc_cuda_buffer_free_vmm(0, 1 << 30, 4 << 20, 0) == bad
    assert lib.fmc_cuda_buffer_copy(0, 0, 4096, 4096) == bad
    count, why = cuda_device_count()
    if count == 0:
        assert why
        with pytest.raises(errors.FlagcxMcError):
            DeviceBuffer(4096)
    else:
        assert lib.fmc_cuda_buffer_alloc(count, 4096, ptr) == lib.FMC_ERR_DEVICE_NOT_FOUND
        buf = DeviceBuffer(1 << 20)
        try:
            digest = buf.fill_random()
            assert buf.digest() == digest
        finally:
            buf.close()

@pytest.fixture
def core():
    eng = CoreEngine("127.0.0.1")
    yield eng
    eng.close()


def test_registry_rules(core):
    buf = HostBuffer(1 << 20)
    try:
        key = core.register(buf.addr, 1 << 19)
        assert 0 < key < 2**32
        key2 = core.register(buf.addr + (1 << 19), 1 << 19)  # adjacent is fine
        assert key2 != key or True  # noqa: SIM222
        with pytest.raises(errors.AddressOverlappedError):
            core.register(buf.addr + 4096, 4096)
        with pytest.raises(errors.InvalidArgumentError):
            core.register(buf.addr, 0)
        with pytest.raises(errors.InvalidArgumentError):
            core.register((1 << 64) - 4096, 8192)  # wraps around
        with pytest.raises(errors.InvalidArgumentError):
            core.register(0x1000, 4096)  # nothing mapped there
        assert [(a, n) for a, n, _ in core.region_table()] == [(buf.addr, 1 << 19), (buf.addr + (1 << 19), 1 << 19)]
        with pytest.raises(errors.AddressNotRegisteredError):
            core.unregister(buf.addr + 1)
        core.unregister(buf.addr)
        core.unregister(buf.addr + (1 << 19))
        assert core.region_table() == []
    finally:
        buf.close()


def test_make_desc_finds_the_region_and_key(core):
    peer = CorePeer(core, "127.0.0.1", core.data_port, 1, 0)
    peer.set_regions([(0x20000, 0x1000, 7), (0x10000, 0x1000, 5)])
    assert peer.find_region(0x10000, 0x1000) == (0x10000, 5)
    assert peer.find_region(0x20800, 0x10) == (0x20000, 7)
    for addr, length in [(0x10fff, 2), (0x0ffff, 1), (0x11000, 1), (0x10000, 0), ((1 << 64) - 1, 2)]:
        with pytest.raises(errors.AddressNotRegisteredError):
            peer.find_region(addr, length)


def test_gpu_chunks_that_do_not_cover_the_region_are_refused_by_the_core(core):
    """The core checks a peer's VMM chunks itself (the descriptor parser does too): chunks that
    leave part of the region unmapped, or a region we do not know, are refused; what covers it is
    accepted (here, off the same-host path, only remembered as GPU memory)."""
    from flagcx_mc.metadata.descriptor import GpuShare

    peer = CorePeer(core, "127.0.0.1", core.data_port, 1, 0)
    peer.set_regions([(0x7E00_0010_0000, 40 << 20, 9)])
    chunk = 20 << 20
    short = GpuShare(0, vmm=((0x7E00_0000_0000, chunk, 3), (0x7E00_0000_0000 + chunk, chunk, 4)))
    late = GpuShare(0, vmm=((0x7E00_0020_0000, 3 * chunk, 3),))
    for bad in (short, late):
        with pytest.raises(errors.InvalidArgumentError):
            peer.set_region_gpu(0x7E00_0010_0000, bad)
    with pytest.raises(errors.AddressNotRegisteredError):
        peer.set_region_gpu(0x7D00_0000_0000, GpuShare(0, vmm=((0x7D00_0000_0000, chunk, 3),)))
    covering = GpuShare(0, vmm=tuple((0x7E00_0000_0000 + i * chunk, chunk, 3 + i) for i in range(3)))
    peer.set_region_gpu(0x7E00_0010_0000, covering)
    peer.set_region_gpu(0x7E00_0010_0000, GpuShare(0))


def _raw_data_conn(core, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", core.data_port), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks: list = []
        while True:
            data = s.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def test_data_port_refuses_hostile_requests(core):
    buf = HostBuffer(2 * 4096)
    try:
        buf.fill(0x5A)
        key = core.register(buf.addr + 4096, 4096)
        hello = b"FMCNATV1" + struct.pack("<II", 1, 0)

        def req(op, key, addr, length, ident=1):
            return struct.pack("<BBHIQQQ", op, 0, 0, key, ident, addr, length)

        # Wrong magic: read as a Mooncake header, a truncated one; nothing is answered.
        assert _raw_data_conn(core, b"GARBAGE!" + bytes(8)) == b""
        # With Mooncake's framing turned off: garbage is dropped, a Mooncake v2 write is rejected.
        core.accept_mooncake_wire(False)
        assert _raw_data_conn(core, b"GARBAGE!" + bytes(8)) == b""
        mooncake_write = struct.pack("<QQB7x", 4, buf.addr + 4096, 0x81) + b"evil"
        assert _raw_data_conn(core, mooncake_write) == struct.pack("<Q", 0x4D43545600000001)
        assert buf.read(4096, 4) == b"\x5a" * 4
        core.accept_mooncake_wire(True)
        cases = [
            req(1, key ^ 1, buf.addr + 4096, 16) + b"x" * 16,          # wrong key
            req(1, key, buf.addr, 16) + b"x" * 16,                     # outside (guard page)
            req(1, key, buf.addr + 8192 - 8, 16) + b"x" * 16,          # straddles the end
            req(1, key, (1 << 64) - 8, 16) + b"x" * 16,                # wraps around 2**64
            req(2, key, buf.addr, 16),                                 # read outside
        ]
        for payload in cases:
            answer = _raw_data_conn(core, hello + payload)
            assert answer[:16] == b"FMCNATOK" + struct.pack("<iI", 0, 4)  # caps: fences (fmc_wire.h)
            ident, status, _, length = struct.unpack("<QiIQ", answer[16:40])
            assert (ident, status, length) == (1, -106, 0)
        # Oversized and truncated requests: the connection is dropped, nothing answered.
        assert _raw_data_conn(core, hello + req(1, key, buf.addr + 4096, 1 << 40))[16:] == b""
        assert _raw_data_conn(core, hello + req(1, key, buf.addr + 4096, 64)[:20])[16:] == b""
        assert _raw_data_conn(core, hello + req(9, key, buf.addr + 4096, 8))[16:] == b""
        assert buf.read(0, 8192) == b"\x5a" * 8192  # not one byte changed
        # A good write on a fresh connection still works afterwards.
        answer = _raw_data_conn(core, hello + req(1, key, buf.addr + 4096, 4) + b"good")
        assert struct.unpack("<QiIQ", answer[16:40])[1] == 0
        assert buf.read(4096, 4) == b"good"
        stats = core.stats()
        assert stats["requests_refused"] >= 5 and stats["protocol_errors"] >= 3  # magic, oversized, opcode
        deadline = time.monotonic() + 5
        while core.stats()["server_connections"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert core.stats()["server_connections"] == 0
        assert any("refused" in line for line in core.drain_log())
    finally:
        buf.close()


def test_a_fence_answers_only_once_the_named_connection_has_let_go(core):
    """The target side of a reconnect (fmc_wire.h's fences): connection A, named by a token, is
    inside a write whose payload has not all come; connection B fences that token.  B's answer
    comes only once A's thread has left it: A is shut down (its half-sent write never answered)
    and what A delivered before is all that landed.  A fence naming nobody is answered at once."""
    buf = HostBuffer(64 * 1024)
    try:
        buf.fill(0x00)
        key = core.register(buf.addr, buf.size)
        hello = b"FMCNATV1" + struct.pack("<II", 1, 0)
        ok = b"FMCNATOK" + struct.pack("<iI", 0, 4)
        token = 0x5EED_0000_0000_0001

        def control(op, value):
            return struct.pack("<BBHIQQQ", op, 0, 0, 0, 0, value, 0)

        a = socket.create_connection(("127.0.0.1", core.data_port), timeout=5)
        a.sendall(hello + control(6, token) + struct.pack("<BBHIQQQ", 1, 0, 0, key, 1, buf.addr, buf.size)
                  + b"\xab" * 1000)  # the rest of the payload never comes
        assert a.recv(16) == ok
        deadline = time.monotonic() + 5
        while buf.read(0, 1000) != b"\xab" * 1000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert buf.read(0, 1000) == b"\xab" * 1000
        with socket.create_connection(("127.0.0.1", core.data_port), timeout=5) as b:
            b.sendall(hello + control(6, token + 1) + control(7, token))
            answer = b.recv(16)
            assert answer == ok
            assert struct.unpack("<QiIQ", b.recv(24)) == (0, 0, 0, 0)
            a.settimeout(2)
            assert a.recv(64) == b""  # A was shut down before B was answered, its write unanswered
            b.sendall(control(7, 0xDEAD))  # nobody has that name
            assert struct.unpack("<QiIQ", b.recv(24)) == (0, 0, 0, 0)
        a.close()
        assert buf.read(1000, buf.size - 1000) == bytes(buf.size - 1000)
    finally:
        buf.close()


def test_the_core_reads_no_environment():
    """Every setting reaches the C core from flagcx_mc.config (EngineConfig per engine,
    ProcessSettings per process), so no C source may read the environment itself."""
    import re
    from pathlib import Path

    build = Path(__file__).resolve().parents[1] / "_cffi_build"
    readers = [f"{p.relative_to(build)}:{n}" for p in sorted(build.rglob("*.[ch]"))
               for n, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"\b(secure_)?getenv\s*\(", line)]
    assert readers == []


def test_the_cuda_driver_is_chosen_before_it_is_loaded():
    from flagcx_mc._core import ffi, lib
    from flagcx_mc.buffers import cuda_device_count

    cuda_device_count()  # loads (or tries) the driver the process was given
    current = os.environ.get("FLAGCX_MC_LIBCUDA", "").encode()
    assert lib.fmc_cuda_set_library(current) == 0  # the same one: nothing changes
    assert lib.fmc_cuda_set_library(b"/elsewhere/libcuda.so.1") < 0
    assert b"already loaded" in ffi.string(lib.fmc_last_error())
