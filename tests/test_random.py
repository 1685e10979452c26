"""Region keys, authentication nonces and data ports come from the kernel's generator or not at
all: where getrandom fails, registration, the authenticated handshake and a port range fail
with the reason, instead of going on with predictable (rand(), the clock) or uninitialised bytes.

getrandom is made to fail with a seccomp filter, in a child process (a filter cannot be lifted)."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="the filter names x86-64's syscall number"
)

CHILD = textwrap.dedent(
    r"""
    import ctypes, errno, mmap, os, struct, sys
    from flagcx_mc import _core, errors

    # Engines made before the filter: the accept thread must not depend on it.
    target = _core.CoreEngine("127.0.0.1")
    initiator = _core.CoreEngine("127.0.0.1")
    for e in (target, initiator):
        e.set_secret(b"s" * 32)
    buf = mmap.mmap(-1, 1 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    key_before = target.register(addr, 1 << 16)  # works while getrandom does

    # seccomp: getrandom (318 on x86-64) fails with ENOSYS in every thread, as on a kernel or
    # sandbox without it.  SECCOMP_FILTER_FLAG_TSYNC covers the threads started above.
    def ins(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = (ins(0x20, 0, 0, 0) + ins(0x15, 0, 1, 318)
            + ins(0x06, 0, 0, 0x00050000 | errno.ENOSYS) + ins(0x06, 0, 0, 0x7FFF0000))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(prog)
    fprog = Fprog(len(prog) // 8, ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(317, 1, 1, ctypes.byref(fprog)) != 0:
        print("SKIP seccomp unavailable", ctypes.get_errno())
        sys.exit(0)

    results = {}
    try:
        target.register(addr + (1 << 17), 1 << 16)
        results["register"] = "ok"
    except errors.FlagcxMcError as exc:
        results["register"] = f"{exc.code} {exc}"
    try:
        _core.CoreEngine("127.0.0.1", 20000, 60000)
        results["port_range"] = "ok"
    except errors.FlagcxMcError as exc:
        results["port_range"] = f"{exc.code} {exc}"
    peer = _core.CorePeer(initiator, "127.0.0.1", target.data_port, 1, 0)
    try:
        peer.connect(2000)
        results["connect"] = "ok"
    except errors.FlagcxMcError as exc:
        results["connect"] = f"{exc.code} {exc}"
    peer.close()
    for e in (initiator, target):
        e.close()
    for name, value in results.items():
        print(f"{name}: {value}")
    sys.stdout.flush()
    os._exit(0)  # no exit-time leak check of the interpreter (under tests/asan) to fail the child
    """
)


def test_no_random_bytes_fails_hard(tmp_path):
    # Outside the checkout, so the installed package (with its compiled core) is imported.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    lines = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    for name in ("register", "port_range", "connect"):
        assert lines[name] != "ok", f"{name} went on without random bytes"
        assert lines[name].startswith("-303 "), lines[name]
        assert "random bytes" in lines[name], lines[name]
