"""``TransferEngine``: the drop-in for ``mooncake.engine.TransferEngine`` (sync, int returns).

A private event loop in a daemon thread runs the async engine's control plane.  Transfers to an
already-open session skip that loop entirely: the calling thread goes straight into the C core
(GIL released), so many threads can transfer at once without queueing behind each other.
Every method returns Mooncake's value: 0 (or a result) on success, Mooncake's failure value on
failure, with the reason logged on the ``flagcx_mc`` logger.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import (
    Any,
    TypeVar,
)

from .. import errors
from .._core import as_u64_list
from ..config import EngineConfig
from ..names import TransferNotify, TransferOpcode
from .async_engine import AsyncTransferEngine
from .requests import (
    OP_READ,
    OP_WRITE,
    RemoteDesc,
    SingleTransfer,
    TransferRequest,
    check_notify,
    mooncake_opcode,
)
from .sessions import Session, SessionCache
from .state import EngineState

__all__ = ["TransferEngine"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Upper bound for control-plane calls made from the caller's thread (handshakes have their own,
# shorter timeouts; this only guards against a wedged loop thread).
_CONTROL_TIMEOUT = 120.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


class _LoopThread:
    """The engine's private event loop in a daemon thread, and the calls waiting on it.

    Stopping it fails every call still waiting (``EngineStateError``) instead of leaving it
    blocked on a loop that will never answer."""

    def __init__(self) -> None:
        loop = self.loop = _new_loop()
        self._lock = threading.Lock()
        self._waiting: set[Future] = set()
        self._stopped = False
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self.thread = threading.Thread(target=main, name="flagcx-mc-loop", daemon=True)
        self.thread.start()
        ready.wait()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise errors.EngineStateError("TransferEngine methods cannot be called from its own loop thread")
        with self._lock:
            if self._stopped:
                coro.close()
                raise errors.EngineStateError("engine closed")
            future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._waiting.add(future)
        try:
            return future.result(timeout)
        except CancelledError:
            raise errors.EngineStateError("engine closed during the call") from None
        except FutureTimeoutError:
            if future.done():  # the call's own error (TransferTimeoutError is a TimeoutError too)
                raise
            future.cancel()
            raise errors.EngineStateError(f"the engine's loop did not finish the call within {timeout} s") from None
        finally:
            with self._lock:
                self._waiting.discard(future)

    def stop(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``last`` (the engine's shutdown) on the loop, then stop it and fail what waits.
        From the loop's own thread (a finalizer can run there) nothing can be waited for: the
        shutdown is scheduled and the loop stops after it."""
        loop = self.loop
        if threading.current_thread() is self.thread:
            with self._lock:
                self._stopped = True
            if last is not None:
                task = loop.create_task(last)
                task.add_done_callback(lambda _: loop.stop())
            else:
                loop.stop()
            return
        try:
            if last is not None:
                self.run(last, _CONTROL_TIMEOUT)
        finally:
            with self._lock:
                self._stopped = True
                waiting, self._waiting = list(self._waiting), set()
            for future in waiting:
                future.cancel()
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # already closed
                return
            self.thread.join(5)
            if not self.thread.is_alive():
                loop.close()


def _shut_down(state: EngineState, holder: list) -> None:
    """Stop an engine's state and its loop thread (``close()``, or the facade's finalizer)."""
    loop_thread = holder[0] if holder else None
    if loop_thread is None:
        return
    holder.clear()
    loop_thread.stop(None if state.closed else state.stop())


_CODE = object()  # "fail with the error's own negative code"


def _failed(name: str, exc: BaseException, value: Any = _CODE) -> Any:
    """Log why ``name`` failed and return Mooncake's failure value for it."""
    if isinstance(exc, errors.FlagcxMcError):
        log.error("%s failed: %s", name, exc)
        return exc.code if value is _CODE else value
    log.error("%s failed unexpectedly", name, exc_info=exc)
    return -1 if value is _CODE else value


def _on_failure(value: Any = _CODE) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn exceptions into Mooncake's failure value (by default the error's code) and log why.
    (The four synchronous transfer methods inline this: the wrapper's call costs a microsecond.)"""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                return _failed(fn.__name__, exc, value)

        return wrapper

    return decorate


_code = _on_failure()


class TransferEngine:
    """Mooncake-compatible synchronous engine; safe to call from many threads at once."""

    TransferOpcode = TransferOpcode

    def __init__(self, **config: Any) -> None:
        self._state = EngineState(EngineConfig.from_env(**config))
        self._engine = AsyncTransferEngine.over(self._state)  # the coroutines, run on the private loop
        self._config = self._state.config
        self._calls_in_core = self._state.calls_in_core
        self._loop_thread: list = []  # [_LoopThread] once started; shared with the finalizer
        self._start_lock = threading.Lock()
        self._initialized = False
        self._sessions: SessionCache | None = None  # the state's, once initialized: the fast path's
        # Code written for Mooncake never closes an engine: dropping the last reference does.
        self._finalizer = weakref.finalize(self, _shut_down, self._state, self._loop_thread)

    # ------------------------------------------------------------------ private loop

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = _CONTROL_TIMEOUT) -> T:
        holder = self._loop_thread
        if not holder:
            coro.close()
            raise errors.EngineStateError("engine closed" if self._state.closed else "engine not initialized")
        return holder[0].run(coro, timeout)

    def _call_timeout(self, total_bytes: int) -> float:
        """How long a transfer's caller waits for the loop: the transfer's deadline, a refresh
        handshake and a margin (close() fails the wait sooner)."""
        return self._config.timeout_for(total_bytes) + 2 * self._config.handshake_timeout + 5.0

    def _batches_timeout(self, batch_ids: Sequence[int]) -> float:
        """Until the latest of these batches' deadlines, plus a margin."""
        return self._state.batches.latest_remaining(batch_ids) + 5.0

    def _vector_timeout(self, sizes: Sequence[int]) -> float:
        try:
            total = sum(as_u64_list(sizes, "sizes"))
        except errors.FlagcxMcError:
            total = 0  # the call itself reports the bad argument
        return self._call_timeout(total)

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /) -> int:
        """Start the engine; 0 on success, -1 on failure (Mooncake's convention)."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str, /) -> int:
        with self._start_lock:
            if self._initialized:
                log.error("initialize failed: engine already initialized")
                return -1
            if self._state.closed:
                log.error("initialize failed: engine closed")
                return -1
            try:
                if not self._loop_thread:
                    self._loop_thread.append(_LoopThread())
                self._run(self._engine.initialize_ext(local_hostname, metadata_server, protocol, device_name,
                                                      metadata_type))
            except errors.FlagcxMcError as exc:
                log.error("initialize failed: %s", exc)
                return -1
            except Exception:
                log.exception("initialize failed unexpectedly")
                return -1
            self._sessions = self._state.require_sessions()
            self._initialized = True
            return 0

    def close(self) -> None:
        """Shut the engine down (not in Mooncake's API; its destructor does this)."""
        with self._start_lock:
            self._initialized = False
            self._finalizer()  # stops the state and the loop thread, once

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_rpc_port(self, /) -> int:
        """The handshake port peers dial; the session name is f"{host}:{port}"."""
        return self._state.rpc_port if self._initialized else -1

    @property
    def session_name(self) -> str:
        return self._engine.session_name

    def stats(self) -> dict:
        return self._engine.stats()

    def get_engine(self) -> None:
        log.error("get_engine failed: Mooncake's InnerTransferEngine (Store, mooncake.pg) does not exist here")
        return None

    def get_engine_ptr(self, /) -> int:
        log.error("get_engine_ptr failed: there is no C++ TransferEngine object to point at")
        return 0

    @_on_failure("")
    def get_local_topology(self, device_name: str | None = None) -> str:
        return self._run(self._engine.get_local_topology(device_name))

    # ------------------------------------------------------------------ memory

    @_code
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        self._run(self._engine.register_memory(buffer_addr, capacity, location))
        return 0

    @_code
    def unregister_memory(self, buffer_addr: int, /) -> int:
        self._run(self._engine.unregister_memory(buffer_addr))
        return 0

    @_code
    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        self._run(self._engine.batch_register_memory(buffer_addresses, capacities, location))
        return 0

    @_code
    def batch_unregister_memory(self, buffer_addresses: Sequence[int], /) -> int:
        self._run(self._engine.batch_unregister_memory(buffer_addresses))
        return 0

    @_on_failure(0)
    def allocate_managed_buffer(self, length: int, /) -> int:
        return self._run(self._engine.allocate_managed_buffer(length))

    @_code
    def free_managed_buffer(self, buffer_addr: int, length: int, /) -> int:
        self._run(self._engine.free_managed_buffer(buffer_addr, length))
        return 0

    @_code
    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int, /) -> int:
        self._run(self._engine.write_bytes_to_buffer(dest_address, src_ptr, length))
        return 0

    @_on_failure(b"")
    def read_bytes_from_buffer(self, source_address: int, length: int, /) -> bytes:
        return self._run(self._engine.read_bytes_from_buffer(source_address, length))

    # ------------------------------------------------------------------ synchronous transfers

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        try:
            return self._transfer(target_hostname,
                                  TransferRequest.single(OP_WRITE, buffer, peer_buffer_address, length))
        except Exception as exc:
            return _failed("transfer_sync_write", exc)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        try:
            return self._transfer(target_hostname,
                                  TransferRequest.single(OP_READ, buffer, peer_buffer_address, length))
        except Exception as exc:
            return _failed("transfer_sync_read", exc)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        try:
            return self._transfer(target_hostname,
                                  TransferRequest.build(OP_WRITE, buffers, peer_buffer_addresses, lengths))
        except Exception as exc:
            return _failed("batch_transfer_sync_write", exc)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        try:
            return self._transfer(target_hostname,
                                  TransferRequest.build(OP_READ, buffers, peer_buffer_addresses, lengths))
        except Exception as exc:
            return _failed("batch_transfer_sync_read", exc)

    @_code
    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: int, notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    @_code
    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int,
                            notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        check_notify(notify)
        req = TransferRequest.build(mooncake_opcode(opcode), buffers, peer_buffer_addresses, lengths)
        self._transfer(target_hostname, req)
        if notify is not None:
            self._run(self._engine.send_notify(target_hostname, notify))
        return 0

    def _transfer(self, target: str, req: TransferRequest | SingleTransfer) -> int:
        """The fast path: an open, healthy session and a first try that works cost one dict
        lookup and two core calls (health, transfer); the core counts the call.  Anything else
        goes to _transfer_slowly, which opens or refreshes the session and raises the error."""
        if not self._initialized:
            raise errors.EngineStateError("engine not initialized")
        if req.count == 0:
            return 0
        assert self._sessions is not None  # set before _initialized, never cleared
        session = self._sessions.peek(target)
        if session is None:
            return self._transfer_slowly(target, req, None, 0, "")
        rc, why = self._run_in_core(req, session)
        if rc == 0:
            return 0
        return self._transfer_slowly(target, req, session, rc, why)

    def _run_in_core(self, req: TransferRequest | SingleTransfer, session: Session) -> tuple[int, str]:
        """``req.run`` in this thread, counted in ``calls_in_core`` so that close() frees the
        core only once no thread is inside it."""
        inside = self._calls_in_core
        inside.append(None)
        try:
            if self._state.closed:
                raise errors.EngineStateError("engine closed")
            return req.run(session, self._config)
        finally:
            inside.pop()

    def _transfer_slowly(self, target: str, req: TransferRequest | SingleTransfer, session: Session | None,
                         rc: int, why: str) -> int:
        """Finish a call the fast path could not: ``session`` None means no usable session yet,
        else ``rc``/``why`` are its first try's result."""
        with self._state.metrics.failure_counted(target, req.opcode == OP_WRITE, req.total_bytes):
            if session is None:
                session = self._run(self._state.require_sessions().get(target))
                rc, why = self._run_in_core(req, session)
            self._run(self._state.settle(target, req, session, rc, why), timeout=self._call_timeout(req.total_bytes))
            return 0

    # ------------------------------------------------------------------ asynchronous batches

    @_on_failure(0)
    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self._run(self._engine.batch_transfer_async_write(target_hostname, buffers, peer_buffer_addresses,
                                                                 lengths))

    @_on_failure(0)
    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._run(self._engine.batch_transfer_async_read(target_hostname, buffers, peer_buffer_addresses,
                                                                lengths))

    @_on_failure(0)
    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int:
        return self._run(self._engine.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths,
                                                           opcode))

    @_on_failure(0)
    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        return self._run(self._engine.transfer_submit_write(target_hostname, buffer, peer_buffer_address, length))

    @_on_failure(-1)
    def get_batch_transfer_status(self, batch_ids: Sequence[int], /) -> int:
        self._run(self._engine.get_batch_transfer_status(batch_ids), timeout=self._batches_timeout(batch_ids))
        return 0

    def transfer_check_status(self, batch_id: int, /) -> int:
        """1 completed, 0 in progress, -1 failed, -2 timed out (Mooncake's values)."""
        try:
            return self._run(self._engine.transfer_check_status(batch_id))
        except errors.TransferTimeoutError as exc:
            log.error("transfer_check_status: %s", exc)
            return -2
        except errors.FlagcxMcError as exc:
            log.error("transfer_check_status: %s", exc)
            return -1

    # ------------------------------------------------------------------ FlagCX-style low-level API

    @_on_failure(None)
    def get_conn(self, session_name: str) -> Session:
        sessions = self._state.require_sessions()
        session = sessions.peek(session_name) or self._run(sessions.get(session_name))
        session.pinned = True  # the application holds it: never released for idleness
        return session

    def make_desc(self, conn: Session, remote_addr: int, size: int) -> RemoteDesc:
        """Raises AddressNotRegisteredError when no remote region holds the range."""
        return self._engine.make_desc(conn, remote_addr, size)

    @_on_failure(0)
    def write_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                     sizes: Sequence[int]) -> int:
        return self._run(self._engine.write_vector(conn, local_addrs, descs, sizes))

    @_on_failure(0)
    def read_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                    sizes: Sequence[int]) -> int:
        return self._run(self._engine.read_vector(conn, local_addrs, descs, sizes))

    def xfer_status(self, xfer_id: int) -> int:
        return self.transfer_check_status(xfer_id)

    @_code
    def write_vector_sync(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                          sizes: Sequence[int]) -> int:
        self._run(self._engine.write_vector_sync(conn, local_addrs, descs, sizes), timeout=self._vector_timeout(sizes))
        return 0

    @_code
    def read_vector_sync(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                         sizes: Sequence[int]) -> int:
        self._run(self._engine.read_vector_sync(conn, local_addrs, descs, sizes), timeout=self._vector_timeout(sizes))
        return 0

    # ------------------------------------------------------------------ segments, probes, notifies

    @_on_failure(0)
    def get_first_buffer_address(self, segment_name: str, /) -> int:
        return self._run(self._engine.get_first_buffer_address(segment_name))

    @_code
    def send_probe(self, peer_server_name: str) -> int:
        self._run(self._engine.send_probe(peer_server_name))
        return 0

    def get_notifies(self, /) -> list[TransferNotify]:
        return self._engine.get_notifies()

    def warmup_efa_segment(self, segment_name: str) -> int:
        return 0

    def transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        """Mooncake raises RuntimeError when it cannot; so do we (NotSupportedError is one)."""
        raise errors.NotSupportedError("the *_on_cuda methods need the CUDA data path, which this build lacks")

    transfer_read_on_cuda = batch_transfer_write_on_cuda = batch_transfer_read_on_cuda = transfer_write_on_cuda
