"""Engine processes driven by JSON lines: one command per line on stdin, one answer per line on stdout.

The child side is an ``EngineServer``: it starts an engine (flagcx_mc's, or Mooncake's for
interop and comparisons), owns buffers wrapped in guard bytes (so a caller can prove that nothing
was written outside a registered range), fills and checksums them, and answers the commands its
class names.  ``serve_json_lines`` is its loop.  The parent side is an ``EngineProcess``: it
starts the child, sends commands with a deadline and always reaps the child.

The test suite's node (``flagcx_mc._testing.node``) and the benchmark's worker
(``flagcx_mc.tools.bench.worker``) are both built on these.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import TYPE_CHECKING, Any, ClassVar

from .net.addresses import format_host_port

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "GUARD_BYTES",
    "GUARD_VALUE",
    "EngineProcess",
    "EngineProcessError",
    "EngineServer",
    "GuardedRegion",
    "serve_json_lines",
]

GUARD_BYTES = 4096
GUARD_VALUE = 0xA5


class GuardedRegion:
    """``size`` usable bytes in the middle of ``buf`` (``size + 2 * GUARD_BYTES`` long, with
    ``fill``, ``fill_random``, ``digest`` and ``read`` as HostBuffer has them), the guard bytes
    on both sides set to ``GUARD_VALUE``."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf = buf
        self.size = size
        self.addr = buf.addr + GUARD_BYTES
        buf.fill(GUARD_VALUE, 0, GUARD_BYTES)
        buf.fill(GUARD_VALUE, GUARD_BYTES + size, GUARD_BYTES)

    def guards_intact(self) -> bool:
        expected = bytes([GUARD_VALUE]) * GUARD_BYTES
        return (self.buf.read(0, GUARD_BYTES) == expected and
                self.buf.read(GUARD_BYTES + self.size, GUARD_BYTES) == expected)

    def _length(self, offset: int, length: int | None) -> int:
        return self.size - offset if length is None else length

    def fill_random(self, offset: int = 0, length: int | None = None) -> str:
        return self.buf.fill_random(GUARD_BYTES + offset, self._length(offset, length))

    def fill(self, byte: int, offset: int = 0, length: int | None = None) -> None:
        self.buf.fill(byte, GUARD_BYTES + offset, self._length(offset, length))

    def digest(self, offset: int = 0, length: int | None = None) -> str:
        return self.buf.digest(GUARD_BYTES + offset, self._length(offset, length))

    def read(self, offset: int, length: int) -> bytes:
        return self.buf.read(GUARD_BYTES + offset, length)

    def close(self) -> None:
        self.buf.close()


class EngineServer:
    """Command handlers of an engine process.  ``COMMANDS`` names the methods a message may call
    (subclasses add theirs); a message's other keys are the keyword arguments."""

    COMMANDS: ClassVar[frozenset[str]] = frozenset({"fill", "set", "digest", "guards", "exit"})

    def __init__(self) -> None:
        self.engine: Any = None
        self.regions: list[GuardedRegion] = []

    def start_engine(self, host: str, engine: str = "flagcx_mc", config: dict | None = None,
                     metadata_server: str = "P2PHANDSHAKE") -> str:
        """Start flagcx_mc's engine (``config``: its settings) or Mooncake's; returns the session
        name peers use: ``host:rpc_port`` in P2P mode, ``host`` as given with a metadata server."""
        if engine == "mooncake":
            os.environ.setdefault("MC_FORCE_TCP", "1")
            from mooncake.engine import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
                TransferEngine as MooncakeEngine,
            )

            self.engine = MooncakeEngine()
        else:
            from .engine.sync_engine import TransferEngine

            self.engine = TransferEngine(**(config or {}))
        if self.engine.initialize(host, metadata_server, "tcp", "") != 0:
            raise RuntimeError("initialize failed")
        if metadata_server == "P2PHANDSHAKE":
            return format_host_port(host, self.engine.get_rpc_port())
        return host

    def add(self, region: GuardedRegion, register: bool = True, location: str | None = None) -> int:
        """Keep ``region`` (registering its usable bytes unless told not to); returns its index."""
        if register:
            args = (region.addr, region.size) if location is None else (region.addr, region.size, location)
            rc = self.engine.register_memory(*args)
            if rc != 0:
                raise RuntimeError(f"register_memory returned {rc}")
        self.regions.append(region)
        return len(self.regions) - 1

    def region_list(self) -> list[list[int]]:
        return [[r.addr, r.size] for r in self.regions]

    def fill(self, region: int = 0, offset: int = 0, length: int | None = None) -> dict:
        """Random bytes into a range of a region; answers their sha256."""
        return {"digest": self.regions[region].fill_random(offset, length)}

    def set(self, byte: int, region: int = 0, offset: int = 0, length: int | None = None) -> dict:
        self.regions[region].fill(byte, offset, length)
        return {}

    def digest(self, region: int = 0, offset: int = 0, length: int | None = None) -> dict:
        return {"digest": self.regions[region].digest(offset, length)}

    def guards(self) -> dict:
        """Whether every region's guard bytes still hold GUARD_VALUE."""
        return {"intact": all(r.guards_intact() for r in self.regions)}

    def exit(self) -> dict:
        close = getattr(self.engine, "close", None)  # Mooncake's engine closes in its destructor
        if close is not None:
            close()
        return {}

    def serve(self) -> None:
        serve_json_lines(self, self.COMMANDS)


def serve_json_lines(handler: Any, commands: frozenset[str]) -> None:
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
        except Exception as exc:  # noqa: BLE001 -- every failure is the parent's to judge
            reply = {"error": f"{type(exc).__name__}: {exc}"}
            cmd = None
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if cmd == "exit":
            return


class EngineProcessError(RuntimeError):
    """The process answered with an error, died, or did not answer in time."""


class EngineProcess:
    """Parent side of an engine process running ``python -m <module>``: start it, send the
    ``init`` command (``init``: its arguments; the answer holds ``session``, ``pid`` and
    ``regions``), send commands, reap it."""

    def __init__(self, module: str, init: dict[str, Any], env: dict[str, str] | None = None,
                 start_timeout: float = 30.0, argv_prefix: list[str] | None = None) -> None:
        child_env = dict(os.environ)
        child_env.update(env or {})
        # Start in the directory that holds this very package, so the child imports the same
        # flagcx_mc (not a source tree without the compiled core that happens to be the cwd).
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            list(argv_prefix or []) + [sys.executable, "-m", module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env, text=True, bufsize=1,
            cwd=package_parent,
        )
        try:
            info = self.call("init", timeout=start_timeout, **init)
        except BaseException:
            self.kill()
            raise
        self.init_reply: dict = info
        self.session: str = info["session"]
        self.pid: int = info["pid"]
        self.regions: list[list[int]] = info["regions"]

    def call(self, cmd: str, timeout: float = 60.0, **kwargs: Any) -> dict:
        """Send one command and wait up to ``timeout`` seconds for its answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise EngineProcessError(f"process exited with {self.proc.returncode}")
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise EngineProcessError(f"process did not answer {cmd!r} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EngineProcessError(f"process exited while answering {cmd!r} (code {self.proc.wait(5)})")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineProcessError(f"{cmd}: {reply['error']}")
        return reply

    def addr(self, region: int, offset: int = 0) -> int:
        return self.regions[region][0] + offset

    def close(self, timeout: float = 10.0) -> None:
        """Ask the process to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
                self.proc.wait(timeout)
            except (EngineProcessError, OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
