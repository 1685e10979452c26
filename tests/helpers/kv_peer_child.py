"""A prefill worker in its own process, for the side-channel tests (not a test module).

    python tests/helpers/kv_peer_child.py prefill --layers 2 --blocks 32 --block-len 4096
    python tests/helpers/kv_peer_child.py worker --registry tcp://... --instance prefill --dp 0 --pp 1 --tp 1

The first line on stdout is JSON: ``endpoint`` (side channel), ``session`` (engine), ``pid``.
A prefill worker then answers one JSON command per stdin line (``fill``, ``publish``,
``finished``, ``stats``, ``exit``); a port-scheme worker registers itself and serves until
stdin closes.  ``PeerProcess`` is the parent's side.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def block_digest(buffers, block_len: int, blocks: list[int]) -> str:
    """sha256 of the named blocks of both planes (K then V) of every layer, in order."""
    h = hashlib.sha256()
    for buf in buffers:
        half = buf.size // 2
        for plane in (0, half):
            for b in blocks:
                h.update(buf.view[plane + b * block_len: plane + (b + 1) * block_len])
    return h.hexdigest()


async def _stdin_lines():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        yield json.loads(line)


_out = sys.stdout  # main() points sys.stdout at stderr, so only protocol lines reach this


def _say(obj: dict[str, Any]) -> None:
    _out.write(json.dumps(obj) + "\n")
    _out.flush()


async def prefill(args) -> None:
    from flagcx_mc import AsyncTransferEngine, HostBuffer
    from flagcx_mc.kv import KV_FIRST, KVLayout, KVSender, planes_of

    buffers = [HostBuffer(2 * args.blocks * args.block_len) for _ in range(args.layers)]
    layout = KVLayout.single([p for b in buffers for p in planes_of(b, args.blocks, KV_FIRST)])
    finished: dict[str, bool] = {}
    async with AsyncTransferEngine(transfer_timeout=10.0) as engine:
        await engine.initialize("127.0.0.1")
        await engine.batch_register_memory(*layout.spans())
        async with KVSender(engine, layout, session=engine.session_name) as sender:
            _say({"endpoint": await sender.start(), "session": engine.session_name, "pid": os.getpid()})
            async for cmd in _stdin_lines():
                op = cmd.pop("cmd")
                if op == "fill":
                    for buf in buffers:
                        half = buf.size // 2
                        for plane in (0, half):
                            for b in cmd["blocks"]:
                                buf.fill_random(plane + b * args.block_len, args.block_len)
                    _say({"digest": block_digest(buffers, args.block_len, cmd["blocks"])})
                elif op == "publish":
                    fut = sender.publish(cmd["rid"], cmd["blocks"], consumers=cmd.get("consumers", 1))
                    fut.add_done_callback(lambda f, rid=cmd["rid"]: finished.__setitem__(rid, f.result()))
                    _say({})
                elif op == "finished":
                    _say({"finished": finished})
                elif op == "stats":
                    _say({**sender.stats, "waiting": sender.waiting})
                elif op == "exit":
                    _say({})
                    break
    for buf in buffers:
        buf.close()


async def worker(args) -> None:
    from flagcx_mc import AsyncTransferEngine, HostBuffer
    from flagcx_mc.kv import KVLayout, KVSender, WorkerKey, planes_of, register_worker

    key = WorkerKey(args.instance, args.dp, args.pp, args.tp)
    with HostBuffer(1 << 16) as kv:
        layout = KVLayout.single(planes_of(kv, 16))
        async with AsyncTransferEngine() as engine:
            await engine.initialize("127.0.0.1")
            await engine.batch_register_memory(*layout.spans())
            async with KVSender(engine, layout, tp=(args.tp_size, args.tp), worker=key,
                                session=engine.session_name) as sender:
                endpoint = await sender.start("127.0.0.1")
                await register_worker(args.registry, key, endpoint)
                _say({"endpoint": endpoint, "session": engine.session_name, "pid": os.getpid()})
                async for _ in _stdin_lines():
                    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-len", type=int, default=4096)
    w = sub.add_parser("worker")
    w.add_argument("--registry", required=True)
    w.add_argument("--instance", required=True)
    for name in ("dp", "pp", "tp"):
        w.add_argument(f"--{name}", type=int, required=True)
    w.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    sys.stdout = sys.stderr
    asyncio.run(prefill(args) if args.mode == "prefill" else worker(args))


class PeerProcess:
    """Parent side: start the child, read its first line, send commands with a deadline, reap it."""

    def __init__(self, *argv: str, start_timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "kv_peer_child.py"), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            info = self._read(start_timeout)
        except BaseException:
            self.kill()
            raise
        self.endpoint: str = info["endpoint"]
        self.session: str = info["session"]
        self.pid: int = info["pid"]

    def _read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"child did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait(5)}")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = 30.0, **kwargs: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (OSError, ValueError):
                pass


if __name__ == "__main__":
    main()
