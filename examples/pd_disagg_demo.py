"""Prefill/decode disaggregation: paged KV caches pushed through the side channel and the engine.

Three processes on this host:

- this one runs the bootstrap registry (on a free port) and prints the report;
- a prefill instance with PP x TP workers: each owns an engine, its layers' paged KV caches for
  its heads, and a side-channel listener on a free port that it registers as (dp, pp, tp);
- a decode instance with PP x decode-TP workers, each with its own engine and caches.

Both instances replay the same stream of requests (random prompt lengths, seeded arrivals).
Prefill allocates blocks, "computes" the KV (a value derived from request, layer, K/V, head,
token and dim), and publishes the blocks.  Decode allocates its own blocks (other ids), asks the
prefill ranks holding its heads, and checks every landed value.  Block ids fragment as
requests come and go, so the transfers are grouped runs, not whole tensors.

    python examples/pd_disagg_demo.py [--requests 32] [--pp 2] [--tp 2] [--decode-tp 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
from dataclasses import dataclass

import numpy as np

from flagcx_mc import AsyncTransferEngine
from flagcx_mc.kv import (
    KV_FIRST,
    BootstrapRegistry,
    HeadSplit,
    KVLayout,
    KVReceiver,
    KVSender,
    WorkerKey,
    lookup_workers,
    planes_of,
    register_worker,
)

DTYPE = np.uint16


@dataclass(frozen=True)
class Request:
    rid: str
    seed: int
    tokens: int
    arrival: float  # seconds after the stream starts


def request_stream(args) -> list[Request]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append(Request(f"req-{i}", rng.randrange(1 << 16), rng.randint(1, args.max_prompt), t))
    return out


def kv_values(req: Request, layer: int, heads: range, first_block: int, nblocks: int, args) -> np.ndarray:
    """The KV a request has at one layer, for some heads: [2, nblocks, heads, block_size, head_dim]."""
    kv = np.arange(2, dtype=DTYPE).reshape(2, 1, 1, 1, 1)
    token = (np.arange(first_block, first_block + nblocks, dtype=DTYPE).reshape(1, -1, 1, 1, 1) * args.block_size
             + np.arange(args.block_size, dtype=DTYPE).reshape(1, 1, 1, -1, 1))
    head = np.arange(heads.start, heads.stop, dtype=DTYPE).reshape(1, 1, -1, 1, 1)
    dim = np.arange(args.head_dim, dtype=DTYPE).reshape(1, 1, 1, 1, -1)
    base = (req.seed * 7919 + layer * 104729) & 0xFFFF
    return (DTYPE(base) + kv * DTYPE(40503) + head * DTYPE(31337) + token * DTYPE(257) + dim).astype(DTYPE)


class BlockPool:
    """Free block ids, handed out first-freed-first (so ids fragment as requests come and go)."""

    def __init__(self, size: int) -> None:
        self.free = collections.deque(range(size))
        self.changed = asyncio.Condition()

    async def alloc(self, n: int) -> list[int]:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.free) >= n)
            return [self.free.popleft() for _ in range(n)]

    async def release(self, blocks: list[int]) -> None:
        async with self.changed:
            self.free.extend(blocks)
            self.changed.notify_all()


class Worker:
    """One GPU stand-in: an engine and the paged KV of its pipeline stage's layers and its heads."""

    def __init__(self, args, role: str, pp: int, tp_size: int, tp: int) -> None:
        self.pp, self.tp_size, self.tp = pp, tp_size, tp
        self.split = HeadSplit(args.heads, args.block_size, args.head_dim * np.dtype(DTYPE).itemsize)
        self.heads = self.split.heads(tp_size, tp)
        per_stage = args.layers // args.pp
        self.layers = range(pp * per_stage, (pp + 1) * per_stage)
        num_blocks = args.blocks if role == "prefill" else args.decode_blocks
        shape = (2, num_blocks, len(self.heads), args.block_size, args.head_dim)  # KV_FIRST, heads-major blocks
        self.caches = {layer: np.zeros(shape, dtype=DTYPE) for layer in self.layers}
        self.layout = KVLayout.single([p for c in self.caches.values() for p in planes_of(c, num_blocks, KV_FIRST)])
        self.engine = AsyncTransferEngine(transfer_timeout=10.0)

    async def start(self) -> None:
        await self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await self.engine.batch_register_memory(*self.layout.spans())

    def key(self, instance: str) -> WorkerKey:
        return WorkerKey(instance, 0, self.pp, self.tp)


def summary(role: str, **fields) -> None:
    print(json.dumps({"role": role, **fields}), flush=True)


# ---------------------------------------------------------------------------------- prefill


async def prefill_main(args) -> None:
    workers = [Worker(args, "prefill", pp, args.tp, tp) for pp in range(args.pp) for tp in range(args.tp)]
    await asyncio.gather(*(w.start() for w in workers))
    senders = []
    for w in workers:
        sender = KVSender(w.engine, w.layout, tp=(args.tp, w.tp), split=w.split, worker=w.key("prefill"),
                          session=w.engine.session_name)
        endpoint = await sender.start("127.0.0.1")
        await register_worker(args.registry, w.key("prefill"), endpoint)
        senders.append(sender)
    # How many decode ranks read from each prefill rank (more than one when decode's TP is larger).
    consumers = [sum(1 for d in range(args.decode_tp) for r, _ in w.split.sources(args.tp, args.decode_tp, d)
                     if r == w.tp) for w in workers]
    pool = BlockPool(args.blocks)
    start = asyncio.get_running_loop().time()

    async def serve(req: Request) -> bool:
        await asyncio.sleep(max(0.0, start + req.arrival - asyncio.get_running_loop().time()))
        blocks = await pool.alloc(-(-req.tokens // args.block_size))
        try:
            for w in workers:  # the "forward pass": write this request's KV into its blocks
                for layer, cache in w.caches.items():
                    cache[:, blocks] = kv_values(req, layer, w.heads, 0, len(blocks), args)
            sent = [s.publish(req.rid, [blocks], consumers=n, expire=60.0)
                    for s, n in zip(senders, consumers, strict=True) if n]
            return all(await asyncio.gather(*sent))  # only now may the blocks be reused
        finally:
            await pool.release(blocks)

    served = await asyncio.gather(*(serve(r) for r in request_stream(args)))
    summary("prefill", served=sum(served), failed=len(served) - sum(served),
            triplets=sum(s.stats["triplets"] for s in senders),
            workers=[[w.pp, w.tp, s.endpoint, w.engine.session_name]
                     for w, s in zip(workers, senders, strict=True)])
    for s, w in zip(senders, workers, strict=True):
        await s.close()
        await w.engine.close()


# ---------------------------------------------------------------------------------- decode


async def decode_main(args) -> None:
    workers = [Worker(args, "decode", pp, args.decode_tp, tp) for pp in range(args.pp) for tp in range(args.decode_tp)]
    await asyncio.gather(*(w.start() for w in workers))
    table = await lookup_workers(args.registry, "prefill", expect=args.pp * args.tp, timeout=30.0)
    receivers, sources = [], []
    for w in workers:
        receivers.append(KVReceiver(w.engine.session_name, w.layout, tp=(args.decode_tp, w.tp), ttl=10.0, grace=15.0))
        holders = w.split.sources(args.tp, args.decode_tp, w.tp)  # prefill ranks holding this rank's heads
        sources.append([table[WorkerKey("prefill", 0, w.pp, r)] for r, _ in holders])
    pool = BlockPool(args.decode_blocks)
    loop = asyncio.get_running_loop()
    start = loop.time()
    results: list[dict] = []
    block_planes = 0

    async def fetch(req: Request) -> None:
        nonlocal block_planes
        await asyncio.sleep(max(0.0, start + req.arrival - loop.time()))
        blocks = await pool.alloc(-(-req.tokens // args.block_size))
        try:
            for w in workers:  # stale data must not pass the check
                for cache in w.caches.values():
                    cache[:, blocks] = 0
            t0 = loop.time()
            outcomes = await asyncio.gather(*(r.fetch(eps, {req.rid: [blocks]})
                                              for r, eps in zip(receivers, sources, strict=True)))
            latency = loop.time() - t0
            failed = [o[req.rid] for o in outcomes if not o[req.rid].ok]
            verified = not failed and all(
                np.array_equal(cache[:, blocks], kv_values(req, layer, w.heads, 0, len(blocks), args))
                for w in workers for layer, cache in w.caches.items())
            block_planes += len(blocks) * sum(len(w.layout.planes) for w in workers)
            results.append({"rid": req.rid, "ok": not failed, "verified": verified, "latency": latency,
                            "bytes": sum(o[req.rid].nbytes for o in outcomes), "tokens": req.tokens,
                            "reason": "; ".join(f"{f.status.value}: {f.reason}" for f in failed)})
        finally:
            await pool.release(blocks)

    await asyncio.gather(*(fetch(r) for r in request_stream(args)))
    elapsed = loop.time() - start
    summary("decode", results=results, elapsed=elapsed, block_planes=block_planes,
            workers=[[w.pp, w.tp, w.engine.session_name] for w in workers])
    for r, w in zip(receivers, workers, strict=True):
        await r.close()
        await w.engine.close()


# ---------------------------------------------------------------------------------- driver


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def driver(args, passthrough: list[str]) -> int:
    async with BootstrapRegistry() as registry:
        endpoint = await registry.start("127.0.0.1")
        procs = [await asyncio.create_subprocess_exec(sys.executable, __file__, "--role", role, "--registry", endpoint,
                                                      *passthrough, stdout=asyncio.subprocess.PIPE)
                 for role in ("prefill", "decode")]
        try:
            outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), args.timeout)
        except asyncio.TimeoutError:
            print(f"FAILED: prefill/decode did not finish within {args.timeout} s", file=sys.stderr)
            return 1
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
    if any(p.returncode for p in procs):
        print(f"FAILED: exit codes {[p.returncode for p in procs]}", file=sys.stderr)
        return 1
    prefill, decode = (json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs)
    return report(args, prefill, decode)


def report(args, prefill: dict, decode: dict) -> int:
    print(f"model: {args.layers} layers, {args.heads} KV heads x {args.head_dim}, blocks of {args.block_size} tokens")
    print(f"prefill PP{args.pp} x TP{args.tp} -> decode PP{args.pp} x TP{args.decode_tp}")
    print(f"{'worker':<18} {'side channel (free port, registered)':<38} engine session")
    for pp, tp, endpoint, session in prefill["workers"]:
        print(f"prefill pp{pp} tp{tp}    {endpoint:<38} {session}")
    for pp, tp, session in decode["workers"]:
        print(f"decode  pp{pp} tp{tp}    {'-':<38} {session}")
    results = decode["results"]
    moved = sum(r["bytes"] for r in results)
    lat = [r["latency"] * 1000 for r in results]
    print(f"requests {len(results)}, prompt tokens {sum(r['tokens'] for r in results):,}, "
          f"KV moved {moved / 2**20:.1f} MiB in {decode['elapsed']:.2f} s = {moved / decode['elapsed'] / 1e9:.3f} GB/s")
    print(f"fetch latency ms (ask -> every worker's KV landed, includes waiting for prefill): "
          f"p50 {percentile(lat, 0.5):.1f}  p90 {percentile(lat, 0.9):.1f}  p99 {percentile(lat, 0.99):.1f}  "
          f"max {max(lat):.1f}")
    print(f"grouping: {prefill['triplets']:,} triplets for {decode['block_planes']:,} block-planes")
    bad = [r for r in results if not (r["ok"] and r["verified"])]
    for r in bad:
        print(f"FAILED {r['rid']}: {'content mismatch' if r['ok'] else r['reason']}", file=sys.stderr)
    if bad or len(results) != args.requests or prefill["failed"]:
        print(f"FAILED: {len(bad)} of {len(results)} requests, prefill failures {prefill['failed']}", file=sys.stderr)
        return 1
    print(f"all {len(results)} requests verified on decode (every value of every block, layer, K/V and head)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=100.0, help="request arrivals per second")
    parser.add_argument("--max-prompt", type=int, default=1024, help="tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per prefill worker")
    parser.add_argument("--decode-blocks", type=int, default=320, help="blocks per decode worker")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole run")
    parser.add_argument("--role", choices=["driver", "prefill", "decode"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--registry", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.layers % args.pp:
        parser.error("--pp must divide --layers")
    if -(-args.max_prompt // args.block_size) > min(args.blocks, args.decode_blocks):
        parser.error("the longest prompt needs more blocks than a worker has")
    if args.role == "prefill":
        asyncio.run(prefill_main(args))
        return 0
    if args.role == "decode":
        asyncio.run(decode_main(args))
        return 0
    return asyncio.run(driver(args, sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
