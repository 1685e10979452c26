"""The AddressSanitizer + LeakSanitizer run of the C core (tests/asan/run_asan.sh) as a test.

Runs in CI (``CI=true``) or with ``FLAGCX_MC_RUN_ASAN=1``, skipped otherwise: it rebuilds the core with
the sanitizer in a temporary directory and runs tests/test_core.py, tests/test_transfers.py,
tests/test_argpack.py and tests/test_linger.py against that build (about 15-60 s).  The same check
by hand: ``tests/asan/run_asan.sh`` from the repository root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run_asan.sh")
ROOT = SCRIPT.parents[2]


@pytest.mark.skipif(os.environ.get("FLAGCX_MC_RUN_ASAN") != "1" and os.environ.get("CI") != "true",
                    reason="set FLAGCX_MC_RUN_ASAN=1 to build the core with AddressSanitizer and check it for leaks "
                           "(CI runs it)")
def test_core_has_no_leak_or_memory_error_under_the_sanitizer():
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=110)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "0 memory errors, 0 leaks in the core" in proc.stdout, report
