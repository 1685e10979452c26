"""The GPU-over-TCP suite (test_gpu_tcp.py) on the CPU machine, against the fake CUDA driver
(tests/helpers/fake_libcuda.c) in its lazy mode: a copy runs only when someone waits for it (a
stream synchronise, an event synchronised behind it), as on a GPU that is very slow.  A staging
chunk sent, reused or returned before its gather was waited for, an answer or a completion
before a scatter landed, or a source read after a failed call returned all show up there as
wrong bytes.  The suite runs in a child pytest, since a process loads its driver once."""

from __future__ import annotations

import os
import subprocess
import sys

UUID = "00112233445566778899aabbccddeef0"


def test_gpu_tcp_suite_on_the_lazy_fake_driver(fake_driver):
    suite = os.path.join(os.path.dirname(__file__), "test_gpu_tcp.py")
    env = dict(os.environ, FLAGCX_MC_LIBCUDA=fake_driver, FAKE_CUDA_UUIDS=UUID, FAKE_CUDA_LAZY="1")
    if "ASAN_OPTIONS" in env:
        # Under tests/asan/run_asan.sh the child's sanitizer reports go to the harness's log, which
        # judges them (CPython's own leaks are not the core's): its exit code tells the tests only.
        env["ASAN_OPTIONS"] += ":exitcode=0"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", suite],
                          env=env, capture_output=True, text=True, timeout=600)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and "skipped" not in done.stdout and "failed" not in done.stdout, tail
