"""A remote-controlled engine process for the test suite and the demo: the far end of a transfer.

``python -m flagcx_mc._testing.node`` serves :class:`flagcx_mc._process.EngineServer`'s JSON-lines
commands plus the tests' own: regions of host or GPU memory between guard bytes (added,
registered and unregistered on request), transfers started by the node itself, and the engine's
counters.  ``NodeProcess`` is the parent's side.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from .._process import (
    GUARD_BYTES,
    GUARD_VALUE,
    EngineProcess,
    EngineProcessError,
    EngineServer,
    GuardedRegion,
)
from ..buffers import DeviceBuffer, HostBuffer

__all__ = ["GUARD_BYTES", "GUARD_VALUE", "NodeError", "NodeProcess"]

NodeError = EngineProcessError


class _Node(EngineServer):
    """Command handlers of the child process."""

    COMMANDS = EngineServer.COMMANDS | {"init", "add_region", "region_info", "unregister", "register", "count_byte",
                                        "transfer", "stats", "first_buffer_address", "protect"}

    def init(self, host: str = "127.0.0.1", regions: Sequence[int] = (), config: dict | None = None,
             engine: str = "flagcx_mc", metadata_server: str = "P2PHANDSHAKE") -> dict:
        """Start the engine: ours, or (``engine="mooncake"``) Mooncake's own, for interop and baselines."""
        session = self.start_engine(host, engine, config, metadata_server)
        for size in regions:
            self.add_region(size)
        return {"session": session, "pid": os.getpid(), "regions": self.region_list()}

    def add_region(self, size: int, register: bool = True, device: int | None = None, vmm_chunk: int = 0,
                   shareable: bool = True) -> dict:
        """A region of host memory, or of GPU memory on ``device`` (VMM memory in chunks of
        ``vmm_chunk`` bytes if > 0, see DeviceBuffer), between guard bytes."""
        buf: Any = (HostBuffer(size + 2 * GUARD_BYTES) if device is None
                    else DeviceBuffer(size + 2 * GUARD_BYTES, device, vmm_chunk, shareable))
        index = self.add(GuardedRegion(buf, size), register)
        return {"index": index, "addr": self.regions[index].addr, "size": size}

    def region_info(self, region: int) -> dict:
        r = self.regions[region]
        return {"addr": r.addr, "size": r.size}

    def unregister(self, region: int) -> dict:
        return {"rc": self.engine.unregister_memory(self.regions[region].addr)}

    def register(self, region: int) -> dict:
        r = self.regions[region]
        return {"rc": self.engine.register_memory(r.addr, r.size)}

    def count_byte(self, region: int, byte: int) -> dict:
        """How many bytes of the region equal ``byte`` (to spot late writes of a known pattern)."""
        r = self.regions[region]
        return {"count": r.read(0, r.size).count(bytes([byte]))}

    def transfer(self, op: str, target: str, items: list[list[int]]) -> dict:
        """items: [region, offset, remote_addr, length] each."""
        local = [self.regions[i].addr + off for i, off, _, _ in items]
        remote = [ra for _, _, ra, _ in items]
        lens = [n for _, _, _, n in items]
        fn = self.engine.batch_transfer_sync_write if op == "write" else self.engine.batch_transfer_sync_read
        t0 = time.perf_counter()
        rc = fn(target, local, remote, lens)
        return {"rc": rc, "seconds": time.perf_counter() - t0}

    def stats(self) -> dict:
        return self.engine.stats()

    def protect(self, region: int, access: str = "rw") -> dict:
        """mprotect the whole pages of a registered region behind the engine's back: ``"rw"``,
        ``"r"`` (read-only) or ``""`` (no access), as an application may after registering it."""
        import ctypes
        import mmap

        r, page = self.regions[region], mmap.PAGESIZE
        start, end = -(-r.addr // page) * page, (r.addr + r.size) // page * page
        prot = (mmap.PROT_READ if "r" in access else 0) | (mmap.PROT_WRITE if "w" in access else 0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(start, end - start, prot) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        return {}

    def first_buffer_address(self, segment: str) -> dict:
        """What this engine's ``get_first_buffer_address`` says of another segment."""
        return {"addr": self.engine.get_first_buffer_address(segment)}


def _serve() -> None:
    if os.environ.get("FLAGCX_MC_NODE_NONDUMPABLE") == "1":
        # Tests use this to make the kernel refuse other processes access to this one's memory.
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    if os.environ.get("FLAGCX_MC_NODE_SIGPIPE_DEFAULT") == "1":
        # Tests use this to run as a C program would: SIGPIPE kills (Python itself ignores it).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _Node().serve()


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread is gone
        if state not in ("T", "t"):
            return False
    return True


class NodeProcess(EngineProcess):
    """Parent side of a node: start it, send commands, reap it."""

    def __init__(self, host: str = "127.0.0.1", regions: Sequence[int] = (), config: dict | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 30.0,
                 argv_prefix: list[str] | None = None, engine: str = "flagcx_mc",
                 metadata_server: str = "P2PHANDSHAKE") -> None:
        super().__init__("flagcx_mc._testing.node",
                         {"host": host, "regions": list(regions), "config": config, "engine": engine,
                          "metadata_server": metadata_server},
                         env=env, start_timeout=start_timeout, argv_prefix=argv_prefix)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP the node and return once every one of its threads has stopped: kill() only
        queues the signal, and a thread spinning on another core can serve a request first."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.pid):
            if time.monotonic() > deadline:
                raise NodeError(f"node {self.pid} did not stop within {timeout} s")
            time.sleep(0.0005)


if __name__ == "__main__":
    _serve()
