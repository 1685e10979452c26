"""Calls per second of the asyncio facade beside the sync one (``flagcx-mc bench --async``).

Two engines in this process per transport: a target, and an initiator driven three ways on the
same shapes, one after another and in rounds (the best round kept, so that a noisy neighbour
costs a round, not the comparison):

- ``sync``: ``TransferEngine.batch_transfer_sync_write`` back to back from one thread;
- ``async``: ``AsyncTransferEngine`` coroutines, 1, 16 or 64 at once, each calling back to back;
- ``to_thread``: ``asyncio.to_thread`` around the sync call, as many coroutines: what a user
  would write without the async facade.

Shapes: one 4 KiB and one 64 KiB block per call, and 64 x 4 KiB per call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ASYNC_SHAPES", "CONCURRENCY", "run_async_bench", "print_async_report"]

ASYNC_SHAPES: tuple[tuple[int, int], ...] = ((4096, 1), (65536, 1), (4096, 64))
CONCURRENCY: tuple[int, ...] = (1, 16, 64)
_SLOTS = 64  # distinct blocks per coroutine slot, so concurrent calls touch distinct memory


async def _rate(call: Callable[[int], Awaitable[Any]], workers: int, seconds: float) -> float:
    """Calls per second of ``workers`` coroutines each awaiting ``call(worker)`` back to back."""
    stop = time.perf_counter() + seconds
    counts = [0] * workers

    async def worker(w: int) -> None:
        n = 0
        while True:
            for _ in range(16):
                await call(w)
            n += 16
            if time.perf_counter() >= stop:
                break
        counts[w] = n

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return sum(counts) / (time.perf_counter() - t0)


def _sync_rate(call: Callable[[], Any], seconds: float) -> float:
    stop = time.perf_counter() + seconds
    n = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(64):
            call()
        n += 64
        if time.perf_counter() >= stop:
            break
    return n / (time.perf_counter() - t0)


def _calls(sync: Any, initiator: Any, name: str, src: int, dst: int, block: int,
           count: int) -> tuple[Callable[..., Any], Callable[[int], Awaitable[None]]]:
    """The sync and async call of one shape; coroutine ``w`` uses its own slot of both buffers."""
    stride = block * count
    lengths = [block] * count

    def addrs(base: int, w: int) -> list[int]:
        start = base + (w % max(CONCURRENCY)) * stride
        return [start + i * block for i in range(count)]

    if count == 1:
        def sync_call(w: int = 0) -> Any:
            off = (w % max(CONCURRENCY)) * stride
            return sync.transfer_sync_write(name, src + off, dst + off, block)

        async def async_call(w: int) -> None:
            off = w * stride
            await initiator.transfer_sync_write(name, src + off, dst + off, block)
    else:
        def sync_call(w: int = 0) -> Any:
            return sync.batch_transfer_sync_write(name, addrs(src, w), addrs(dst, w), lengths)

        async def async_call(w: int) -> None:
            await initiator.batch_transfer_sync_write(name, addrs(src, w), addrs(dst, w), lengths)
    return sync_call, async_call


async def _one_transport(transport: str, seconds: float, rounds: int) -> list[dict]:
    from ... import AsyncTransferEngine, HostBuffer, TransferEngine

    span = max(b * c for b, c in ASYNC_SHAPES) * max(CONCURRENCY)
    src, dst = HostBuffer(span), HostBuffer(span)
    target = AsyncTransferEngine(transport=transport)
    initiator = AsyncTransferEngine(transport=transport)
    sync = TransferEngine(transport=transport)
    rows: list[dict] = []
    try:
        await target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await target.register_memory(dst.addr, dst.size)
        await initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await initiator.register_memory(src.addr, src.size)
        await asyncio.to_thread(sync.initialize, "127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await asyncio.to_thread(sync.register_memory, src.addr, src.size)
        name = target.session_name
        for block, count in ASYNC_SHAPES:
            sync_call, async_call = _calls(sync, initiator, name, src.addr, dst.addr, block, count)

            async def threaded_call(w: int, sync_call: Callable[..., Any] = sync_call) -> None:
                rc = await asyncio.to_thread(sync_call, w)
                if rc != 0:
                    raise RuntimeError(f"sync call returned {rc}")

            if await asyncio.to_thread(sync_call) != 0:  # opens the sync session (the target answers on this loop)
                raise RuntimeError("sync facade's warm-up call failed")
            await async_call(0)
            best: dict[str, float] = {}
            for _ in range(rounds):  # interleaved: each round measures every column once
                rate = await asyncio.to_thread(_sync_rate, sync_call, seconds)
                best["sync"] = max(best.get("sync", 0.0), rate)
                for n in CONCURRENCY:
                    for key, fn in ((f"async_{n}", async_call), (f"to_thread_{n}", threaded_call)):
                        best[key] = max(best.get(key, 0.0), await _rate(fn, n, seconds))
            rows.append({"transport": transport, "block": block, "count": count, "calls_per_s": best})
    finally:
        await asyncio.to_thread(sync.close)
        await initiator.close()
        await target.close()
        src.close()
        dst.close()
    return rows


def run_async_bench(transports: tuple[str, ...] = ("same-host", "tcp"), seconds: float = 0.25,
                    rounds: int = 3, loop: str = "asyncio") -> list[dict]:
    """Rows ``{"transport", "block", "count", "loop", "calls_per_s": {column: best rate}}``."""
    async def main() -> list[dict]:
        rows: list[dict] = []
        for t in transports:
            rows += await _one_transport(t, seconds, rounds)
        return rows

    if loop == "uvloop":
        import uvloop

        rows = uvloop.run(main())
    else:
        rows = asyncio.run(main())
    for row in rows:
        row["loop"] = loop
    return rows


def print_async_report(rows: list[dict], out: Any = None) -> None:
    import sys

    out = out or sys.stdout
    cols = ["sync"] + [f"{kind}_{n}" for kind in ("async", "to_thread") for n in CONCURRENCY]
    print("\ncalls/s, async facade beside the sync one (best of the rounds)", file=out)
    print(f"{'transport':10} {'shape':12} {'loop':8}" + "".join(f"{c:>13}" for c in cols), file=out)
    for row in rows:
        shape = f"{row['block'] // 1024}K x{row['count']}"
        print(f"{row['transport']:10} {shape:12} {row['loop']:8}"
              + "".join(f"{row['calls_per_s'][c]:13,.0f}" for c in cols), file=out)
