"""A remote-controlled engine process: the far end for the demo, the benchmark and the tests.

``python -m flagcx_mc._testing.node`` reads one JSON command per line on stdin and answers one JSON line
on stdout.  It owns host buffers (each wrapped in guard bytes, so tests can prove that nothing
was written outside a registered region), registers them, checksums them, and can itself start
transfers.  ``NodeProcess`` is the parent's side: it starts the child, sends commands with a
deadline, and always reaps the child.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from ..buffers import DeviceBuffer, HostBuffer
from ..net.addresses import format_host_port

__all__ = ["NodeProcess", "GUARD_BYTES", "GUARD_VALUE"]

GUARD_BYTES = 4096
GUARD_VALUE = 0xA5


class _Region:
    def __init__(self, size: int, device: Optional[int] = None, vmm_chunk: int = 0, shareable: bool = True) -> None:
        self.buf = (HostBuffer(size + 2 * GUARD_BYTES) if device is None
                    else DeviceBuffer(size + 2 * GUARD_BYTES, device, vmm_chunk, shareable))
        self.buf.fill(GUARD_VALUE, 0, GUARD_BYTES)
        self.buf.fill(GUARD_VALUE, GUARD_BYTES + size, GUARD_BYTES)
        self.addr = self.buf.addr + GUARD_BYTES
        self.size = size

    def guards_intact(self) -> bool:
        expected = bytes([GUARD_VALUE]) * GUARD_BYTES
        return (self.buf.read(0, GUARD_BYTES) == expected and
                self.buf.read(GUARD_BYTES + self.size, GUARD_BYTES) == expected)


class _Node:
    """Command handlers of the child process."""

    def __init__(self) -> None:
        from ..engine.sync_engine import TransferEngine

        self.engine_cls = TransferEngine
        self.engine: Optional[Any] = None
        self.regions: List[_Region] = []

    def init(self, host: str = "127.0.0.1", regions: List[int] = (), config: Optional[dict] = None,
             engine: str = "flagcx_mc", metadata_server: str = "P2PHANDSHAKE") -> dict:
        """Start the engine: ours, or (``engine="mooncake"``) Mooncake's own, for interop and baselines."""
        if engine == "mooncake":
            os.environ.setdefault("MC_FORCE_TCP", "1")
            from mooncake.engine import TransferEngine as MooncakeEngine

            self.engine = MooncakeEngine()
        else:
            self.engine = self.engine_cls(**(config or {}))
        if self.engine.initialize(host, metadata_server, "tcp", "") != 0:
            raise RuntimeError("initialize failed")
        for size in regions:
            self.add_region(size)
        # P2P names are host:rpc_port; with a metadata server the name is `host` as given.
        session = format_host_port(host, self.engine.get_rpc_port()) if metadata_server == "P2PHANDSHAKE" else host
        return {"session": session, "pid": os.getpid(), "regions": [[r.addr, r.size] for r in self.regions]}

    def add_region(self, size: int, register: bool = True, device: Optional[int] = None, vmm_chunk: int = 0,
                   shareable: bool = True) -> dict:
        """A region of host memory, or of GPU memory on ``device`` (VMM memory in chunks of
        ``vmm_chunk`` bytes if > 0, see DeviceBuffer), between guard bytes."""
        region = _Region(size, device, vmm_chunk, shareable)
        if register:
            rc = self.engine.register_memory(region.addr, size)
            if rc != 0:
                raise RuntimeError(f"register_memory returned {rc}")
        self.regions.append(region)
        return {"index": len(self.regions) - 1, "addr": region.addr, "size": size}

    def region_info(self, region: int) -> dict:
        r = self.regions[region]
        return {"addr": r.addr, "size": r.size}

    def unregister(self, region: int) -> dict:
        return {"rc": self.engine.unregister_memory(self.regions[region].addr)}

    def register(self, region: int) -> dict:
        r = self.regions[region]
        return {"rc": self.engine.register_memory(r.addr, r.size)}

    def fill(self, region: int, offset: int = 0, length: Optional[int] = None) -> dict:
        r = self.regions[region]
        length = r.size - offset if length is None else length
        return {"digest": r.buf.fill_random(GUARD_BYTES + offset, length)}

    def set(self, region: int, byte: int, offset: int = 0, length: Optional[int] = None) -> dict:
        r = self.regions[region]
        length = r.size - offset if length is None else length
        r.buf.fill(byte, GUARD_BYTES + offset, length)
        return {}

    def digest(self, region: int, offset: int = 0, length: Optional[int] = None) -> dict:
        r = self.regions[region]
        length = r.size - offset if length is None else length
        return {"digest": r.buf.digest(GUARD_BYTES + offset, length)}

    def count_byte(self, region: int, byte: int) -> dict:
        """How many bytes of the region equal ``byte`` (to spot late writes of a known pattern)."""
        r = self.regions[region]
        return {"count": r.buf.read(GUARD_BYTES, r.size).count(bytes([byte]))}

    def guards(self) -> dict:
        return {"intact": all(r.guards_intact() for r in self.regions)}

    def transfer(self, op: str, target: str, items: List[List[int]]) -> dict:
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

    def exit(self) -> dict:
        close = getattr(self.engine, "close", None)  # Mooncake's engine closes in its destructor
        if close is not None:
            close()
        return {}


_COMMANDS = frozenset({"init", "add_region", "region_info", "unregister", "register", "fill", "set", "digest", "count_byte", "guards", "transfer",
                       "stats", "exit"})


def _serve() -> None:
    if os.environ.get("FLAGCX_MC_NODE_NONDUMPABLE") == "1":
        # Tests use this to make the kernel refuse other processes access to this one's memory.
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    if os.environ.get("FLAGCX_MC_NODE_SIGPIPE_DEFAULT") == "1":
        # Tests use this to run as a C program would: SIGPIPE kills (Python itself ignores it).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    serve_json_lines(_Node(), _COMMANDS)


def serve_json_lines(handler: Any, commands: frozenset) -> None:
    """Answer one JSON command per stdin line with one JSON line on stdout, until ``exit``.

    A command is a method of ``handler`` named in ``commands``; its keyword arguments are the
    message's other keys.  Errors become ``{"error": ...}`` replies (the parent decides)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # only replies go to the real stdout
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd not in commands:
                raise ValueError(f"unknown command {cmd!r}")
            reply = getattr(handler, cmd)(**msg)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
            cmd = None
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if cmd == "exit":
            return


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


class NodeError(RuntimeError):
    """The node answered with an error, died, or did not answer in time."""


class NodeProcess:
    """Parent side of a node: start it, send commands, reap it."""

    def __init__(self, host: str = "127.0.0.1", regions: List[int] = (), config: Optional[dict] = None,
                 env: Optional[Dict[str, str]] = None, start_timeout: float = 30.0,
                 argv_prefix: Optional[List[str]] = None, engine: str = "flagcx_mc",
                 metadata_server: str = "P2PHANDSHAKE") -> None:
        child_env = dict(os.environ)
        child_env.update(env or {})
        # Start in the directory that holds this very package, so the child imports the same
        # flagcx_mc (not a source tree without the compiled core that happens to be the cwd).
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            list(argv_prefix or []) + [sys.executable, "-m", "flagcx_mc._testing.node"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env, text=True, bufsize=1,
            cwd=package_parent,
        )
        try:
            info = self.call("init", timeout=start_timeout, host=host, regions=list(regions), config=config,
                             engine=engine, metadata_server=metadata_server)
        except BaseException:
            self.kill()
            raise
        self.session: str = info["session"]
        self.pid: int = info["pid"]
        self.regions: List[List[int]] = info["regions"]

    def call(self, cmd: str, timeout: float = 60.0, **kwargs: Any) -> dict:
        if self.proc.poll() is not None:
            raise NodeError(f"node exited with {self.proc.returncode}")
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise NodeError(f"node did not answer {cmd!r} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise NodeError(f"node exited while answering {cmd!r} (code {self.proc.wait(5)})")
        reply = json.loads(line)
        if "error" in reply:
            raise NodeError(f"{cmd}: {reply['error']}")
        return reply

    def addr(self, region: int, offset: int = 0) -> int:
        return self.regions[region][0] + offset

    def close(self, timeout: float = 10.0) -> None:
        """Ask the node to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
                self.proc.wait(timeout)
            except (NodeError, OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP the node and return once every one of its threads has stopped: kill() only
        queues the signal, and a thread spinning on another core can serve a request first."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.pid):
            if time.monotonic() > deadline:
                raise NodeError(f"node {self.pid} did not stop within {timeout} s")
            time.sleep(0.0005)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> "NodeProcess":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


if __name__ == "__main__":
    _serve()
