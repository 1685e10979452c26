"""Many concurrent transfers from one asyncio program to several peers, every byte verified.

One initiator scatters blocks into three peers with a few hundred concurrent coroutines (writes
to shuffled slots), reads them all back the same way, and checks both directions by sha256.
The peers live in this process for brevity; in a deployment each is another process or host,
named by its session string ``host:rpc_port``.  Sessions open before the clock starts (a
serving system connects once); the best of ``--rounds`` is printed.  ``--compare-sync`` moves
the same blocks with the sync facade from one thread too and prints the ratio.

    python examples/async_transfers.py [--peers 3] [--blocks 128] [--block-kib 64] [--concurrency 48]
                                       [--rounds 3] [--compare-sync]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sys
import time

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine


async def main(args: argparse.Namespace) -> int:
    block = args.block_kib << 10
    per_peer = args.blocks * block
    local = HostBuffer(args.peers * per_peer)
    back = HostBuffer(args.peers * per_peer)
    remotes = [HostBuffer(per_peer) for _ in range(args.peers)]
    async with AsyncTransferEngine() as engine:
        peers = [AsyncTransferEngine() for _ in remotes]
        try:
            await engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            await engine.batch_register_memory([local.addr, back.addr], [local.size, back.size])
            for peer, mem in zip(peers, remotes, strict=True):
                await peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
                await peer.register_memory(mem.addr, mem.size)
            sessions = [f"127.0.0.1:{await peer.get_rpc_port()}" for peer in peers]
            return await run(args, engine, sessions, local, back, remotes, block)
        finally:
            for peer in peers:
                await peer.close()
            for buf in (local, back, *remotes):
                buf.close()


async def run(args, engine, sessions, local, back, remotes, block) -> int:
    # Block i for peer p comes from local slot p * blocks + i and goes to remote slot slots[p][i].
    rng = random.Random(1)
    slots = [rng.sample(range(args.blocks), args.blocks) for _ in sessions]
    local.fill_random()
    jobs = [(p, i, (p * args.blocks + i) * block, remotes[p].addr + slots[p][i] * block)
            for p in range(len(sessions)) for i in range(args.blocks)]

    async def worker(op, todo) -> None:
        # `concurrency` of these share one iterator: that many transfers in flight, no more.
        for p, _, offset, remote_addr in todo:
            if op == "write":
                await engine.transfer_sync_write(sessions[p], local.addr + offset, remote_addr, block)
            else:
                await engine.transfer_sync_read(sessions[p], back.addr + offset, remote_addr, block)

    def all_of(op):
        todo = iter(jobs)
        return asyncio.gather(*(worker(op, todo) for _ in range(args.concurrency)))

    for p, _, offset, remote_addr in jobs[::args.blocks]:  # one block per peer opens its session
        await engine.transfer_sync_write(sessions[p], local.addr + offset, remote_addr, block)
    nbytes = len(jobs) * block
    print(f"{len(sessions)} peers, {len(jobs)} transfers of {args.block_kib} KiB each way, "
          f"{args.concurrency} in flight at once, best of {args.rounds} rounds")
    ok = True
    rates = {}
    for op in ("write", "read"):
        seconds = min([await _timed(all_of(op)) for _ in range(args.rounds)])
        good = _verified(op, jobs, local, back, remotes, slots, block, args.blocks)
        ok = ok and good
        rates[op] = nbytes / seconds
        print(f"{op:5}  {nbytes / 2**20:7.1f} MiB  {seconds * 1000:7.1f} ms  {nbytes / seconds / 1e9:5.2f} GB/s  "
              f"{'verified' if good else 'MISMATCH'}")
    if args.compare_sync:
        ok = await asyncio.to_thread(_compare_sync, args, jobs, sessions, local, back, remotes, slots, block,
                                     rates) and ok
    if ok:
        print(f"all {2 * len(jobs)} transfers of each round verified by sha256")
        return 0
    print("verification FAILED", file=sys.stderr)
    return 1


async def _timed(awaitable) -> float:
    t0 = time.perf_counter()
    await awaitable
    return time.perf_counter() - t0


def _verified(op, jobs, local, back, remotes, slots, block, blocks) -> bool:
    if op == "write":
        return all(remotes[p].digest(slots[p][i] * block, block) == local.digest(off, block) for p, i, off, _ in jobs)
    return hashlib.sha256(back.view).digest() == hashlib.sha256(local.view).digest()


def _compare_sync(args, jobs, sessions, local, back, remotes, slots, block, rates) -> bool:
    """The same blocks through the sync facade, back to back from one thread."""
    sync = TransferEngine()
    ok = True
    try:
        if sync.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            return False
        sync.batch_register_memory([local.addr, back.addr], [local.size, back.size])
        back.fill(0)
        for op in ("write", "read"):
            call = sync.transfer_sync_write if op == "write" else sync.transfer_sync_read
            base = local.addr if op == "write" else back.addr
            for p, _, off, r in jobs[::args.blocks]:
                call(sessions[p], base + off, r, block)
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                ok = all(call(sessions[p], base + off, r, block) == 0 for p, _, off, r in jobs) and ok
                best = min(best, time.perf_counter() - t0)
            ok = _verified(op, jobs, local, back, remotes, slots, block, args.blocks) and ok
            sync_rate = len(jobs) * block / best
            print(f"{op:5}  sync facade, one thread: {sync_rate / 1e9:5.2f} GB/s;  async / sync: "
                  f"{rates[op] / sync_rate:.2f}")
    finally:
        sync.close()
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=128, help="blocks per peer")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-sync", action="store_true", help="also time the sync facade on the same blocks")
    sys.exit(asyncio.run(main(parser.parse_args())))
