"""``TransferEngine``: the drop-in for ``mooncake.engine.TransferEngine`` (sync, int returns).

A private event loop in a daemon thread runs the async engine's control plane.  Transfers to an
already-open session skip that loop entirely: the calling thread goes straight into the C core
(GIL released), so many threads can transfer at once without queueing behind each other.
Every method returns Mooncake's value: 0 on success, a negative code on failure, the reason
logged on the ``flagcx_mc`` logger.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Coroutine, Optional, Sequence, TypeVar

from . import errors
from .engine import AsyncTransferEngine
from .sessions import Session
from .transfer import OP_READ, OP_WRITE, TransferRequest, needs_refresh, opcode_name

__all__ = ["TransferEngine"]

log = logging.getLogger("flagcx_mc")

T = TypeVar("T")

# Upper bound for control-plane calls made from the caller's thread (the handshake has its own,
# shorter timeouts; this only guards against a wedged loop thread).
_CONTROL_TIMEOUT = 120.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


def _returns_code(fn: Callable[..., Any]) -> Callable[..., int]:
    """Map exceptions to Mooncake's codes and log why; success is 0."""

    @functools.wraps(fn)
    def wrapper(self: "TransferEngine", *args: Any, **kwargs: Any) -> int:
        try:
            fn(self, *args, **kwargs)
            return 0
        except errors.FlagcxMcError as exc:
            log.error("%s failed: %s", fn.__name__, exc)
            return exc.code
        except Exception:
            log.exception("%s failed unexpectedly", fn.__name__)
            return -1

    return wrapper


class TransferEngine:
    """Mooncake-compatible synchronous engine; safe to call from many threads at once."""

    def __init__(self, **config: Any) -> None:
        self._engine = AsyncTransferEngine(**config)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self._initialized = False

    # ------------------------------------------------------------------ private loop

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = _CONTROL_TIMEOUT) -> T:
        if self._loop is None:
            coro.close()
            raise errors.EngineStateError("engine not initialized")
        if threading.current_thread() is self._thread:
            coro.close()
            raise errors.EngineStateError("TransferEngine methods cannot be called from its own loop thread")
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def _start_loop(self) -> None:
        loop = _new_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=main, name="flagcx-mc-loop", daemon=True)
        thread.start()
        ready.wait()
        self._loop, self._thread = loop, thread

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /) -> int:
        """Start the engine; 0 on success, -1 on failure (Mooncake's convention)."""
        with self._start_lock:
            if self._initialized:
                log.error("initialize failed: engine already initialized")
                return -1
            try:
                if self._loop is None:
                    self._start_loop()
                self._run(self._engine.initialize(local_hostname, metadata_server, protocol, device_name))
            except errors.FlagcxMcError as exc:
                log.error("initialize failed: %s", exc)
                return -1
            except Exception:
                log.exception("initialize failed unexpectedly")
                return -1
            self._initialized = True
            return 0

    def close(self) -> None:
        """Shut the engine down (not in Mooncake's API; its destructor does this)."""
        with self._start_lock:
            if self._loop is None:
                return
            try:
                self._run(self._engine.close())
            finally:
                loop, self._loop = self._loop, None
                loop.call_soon_threadsafe(loop.stop)
                if self._thread is not None:
                    self._thread.join(5)
                loop.close()
                self._initialized = False

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_rpc_port(self, /) -> int:
        """The handshake port peers dial; the session name is f"{host}:{port}"."""
        return self._engine._rpc_port if self._initialized else -1

    @property
    def session_name(self) -> str:
        return self._engine.session_name

    def stats(self) -> dict:
        return self._engine.stats()

    # ------------------------------------------------------------------ memory

    @_returns_code
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> None:
        self._run(self._engine.register_memory(buffer_addr, capacity, location))

    @_returns_code
    def unregister_memory(self, buffer_addr: int, /) -> None:
        self._run(self._engine.unregister_memory(buffer_addr))

    @_returns_code
    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> None:
        self._run(self._engine.batch_register_memory(buffer_addresses, capacities, location))

    @_returns_code
    def batch_unregister_memory(self, buffer_addresses: Sequence[int], /) -> None:
        self._run(self._engine.batch_unregister_memory(buffer_addresses))

    # ------------------------------------------------------------------ transfers

    @_returns_code
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> None:
        self._transfer(target_hostname, TransferRequest.single(OP_WRITE, buffer, peer_buffer_address, length))

    @_returns_code
    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> None:
        self._transfer(target_hostname, TransferRequest.single(OP_READ, buffer, peer_buffer_address, length))

    @_returns_code
    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> None:
        self._transfer(target_hostname, TransferRequest.build(OP_WRITE, buffers, peer_buffer_addresses, lengths))

    @_returns_code
    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> None:
        self._transfer(target_hostname, TransferRequest.build(OP_READ, buffers, peer_buffer_addresses, lengths))

    def _session(self, target: str) -> Session:
        sessions = self._engine._require_sessions()
        session = sessions.peek(target)
        if session is None:
            session = self._run(sessions.get(target))
        return session

    def _transfer(self, target: str, req: TransferRequest) -> None:
        if not self._initialized:
            raise errors.EngineStateError("engine not initialized")
        if req.count == 0:
            return
        session = self._session(target)
        config = self._engine.config
        rc, why = req.run(session, config)
        if needs_refresh(rc):
            session = self._run(self._engine._require_sessions().refresh(target, session))
            rc, why = req.run(session, config)
        if rc != 0:
            raise errors.error_for_code(rc, f"{opcode_name(req.opcode)} to {target} failed: {why}")
