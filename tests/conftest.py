"""Shared fixtures; every async test runs on asyncio's default loop, and those marked ``uvloop`` on
uvloop too."""
from __future__ import annotations

import asyncio
import importlib.machinery
import os
import sys
import time
from pathlib import Path

import pytest
import uvloop

# `python -m pytest` puts the current directory first on sys.path; the `pytest` command does not.
# Run from a checkout, that entry makes `import flagcx_mc` find the source tree instead of the
# package pip installed, and a source tree has no compiled C core unless it was installed in place
# (`pip install -e .` builds it there).  So where this checkout's flagcx_mc/ has no compiled core,
# its directory is taken off sys.path before anything imports flagcx_mc, and both commands test
# the installed package.  Where the core is built in place (editable install) nothing changes.
# tests/test_pytest_entry_points.py runs `python -m pytest` in a copy without the core.
_CHECKOUT = Path(__file__).resolve().parents[1]


def _has_compiled_core(package_dir: Path) -> bool:
    return any((package_dir / f"_fmc_cffi{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


if not _has_compiled_core(_CHECKOUT / "flagcx_mc"):
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT]

# Engines in these tests use the TCP data plane unless a test asks for the same-host path (see
# test_same_host.py); child processes inherit it.  Without this, every peer on this machine would
# be reached with process_vm_writev and the network code would go untested.
os.environ.setdefault("FLAGCX_MC_TRANSPORT", "tcp")

from support.clibs import build_helper_library  # noqa: E402

from flagcx_mc import AsyncTransferEngine, HostBuffer  # noqa: E402  (after the sys.path check)
from flagcx_mc._testing.node import NodeProcess  # noqa: E402

# Fixtures of tests/support/: servers.py starts redis-server and etcd, netns.py builds hosts in network
# namespaces.  Importable as `support.*` because pytest puts tests/ on sys.path (see `pythonpath` in
# pyproject.toml).
pytest_plugins = ["support.servers", "support.netns"]


def pytest_asyncio_loop_factories(config, item):
    """Which event loops an async test runs on: asyncio's default loop always; uvloop as well for
    tests marked ``uvloop`` (``pytestmark = pytest.mark.uvloop`` in a module, or on one test).

    The engine's code depends on the loop only where the loop does the networking and the timing:
    streams and servers, connection set-up and loss, cancellation and timeouts.  The tests marked
    are the ones that drive exactly that: the handshake server and client (test_handshake_server,
    test_auth), the control plane (test_control_plane), sessions and transfers (test_transfers),
    timeouts and stuck handshakes (test_timeouts), the KV side channel (test_side_channel), and
    the HTTP metadata client and server's round trip, pipelining, idle connections, timeouts and
    refusals (five tests of test_metastore).  The other async tests (metadata modes end to end,
    same-host copies, vectors, registration, metrics) would repeat the same loop calls on uvloop.
    The sync facade (TransferEngine) runs its own uvloop loop in a thread, so every sync-engine
    test (test_sync_engine, test_faults, test_multihost, ...) exercises uvloop as well.
    """
    if item.get_closest_marker("uvloop") is not None:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


# Remote regions every shared node offers: [0] 80 MiB for big transfers, [1] 1 MiB scratch.
NODE_REGIONS = [80 << 20, 1 << 20]


@pytest.fixture(scope="module")
def node():
    """A target engine in its own process, shared by the tests of one module."""
    proc = NodeProcess(regions=NODE_REGIONS, config={"transfer_timeout": 10.0})
    yield proc
    proc.close()


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> str:
    """tests/helpers/fake_libcuda.c built as a shared library: a CUDA driver without a GPU,
    loaded by the core through FLAGCX_MC_LIBCUDA."""
    return build_helper_library(tmp_path_factory, "fake_libcuda.c", "-lpthread")


@pytest.fixture
def local_buf():
    buf = HostBuffer(80 << 20)
    yield buf
    buf.close()


@pytest.fixture
async def engine(local_buf):
    """An initialized async engine with ``local_buf`` registered."""
    async with AsyncTransferEngine(transfer_timeout=10.0) as eng:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(local_buf.addr, local_buf.size)
        yield eng


def _live_children() -> list:
    """Processes whose parent is this test process (zombies included: they were not reaped)."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.append(int(entry))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    yield
    deadline = time.monotonic() + 10
    while _live_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_children() == [], "tests left child processes running"
