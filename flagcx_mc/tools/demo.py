"""The main job: two engines in two processes on loopback move random data both ways, verify it
by checksum, and report throughput.  ``flagcx-mc demo`` runs it."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from .._testing.node import NodeProcess
from .._units import fmt_size
from ..buffers import HostBuffer
from ..engine.async_engine import AsyncTransferEngine

__all__ = ["DemoResult", "run_demo"]

# (block size, block count): many small blocks, KV-cache-sized blocks, one big block.
DEFAULT_SHAPES = [(4 << 10, 1024), (64 << 10, 512), (1 << 20, 64), (64 << 20, 1)]


@dataclass
class DemoResult:
    direction: str
    block: int
    count: int
    seconds: float
    verified: bool

    @property
    def gbps(self) -> float:
        return self.block * self.count / self.seconds / 1e9 if self.seconds > 0 else 0.0


async def _demo(shapes: list[tuple], repeat: int, streams: int | None) -> list[DemoResult]:
    region = max(b * c for b, c in shapes)
    results: list[DemoResult] = []
    local = HostBuffer(region)
    node = await asyncio.to_thread(NodeProcess, regions=[region], config={"streams_per_peer": streams})
    try:
        async with AsyncTransferEngine(streams_per_peer=streams) as engine:
            await engine.initialize("127.0.0.1")
            await engine.register_memory(local.addr, local.size)
            print(f"initiator {engine.session_name} (pid {os.getpid()})  <->  target {node.session} (pid {node.pid})")
            # First contact both ways (handshake, data streams) happens here, outside the timings.
            await engine.transfer_sync_write(node.session, local.addr, node.addr(0), 1)
            await asyncio.to_thread(node.call, "transfer", op="write", target=engine.session_name,
                                    items=[[0, 0, local.addr, 1]])
            same_host = (await engine.get_conn(node.session)).peer.same_host
            print("transport:", "same host (process_vm_writev/readv)" if same_host else "native TCP",
                  "- set FLAGCX_MC_TRANSPORT=tcp or =same-host to choose")
            for block, count in shapes:
                total = block * count
                locals_ = [local.addr + i * block for i in range(count)]
                remotes = [node.addr(0, i * block) for i in range(count)]
                lengths = [block] * count
                # This process writes into the target.
                digest = local.fill_random(0, total)
                start = time.perf_counter()
                for _ in range(repeat):
                    await engine.batch_transfer_sync_write(node.session, locals_, remotes, lengths)
                seconds = (time.perf_counter() - start) / repeat
                ok = node.call("digest", region=0, offset=0, length=total)["digest"] == digest
                results.append(DemoResult("write", block, count, seconds, ok))
                # This process reads back fresh data from the target.
                digest = node.call("fill", region=0, offset=0, length=total)["digest"]
                start = time.perf_counter()
                for _ in range(repeat):
                    await engine.batch_transfer_sync_read(node.session, locals_, remotes, lengths)
                seconds = (time.perf_counter() - start) / repeat
                results.append(DemoResult("read", block, count, seconds, local.digest(0, total) == digest))
                # The other way round: the target process writes into this one.
                digest = node.call("fill", region=0, offset=0, length=total)["digest"]
                local.fill(0, 0, total)
                items = [[0, i * block, locals_[i], block] for i in range(count)]
                reply = await asyncio.to_thread(node.call, "transfer", op="write", target=engine.session_name,
                                                items=items)
                ok = reply["rc"] == 0 and local.digest(0, total) == digest
                results.append(DemoResult("peer-write", block, count, reply["seconds"], ok))
    finally:
        await asyncio.to_thread(node.close)
        local.close()
    return results


def run_demo(shapes: list[tuple] = DEFAULT_SHAPES, repeat: int = 3, streams: int | None = None) -> int:
    """Run the demo and print a table; returns a process exit code (0 only if all verified)."""
    results = asyncio.run(_demo(shapes, repeat, streams))
    print(f"{'direction':<11} {'block':>9} {'count':>6} {'total':>9} {'GB/s':>7}  verified")
    for r in results:
        print(f"{r.direction:<11} {fmt_size(r.block):>9} {r.count:>6} {fmt_size(r.block * r.count):>9} "
              f"{r.gbps:>7.2f}  {'yes' if r.verified else 'NO'}")
    bad = [r for r in results if not r.verified]
    print("all transfers verified by sha256" if not bad else f"{len(bad)} transfer(s) FAILED verification")
    return 1 if bad else 0
