"""Soak peer process: many ``AsyncTransferEngine`` instances in one process (tests/test_soak.py).

It speaks flagcx_mc.node's protocol (one JSON command per line on stdin, one JSON answer per line
on stdout), so the test starts and reaps it with ``NodeProcess(argv_prefix=[python, this file])``.
Commands: ``init`` (as node.py's, remembers host and config), ``start`` (the engines, each with
its own slot on the target), ``run`` (``count`` verified transfers per engine, all engines at
once), ``exit``.  A verified transfer writes random bytes to the engine's slot on the target,
reads them back into other memory and compares.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

from flagcx_mc import AsyncTransferEngine, HostBuffer


class Peer:
    """One engine, its local buffer (send half, receive half) and its slot on the target."""

    def __init__(self, engine: AsyncTransferEngine, buf: HostBuffer, target: str, remote: int, slot: int) -> None:
        self.engine, self.buf, self.target, self.remote, self.slot = engine, buf, target, remote, slot
        self.rng = random.Random(os.urandom(8))

    async def verified_transfer(self) -> bool:
        size = self.rng.randint(1, self.slot)
        off = self.rng.randint(0, self.slot - size)
        data = self.rng.randbytes(size)
        self.buf.write(off, data)
        await self.engine.transfer_sync_write(self.target, self.buf.addr + off, self.remote + off, size)
        self.buf.fill(0, self.slot + off, size)
        await self.engine.transfer_sync_read(self.target, self.buf.addr + self.slot + off, self.remote + off, size)
        return self.buf.read(self.slot + off, size) == data

    async def run(self, count: int) -> dict:
        ok, wrong, errors = 0, 0, []
        for _ in range(count):
            try:
                if await self.verified_transfer():
                    ok += 1
                else:
                    wrong += 1
            except Exception as exc:  # counted and reported to the test
                errors.append(f"{type(exc).__name__}: {exc}")
        return {"ok": ok, "wrong": wrong, "errors": errors}


class Soak:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.host = "127.0.0.1"
        self.config: dict = {}
        self.peers: list[Peer] = []

    def init(self, host: str = "127.0.0.1", config: dict | None = None, **_ignored) -> dict:
        self.host, self.config = host, dict(config or {})
        return {"session": "", "pid": os.getpid(), "regions": []}

    def start(self, target: str, slots: list[list[int]]) -> dict:
        return self.loop.run_until_complete(self._start(target, slots))

    async def _start(self, target: str, slots: list[list[int]]) -> dict:
        for remote, size in slots:
            engine = AsyncTransferEngine(**self.config)
            await engine.initialize(self.host)
            buf = HostBuffer(2 * size)
            await engine.register_memory(buf.addr, buf.size)
            self.peers.append(Peer(engine, buf, target, remote, size))
        return {"engines": len(self.peers)}

    def run(self, count: int) -> dict:
        results = self.loop.run_until_complete(self._run(count))
        return {"ok": sum(r["ok"] for r in results), "wrong": sum(r["wrong"] for r in results),
                "errors": [e for r in results for e in r["errors"]][:10],
                "error_count": sum(len(r["errors"]) for r in results)}

    async def _run(self, count: int) -> list[dict]:
        return await asyncio.gather(*(p.run(count) for p in self.peers))

    def exit(self) -> dict:
        for peer in self.peers:
            self.loop.run_until_complete(peer.engine.close())
            peer.buf.close()
        self.loop.close()
        return {}


def main() -> None:
    soak = Soak()
    out = sys.stdout
    sys.stdout = sys.stderr  # only answers go to the real stdout
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        try:
            if cmd not in ("init", "start", "run", "exit"):
                raise ValueError(f"unknown command {cmd!r}")
            reply = getattr(soak, cmd)(**msg)
        except Exception as exc:  # the answer carries it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if cmd == "exit":
            return


if __name__ == "__main__":
    main()
