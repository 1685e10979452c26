"""How a synchronous read spreads over a small host's CPUs.

A read over several streams is received by the streams' receive sides, on the I/O pool, and by
its caller, which would only wait: on a host with fewer CPUs than streams the caller takes as
many shares as leave one stream per other CPU (``caller_read_shares`` in
``fmc_tcp_transport.c``).  The child here is pinned to two CPUs and reads from a target in
another process over real sockets; the share of the reading process's CPU time that its calling
thread spends (``time.thread_time`` against ``time.process_time``) says who received the bytes
(the reader's registration collapses no huge pages, whose thread would count too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flagcx_mc._testing.node import NodeProcess

SIZE = 64 << 20

READER = r'''
import json, os, sys, time
from flagcx_mc import HostBuffer, TransferEngine
session, raddr, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = TransferEngine(transport="tcp", streams_per_peer=4, prefault="off")  # no huge-page thread beside it
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = HostBuffer(size)
assert eng.register_memory(buf.addr, size) == 0
out = {}
for name, block, total, calls in (("one_run", 64 << 10, 4 << 20, 100), ("many_runs", 1 << 20, size, 10)):
    n = total // block
    args = ([buf.addr + i * block for i in range(n)], [raddr + i * block for i in range(n)], [block] * n)
    for _ in range(5):
        assert eng.batch_transfer_sync_read(session, *args) == 0
    thread0, process0 = time.thread_time(), time.process_time()
    for _ in range(calls):
        assert eng.batch_transfer_sync_read(session, *args) == 0
    out[name] = (time.thread_time() - thread0) / (time.process_time() - process0)
out["digest"] = buf.digest(0, size)
eng.close()
print(json.dumps(out), flush=True)
os._exit(0)  # skip the interpreter's teardown: under tests/asan, CPython's own leaks set the exit code
'''


@pytest.mark.timeout(120)
def test_a_small_hosts_reader_receives_all_but_one_share_of_a_call_of_one_run_per_stream():
    """Pinned to 2 CPUs, the caller of a 4 MiB read of 64 KiB blocks over 4 streams receives 3 of
    the 4 shares itself (its thread spends most of the process's CPU), while a 64 MiB read, whose
    streams carry several runs each, stays with the receive sides (it would hold the target's
    senders of the other streams up while the caller reads one whole share after another).  The
    bytes read are verified."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    target = NodeProcess(regions=[SIZE], config={"transport": "tcp"})
    try:
        digest = target.call("fill", region=0)["digest"]
        proc = subprocess.run(
            ["taskset", "-c", f"{cpus[0]},{cpus[1]}", sys.executable, "-c", READER, target.session,
             str(target.addr(0)), str(SIZE)],
            capture_output=True, text=True, timeout=90, cwd=_package_parent())
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout)
        assert out["digest"] == digest
        assert out["one_run"] > 0.55, out
        assert out["many_runs"] < 0.5, out
    finally:
        target.close()


def _package_parent() -> str:
    """The directory that holds the flagcx_mc the tests import, so the child imports it too."""
    import flagcx_mc

    return os.path.dirname(os.path.dirname(os.path.abspath(flagcx_mc.__file__)))
