"""One benchmark process: an engine (flagcx_mc's or Mooncake's) driven by JSON lines.

``python -m flagcx_mc.tools.bench.worker`` speaks the protocol of :mod:`flagcx_mc._testing.node` (one JSON command
per line on stdin, one JSON answer per line on stdout) with commands of its own.  As *initiator*
it runs timed loops of sync transfers and reports wall time and its own CPU time, so that
flagcx_mc and Mooncake initiators are measured alike, each in a process of its own.  As *target*
it offers memory the plain node cannot: engine-managed shared memory and CUDA device memory.

``WorkerProcess`` is the parent's side; it behaves like ``NodeProcess`` (``call``, ``addr``,
``session``, ``pid``, ``close``), so the benchmark can use either as a target.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from ..._testing.node import NodeProcess, serve_json_lines

__all__ = ["WorkerProcess", "MEMORY_KINDS"]

# host: private anonymous memory (HostBuffer); managed: the engine's registered shared memory
# (allocate_managed_buffer); cuda: device memory on GPU 0.
MEMORY_KINDS = ("host", "managed", "cuda")


class _MappedRange:
    """Memory somebody else owns (a managed buffer), with HostBuffer's fill/digest surface."""

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

    def close(self) -> None:
        pass


def _percentile(sorted_values: List[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _cpu_seconds() -> float:
    """User + system CPU seconds of this whole process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Worker:
    """Command handlers of the child process."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.kind = "flagcx_mc"
        self.mem: Any = None
        self.memory = "host"

    def init(self, engine: str = "flagcx_mc", host: str = "127.0.0.1", size: int = 1 << 20,
             memory: str = "host", config: Optional[dict] = None) -> dict:
        """Start the engine and register ``size`` bytes of ``memory``."""
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}")
        self.kind, self.memory = engine, memory
        if engine == "mooncake":
            os.environ.setdefault("MC_FORCE_TCP", "1")
            from mooncake.engine import TransferEngine as MooncakeEngine

            self.engine = MooncakeEngine()
        else:
            from ...engine.sync_engine import TransferEngine

            self.engine = TransferEngine(**(config or {}))
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("initialize failed")
        if memory == "managed":
            addr = self.engine.allocate_managed_buffer(size)
            if not addr:
                raise RuntimeError("allocate_managed_buffer failed")
            self.mem = _MappedRange(addr, size)
        else:
            if memory == "cuda":
                from ...buffers import DeviceBuffer

                self.mem = DeviceBuffer(size)
            else:
                from ...buffers import HostBuffer

                self.mem = HostBuffer(size)
            location = "cuda:0" if memory == "cuda" else "*"
            rc = self.engine.register_memory(self.mem.addr, size, location)
            if rc != 0:
                raise RuntimeError(f"register_memory returned {rc}")
        session = f"{host}:{self.engine.get_rpc_port()}"
        return {"session": session, "pid": os.getpid(), "regions": [[self.mem.addr, size]]}

    def fill(self, region: int = 0, offset: int = 0, length: Optional[int] = None) -> dict:
        length = self.mem.size - offset if length is None else length
        return {"digest": self.mem.fill_random(offset, length)}

    def set(self, byte: int, region: int = 0, offset: int = 0, length: Optional[int] = None) -> dict:
        length = self.mem.size - offset if length is None else length
        self.mem.fill(byte, offset, length)
        return {}

    def digest(self, region: int = 0, offset: int = 0, length: Optional[int] = None) -> dict:
        length = self.mem.size - offset if length is None else length
        return {"digest": self.mem.digest(offset, length)}

    def run(self, op: str, target: str, remote: int, block: int, count: int, reps: int, trials: int = 1,
            warmup: int = 1) -> dict:
        """``warmup`` untimed, then ``trials`` timed loops of ``reps`` batch transfers of ``count`` blocks.

        Block i goes between ``local + i*block`` and ``remote + i*block``.  The answer carries the
        first failing return code (0 if none) and, per trial, the wall seconds and this process's
        CPU seconds (user + system, all threads) of the timed loop.
        """
        local = [self.mem.addr + i * block for i in range(count)]
        remote_addrs = [remote + i * block for i in range(count)]
        lengths = [block] * count
        if op == "write":
            fn = self.engine.batch_transfer_sync_write
        elif op == "read":
            fn = self.engine.batch_transfer_sync_read
        else:
            raise ValueError(f"op must be 'write' or 'read', not {op!r}")
        for _ in range(warmup):
            rc = fn(target, local, remote_addrs, lengths)
            if rc != 0:
                return {"rc": rc, "trials": [], "where": "warm-up"}
        results: List[dict] = []
        rc = 0
        for _ in range(trials):
            done = 0
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            while done < reps:
                rc = fn(target, local, remote_addrs, lengths)
                if rc != 0:
                    break
                done += 1
            seconds = time.perf_counter() - t0
            results.append({"reps": done, "seconds": seconds, "cpu_seconds": _cpu_seconds() - cpu0})
            if rc != 0:
                break
        return {"rc": rc, "trials": results}

    def latency(self, target: str, remote: int, size: int, n: int, warmup: int = 50) -> dict:
        """``n`` single ``transfer_sync_write`` calls of ``size`` bytes, each timed on its own."""
        fn = self.engine.transfer_sync_write
        addr = self.mem.addr
        for _ in range(warmup):
            rc = fn(target, addr, remote, size)
            if rc != 0:
                return {"rc": rc, "n": 0, "where": "warm-up"}
        samples: List[float] = []
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
        if self.engine is not None and self.memory == "managed":
            self.engine.free_managed_buffer(self.mem.addr, self.mem.size)
        close = getattr(self.engine, "close", None)  # Mooncake's engine closes in its destructor
        if close is not None:
            close()
        if self.mem is not None:
            self.mem.close()
        return {}


_COMMANDS = frozenset({"init", "fill", "set", "digest", "run", "latency", "exit"})


def _serve() -> None:
    serve_json_lines(_Worker(), _COMMANDS)


class WorkerProcess(NodeProcess):
    """Parent side of a bench worker; ``call``, ``addr``, ``close`` and ``kill`` are NodeProcess's."""

    def __init__(self, engine: str = "flagcx_mc", size: int = 1 << 20, memory: str = "host",
                 config: Optional[dict] = None, env: Optional[Dict[str, str]] = None, host: str = "127.0.0.1",
                 start_timeout: float = 30.0) -> None:
        child_env = dict(os.environ)
        child_env.update(env or {})
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flagcx_mc.tools.bench.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env, text=True, bufsize=1,
            cwd=package_parent,
        )
        try:
            info = self.call("init", timeout=start_timeout, engine=engine, host=host, size=size, memory=memory,
                             config=config)
        except BaseException:
            self.kill()
            raise
        self.session: str = info["session"]
        self.pid: int = info["pid"]
        self.regions: List[List[int]] = info["regions"]


if __name__ == "__main__":
    _serve()
