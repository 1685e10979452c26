"""One benchmark process: an engine (flagcx_mc's or Mooncake's) driven by JSON lines.

``python -m flagcx_mc.tools.bench.worker`` serves :class:`flagcx_mc._process.EngineServer`'s
commands (fill, set, digest, guards, exit) over one region of ``size`` bytes between guard bytes,
in the memory the transport needs: private host memory, the engine's managed shared memory or
CUDA device memory.  As *initiator* it also runs timed loops of sync transfers and reports wall
time and its own CPU time, so that flagcx_mc and Mooncake initiators are measured alike, each in a
process of its own; as *target* it only holds its region.  ``WorkerProcess`` is the parent's side.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import resource
import threading
import time

from ..._process import GUARD_BYTES, EngineProcess, EngineServer, GuardedRegion
from .layouts import PAGED_LAYERS, block_plan

__all__ = ["MEMORY_KINDS", "WorkerProcess"]

# host: private anonymous memory (HostBuffer); managed: the engine's registered shared memory
# (allocate_managed_buffer); cuda: device memory on GPU 0 (DeviceBuffer).
MEMORY_KINDS = ("host", "managed", "cuda")


class _MappedRange:
    """Memory somebody else owns (a managed buffer), with HostBuffer's fill/digest/read surface."""

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self._array = (ctypes.c_char * size).from_address(addr)

    def fill_random(self, offset: int, length: int) -> str:
        chunk = 1 << 22
        for pos in range(offset, offset + length, chunk):
            n = min(chunk, offset + length - pos)
            ctypes.memmove(self.addr + pos, os.urandom(n), n)
        return self.digest(offset, length)

    def fill(self, byte: int, offset: int, length: int) -> None:
        ctypes.memset(self.addr + offset, byte, length)

    def digest(self, offset: int, length: int) -> str:
        return hashlib.sha256(memoryview(self._array).cast("B")[offset:offset + length]).hexdigest()

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)

    def close(self) -> None:
        pass


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _cpu_seconds() -> float:
    """User + system CPU seconds of this whole process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Worker(EngineServer):
    """Command handlers of the child process."""

    COMMANDS = EngineServer.COMMANDS | {"init", "run", "latency", "digest_blocks"}

    def __init__(self) -> None:
        super().__init__()
        self.managed: _MappedRange | None = None

    def init(self, engine: str = "flagcx_mc", host: str = "127.0.0.1", size: int = 1 << 20,
             memory: str = "host", config: dict | None = None) -> dict:
        """Start the engine and register ``size`` bytes of ``memory`` (region 0)."""
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}")
        session = self.start_engine(host, engine, config)
        whole = size + 2 * GUARD_BYTES
        if memory == "managed":
            addr = self.engine.allocate_managed_buffer(whole)  # registered as it is made
            if not addr:
                raise RuntimeError("allocate_managed_buffer failed")
            self.managed = _MappedRange(addr, whole)
            self.add(GuardedRegion(self.managed, size), register=False)
        elif memory == "cuda":
            from ...buffers import DeviceBuffer

            self.add(GuardedRegion(DeviceBuffer(whole), size), location="cuda:0")
        else:
            from ...buffers import HostBuffer

            self.add(GuardedRegion(HostBuffer(whole), size), location="*")
        return {"session": session, "pid": os.getpid(), "regions": self.region_list()}

    def digest_blocks(self, side: str, layout: str, block: int, count: int, layers: int = PAGED_LAYERS,
                      seed: int = 0) -> dict:
        """sha256 of this side's (``side``: local or remote) blocks of a plan, in plan order: equal
        on both sides once every block has moved to its place."""
        local, remote = block_plan(layout, block, count, layers, seed)
        offsets = local if side == "local" else remote
        whole = self.regions[0].read(0, max(offsets) + block)
        h = hashlib.sha256()
        for off in offsets:
            h.update(whole[off:off + block])
        return {"digest": h.hexdigest()}

    def run(self, op: str, target: str, remote: int, block: int, count: int, reps: int, trials: int = 1,
            warmup: int = 1, layout: str = "contiguous", callers: int = 1, layers: int = PAGED_LAYERS,
            seed: int = 0) -> dict:
        """``warmup`` untimed, then ``trials`` timed loops of ``reps`` batch transfers of ``count`` blocks.

        Block i goes between the plan's local and remote offsets (``layouts.block_plan``); with
        ``callers`` > 1, that many threads each move their share of the blocks (every caller-th)
        in calls of their own, ``reps`` each, all at once.  The answer carries the first failing
        return code (0 if none) and, per trial, the wall seconds and this process's CPU seconds
        (user + system, all threads) of the timed loop.
        """
        local_off, remote_off = block_plan(layout, block, count, layers, seed)
        base = self.regions[0].addr
        parts = [([base + o for o in local_off[c::callers]], [remote + o for o in remote_off[c::callers]])
                 for c in range(max(1, callers))]
        if op == "write":
            fn = self.engine.batch_transfer_sync_write
        elif op == "read":
            fn = self.engine.batch_transfer_sync_read
        else:
            raise ValueError(f"op must be 'write' or 'read', not {op!r}")

        def loop(part: tuple[list[int], list[int]], n: int, codes: list[int]) -> None:
            lengths = [block] * len(part[0])
            for _ in range(n):
                rc = fn(target, part[0], part[1], lengths)
                if rc != 0:
                    codes.append(rc)
                    return

        def all_callers(n: int) -> int:
            codes: list[int] = []
            if len(parts) == 1:
                loop(parts[0], n, codes)
            else:
                threads = [threading.Thread(target=loop, args=(part, n, codes)) for part in parts]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            return codes[0] if codes else 0

        if warmup:
            rc = all_callers(warmup)
            if rc != 0:
                return {"rc": rc, "trials": [], "where": "warm-up"}
        results: list[dict] = []
        rc = 0
        for _ in range(trials):
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            rc = all_callers(reps)
            seconds = time.perf_counter() - t0
            results.append({"reps": reps if rc == 0 else 0, "seconds": seconds, "cpu_seconds": _cpu_seconds() - cpu0})
            if rc != 0:
                break
        return {"rc": rc, "trials": results}

    def latency(self, target: str, remote: int, size: int, n: int, warmup: int = 50, op: str = "write") -> dict:
        """``n`` single ``transfer_sync_write`` (or ``_read``) calls of ``size`` bytes, each timed on its own."""
        fn = self.engine.transfer_sync_write if op == "write" else self.engine.transfer_sync_read
        addr = self.regions[0].addr
        for _ in range(warmup):
            rc = fn(target, addr, remote, size)
            if rc != 0:
                return {"rc": rc, "n": 0, "where": "warm-up"}
        samples: list[float] = []
        rc = 0
        cpu0 = _cpu_seconds()
        t_all = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter_ns()
            rc = fn(target, addr, remote, size)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if rc != 0:
                break
        seconds = time.perf_counter() - t_all
        cpu = _cpu_seconds() - cpu0
        samples.sort()
        return {"rc": rc, "n": len(samples), "p50_us": _percentile(samples, 0.50),
                "p99_us": _percentile(samples, 0.99), "mean_us": sum(samples) / len(samples),
                "min_us": samples[0], "max_us": samples[-1], "seconds": seconds, "cpu_seconds": cpu}

    def exit(self) -> dict:
        if self.managed is not None:
            self.engine.free_managed_buffer(self.managed.addr, self.managed.size)
        super().exit()
        for region in self.regions:
            region.close()
        return {}


class WorkerProcess(EngineProcess):
    """Parent side of a bench worker: ``call``, ``addr``, ``close`` and ``kill``; its one region is 0."""

    def __init__(self, engine: str = "flagcx_mc", size: int = 1 << 20, memory: str = "host",
                 config: dict | None = None, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 start_timeout: float = 30.0, argv_prefix: list[str] | None = None) -> None:
        super().__init__("flagcx_mc.tools.bench.worker",
                         {"engine": engine, "host": host, "size": size, "memory": memory, "config": config},
                         env=env, start_timeout=start_timeout, argv_prefix=argv_prefix)


if __name__ == "__main__":
    _Worker().serve()
