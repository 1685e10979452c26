"""Many concurrent transfers from one asyncio program to several peers, every byte verified.

One initiator scatters blocks into three peers with a few hundred concurrent coroutines (writes
to shuffled slots), reads them all back the same way, and checks both directions by sha256.
The peers live in this process for brevity; in a deployment each is another process or host,
named by its session string ``host:rpc_port``.

    python examples/async_transfers.py [--peers 3] [--blocks 128] [--block-kib 64] [--concurrency 48]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sys
import time

from flagcx_mc import AsyncTransferEngine, HostBuffer


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
    limit = asyncio.Semaphore(args.concurrency)

    async def one(op, p: int, i: int) -> None:
        async with limit:
            local_addr = (local if op == "write" else back).addr + (p * args.blocks + i) * block
            remote_addr = remotes[p].addr + slots[p][i] * block
            if op == "write":
                await engine.transfer_sync_write(sessions[p], local_addr, remote_addr, block)
            else:
                await engine.transfer_sync_read(sessions[p], local_addr, remote_addr, block)

    count = len(sessions) * args.blocks
    nbytes = count * block
    print(f"{len(sessions)} peers, {count} transfers of {args.block_kib} KiB each way, "
          f"{args.concurrency} in flight at once")
    ok = True
    for op in ("write", "read"):
        t0 = time.perf_counter()
        await asyncio.gather(*(one(op, p, i) for p in range(len(sessions)) for i in range(args.blocks)))
        seconds = time.perf_counter() - t0
        if op == "write":
            good = all(remote.digest(slots[p][i] * block, block) == local.digest((p * args.blocks + i) * block, block)
                       for p, remote in enumerate(remotes) for i in range(args.blocks))
        else:
            good = hashlib.sha256(back.view).digest() == hashlib.sha256(local.view).digest()
        ok = ok and good
        print(f"{op:5}  {nbytes / 2**20:7.1f} MiB  {seconds * 1000:7.1f} ms  {nbytes / seconds / 1e9:5.2f} GB/s  "
              f"{'verified' if good else 'MISMATCH'}")
    if ok:
        print(f"all {2 * count} transfers verified by sha256")
        return 0
    print("verification FAILED", file=sys.stderr)
    return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=128, help="blocks per peer")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=48)
    sys.exit(asyncio.run(main(parser.parse_args())))
