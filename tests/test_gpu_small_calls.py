"""A small synchronous call from or into GPU memory ends in the calling thread, which polls for it.

The caller polls (the engine's ``spin_us``, twice that where its side is GPU memory: staging adds
a copy at each end) counted from when its request is out, not from the call's start: a GPU
source is staged first, and a window counted from the start could end before the request even
left; the answer then woke a pool thread, which woke the caller (on the H100 host 4 KiB writes
took 45-64 us instead of 25, reads 56 instead of 37).  The check runs in a child process against
the fake CUDA driver (tests/helpers/fake_libcuda.c) made slow: every synchronise takes milliseconds,
against a ``spin_us`` of 2 ms.  Whether the caller slept shows in its voluntary
context switches; every block is checked byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.servers import PACKAGE_PARENT

UUID = "00112233445566778899aabbccddeef0"
CALLS = 40

CHILD = r"""
import hashlib, sys
from flagcx_mc import TransferEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.buffers import DeviceBuffer

calls, op, block = int(sys.argv[1]), sys.argv[2], 4096
size = calls * block
node = NodeProcess(regions=[size], config={"transport": "tcp", "spin_us": 2000})
eng = TransferEngine(transfer_timeout=10.0, transport="tcp", spin_us=2000)
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
gpu = DeviceBuffer(size, 0)
assert eng.register_memory(gpu.addr, size) == 0
remote = node.call("region_info", region=0)["addr"]
for _ in range(3):  # the session, its stream and the target's worker are set up
    assert eng.transfer_sync_write(node.session, gpu.addr, remote, block) == 0
if op == "write":
    gpu.fill_random(0, size)
else:
    node.call("fill", region=0, offset=0, length=size)
call = eng.transfer_sync_write if op == "write" else eng.transfer_sync_read


def voluntary_switches() -> int:
    with open("/proc/thread-self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


before = voluntary_switches()
for i in range(calls):
    assert call(node.session, gpu.addr + i * block, remote + i * block, block) == 0
slept = voluntary_switches() - before
landed = node.call("digest", region=0, offset=0, length=size)["digest"]
assert landed == hashlib.sha256(gpu.read(0, size)).hexdigest(), "the blocks did not land intact"
eng.close()
node.close()
gpu.close()
print(slept)
"""


# A write's staging (5 ms) outlasts even the doubled window (4 ms) counted from the call's
# start; a read's landing (3 ms) outlasts spin_us (2 ms) but not twice that.
@pytest.mark.parametrize("op,sync_us", [("write", 5000), ("read", 3000)])
def test_a_small_gpu_call_ends_in_its_polling_caller(fake_driver, op, sync_us):
    env = dict(os.environ, FLAGCX_MC_LIBCUDA=fake_driver, FAKE_CUDA_UUIDS=UUID, FAKE_CUDA_SYNC_SPIN_US=str(sync_us))
    done = subprocess.run([sys.executable, "-c", CHILD, str(CALLS), op], env=env, capture_output=True, text=True,
                          timeout=120, cwd=PACKAGE_PARENT)  # the installed flagcx_mc, as the tests import it
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    slept = int(done.stdout.split()[-1])
    # Polling, the caller sleeps only when a call takes longer than its window (a loaded
    # machine); with a window counted from the call's start or of spin_us alone, in every call.
    assert slept <= CALLS // 4, f"the caller slept {slept} times in {CALLS} calls"
