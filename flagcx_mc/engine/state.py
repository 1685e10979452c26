"""``EngineState``: what an initialized engine holds, how it starts and stops, and the few
operations both facades share.

``AsyncTransferEngine`` and ``TransferEngine`` are two faces of one ``EngineState``: the async
facade awaits its coroutines on the caller's loop; the sync facade runs them on a private loop
and, for transfers to an open session, calls ``sessions`` and ``settle`` straight from the
calling thread.  Nothing outside this module touches the runtime objects it owns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .. import errors
from .._core import CoreBatch, CoreEngine
from ..config import EngineConfig
from ..control.auth import guard_handlers
from ..control.handshake import HandshakeServer
from ..control.local_segment import LocalSegment
from ..control.resolvers import P2PResolver, StoreResolver
from ..metadata.connect import open_store, parse_metadata_server
from ..names import TransferNotify
from ..net.addresses import format_host_port, parse_host_port
from .batches import BatchTable
from .cancels import Cancels
from .coalesce import Coalescer, cancel_in_group
from .completions import Completions
from .managed import ManagedPool
from .metrics import EngineMetrics
from .requests import OP_WRITE, SingleTransfer, TransferRequest, needs_refresh, opcode_name
from .sessions import Session, SessionCache

__all__ = ["EngineState"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_LOG_DRAIN_INTERVAL = 1.0
_MAX_QUEUED_NOTIFIES = 65536
# On one host a transfer's copy runs inside submit: up to this many bytes it is short enough to
# run on the event loop; larger ones take an executor thread (the core's limit for "small").
INLINE_COPY_BYTES = 256 << 10
# How long the loop may wait for a lone small call's answer before handing it to the poller:
# a hand-off costs two thread wake-ups (~100 us on a loaded 2-core VM), more than a loopback
# round trip even under load, so waiting is cheaper for the loop too.
LONE_POLL_US = 150
POLL_RETRY_S = 0.005


class EngineState:
    """The runtime of one engine.  Attributes the facades read: ``config``, ``metrics``,
    ``batches``, ``notifies``, ``store`` (a ``StoreResolver`` with a metadata server, else
    ``None``), ``name``, ``rpc_port``; ``core``, ``sessions`` and ``managed`` through the
    ``require_*`` methods, which raise ``EngineStateError`` before ``start`` and after ``stop``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.metrics = EngineMetrics()
        self.batches = BatchTable()
        self.notifies: collections.deque[TransferNotify] = collections.deque(maxlen=_MAX_QUEUED_NOTIFIES)
        self.store: StoreResolver | None = None
        self.host = ""
        self.name = ""
        self.rpc_port = 0
        self.closed = False
        # One entry per thread inside the core outside the wait executor (the sync facade's
        # calling threads): list.append and list.pop are atomic, so entering costs ~50 ns.
        # Stopping waits for it to empty before freeing the core.
        self.calls_in_core: list = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the engine started on
        self._core: CoreEngine | None = None
        self._server: HandshakeServer | None = None
        self._sessions: SessionCache | None = None
        self._segment: LocalSegment | None = None
        self._managed: ManagedPool | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._completions: Completions | None = None
        self._cancels: Cancels | None = None
        self._coalescer: Coalescer | None = None
        self._awaiting = 0  # transfers handed to the poller, not yet back
        self._poll_again_at = 0.0  # perf_counter() from which calls poll on the loop again
        self._log_task: asyncio.Task | None = None
        self._publish_lock = asyncio.Lock()  # orders updates of our descriptor on a metadata server

    # ------------------------------------------------------------------ lifecycle

    async def start(self, local_hostname: str, metadata_server: str, protocol: str, metadata_type: str) -> None:
        """Start the core, the handshake server and (with a metadata server) publish ourselves.

        A failed start leaves nothing behind: it may be called again."""
        if self._core is not None or self.closed:
            raise errors.EngineStateError("engine already initialized" if self._core else "engine closed")
        kind, url = parse_metadata_server(metadata_server, metadata_type)
        if protocol not in ("tcp", ""):
            log.info("protocol %r requested: this build moves data over its native TCP transport", protocol)
        host, _ = parse_host_port(local_hostname, default_port=12001)  # the port is ignored, as in Mooncake
        if kind != "p2p":
            host = self.config.advertise_host or await _resolvable_host(host)
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._executor = ThreadPoolExecutor(self.config.wait_threads, thread_name_prefix="flagcx-mc-wait")
        self._completions = Completions(loop, lambda: self._executor, self._batches_ended, self._wait_batch_end)
        self._cancels = Cancels(loop, lambda: self._executor)
        self._coalescer = Coalescer(loop, self._start_one, self._start_group, self._hand_over, self._deadline,
                                    self._record_calls)
        low, high = self.config.data_port_range or self.config.rpc_port_range
        try:
            store = (open_store(kind, url, timeout=self.config.handshake_timeout,
                                settings=self.config.store_settings()) if kind != "p2p" else None)
            self._core = await loop.run_in_executor(self._executor, CoreEngine, host, low, high, self.config)
            secret = self.config.secret
            if secret is not None:
                self._core.set_secret(secret)
            self._core.accept_mooncake_wire(self.config.accept_mooncake_wire)
            self._segment = LocalSegment(self._core, self.notifies, self._shared_mappings,
                                         self.config.handshake_max_length)
            self._server = HandshakeServer(guard_handlers(self._segment.handlers(), secret),
                                           max_length=self.config.handshake_max_length)
            self.rpc_port = await self._server.start(host, None, port_range=self.config.rpc_port_range)
            self.host = host
            # P2P: the name is host:rpc_port.  With a metadata server it is local_hostname verbatim.
            self.name = format_host_port(host, self.rpc_port) if store is None else local_hostname
            self._segment.name = self.name
            if store is None:
                resolver: Any = P2PResolver(self._segment.request_json, self.config.handshake_timeout, secret,
                                            self.config.handshake_max_length)
            else:
                resolver = self.store = StoreResolver(store, cluster_id=self.config.metadata_cluster_id)
                await self.store.publish(self.name, host, self.rpc_port, self._segment.desc_json())
        except BaseException:
            await self._teardown()
            self._server = self._segment = None
            self.host, self.name, self.rpc_port = "", "", 0
            raise
        self._managed = ManagedPool(self._core.register, self._core.unregister)
        self._sessions = SessionCache(self._core, self.config, self._executor, resolver, self.metrics)
        self._log_task = loop.create_task(self._drain_core_log())
        log.info("engine %s up (data port %d%s)", self.name, self._core.data_port,
                 "" if store is None else f", metadata server {url}")

    async def stop(self) -> None:
        """Withdraw from the metadata server, close sessions and servers, free the core
        (idempotent)."""
        if self.closed:
            return
        self.closed = True
        await self._teardown()

    async def _teardown(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            await store.withdraw(self.name)
            await store.close()
        if self._log_task is not None:
            self._log_task.cancel()
            self._log_task = None
        if self._server is not None:
            await self._server.close()
        if self._sessions is not None:
            await self._sessions.close()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            loop = asyncio.get_running_loop()
            await _off_loop(loop, self.batches.cancel_all)
            self._end_lingering()
            await _off_loop(loop, executor.shutdown, True)
        drained = await self._calls_drained()
        self._free(drained)

    async def _calls_drained(self) -> bool:
        """Wait until no calling thread is inside the core (their sessions are closed by now, so
        each fails within moments), at most one transfer timeout."""
        deadline = time.monotonic() + self.config.transfer_timeout
        while self.calls_in_core and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return not self.calls_in_core

    def _end_lingering(self) -> None:
        """The poller stops waiting for the next batch (it ends once nothing is pending)."""
        if self._completions is not None:
            self._completions.close()
        if self._core is not None:
            self._core.wake_end_waiters()

    def _in_core(self, call: Callable[[CoreEngine], T], closed: T) -> T:
        """``call(core)`` counted in ``calls_in_core``, so that the core is not freed under it
        (the poller's calls, from its executor thread); ``closed`` once the engine is closing."""
        inside = self.calls_in_core
        inside.append(None)
        try:
            core = self._core
            return closed if self.closed or core is None else call(core)
        finally:
            inside.pop()

    def _batches_ended(self) -> int | None:
        """The core's count of ended batches, for the poller (None once the engine is closed)."""
        return self._in_core(CoreEngine.batches_ended, None)

    def _wait_batch_end(self, seen: int, seconds: float) -> bool:
        """The poller between batches: wait in the core until a batch ends after ``seen``; False
        if the time ran out or the engine is closing."""
        return self._in_core(lambda core: core.wait_batch_end(seen, max(1, int(seconds * 1000))), False)

    def _free(self, drained: bool) -> None:
        if self._managed is not None:
            self._managed.close()
            self._managed = None
        if self._core is not None:
            core, self._core = self._core, None
            if drained:
                core.close()
            else:  # freeing it under a thread still inside would be a use after free
                log.error("%s: a call is still inside the core after the transfer timeout; its memory is kept",
                          self.session_name)

    def abandon(self) -> None:
        """The application dropped its last reference without ``close()`` (Mooncake's API has
        none): stop the engine as ``close()`` would, from any thread, without blocking.  On the
        engine's loop if it still runs; otherwise what can be released without one (the core,
        which stops serving peers and fences the registered memory, the sessions, the executor)."""
        if self.closed or self._core is None:
            return
        loop = self.loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(_stop_in_background, self)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self.closed = True
        log.warning("%s: engine dropped without close() after its event loop ended; closing what remains",
                    self.session_name)
        if self._server is not None:
            self._server.close_without_loop()
        if self._sessions is not None:
            for session in list(self._sessions.open_sessions()):
                session.close()
        self.batches.cancel_all()
        self._end_lingering()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        deadline = time.monotonic() + self.config.transfer_timeout
        while self.calls_in_core and time.monotonic() < deadline:
            time.sleep(0.001)
        self._free(not self.calls_in_core)

    # ------------------------------------------------------------------ access

    @property
    def session_name(self) -> str:
        return self.name or format_host_port(self.host, self.rpc_port)

    @property
    def initialized(self) -> bool:
        return self._core is not None

    def require_core(self) -> CoreEngine:
        if self._core is None:
            raise errors.EngineStateError("engine closed" if self.closed else "engine not initialized")
        return self._core

    def require_sessions(self) -> SessionCache:
        self.require_core()
        assert self._sessions is not None
        return self._sessions

    def require_managed(self) -> ManagedPool:
        self.require_core()
        assert self._managed is not None
        return self._managed

    def is_managed(self, addr: int) -> bool:
        return self._managed is not None and addr in self._managed.shared_mappings()

    def stats(self) -> dict:
        core = self.require_core()
        grouped = self._coalescer
        assert grouped is not None  # made before the core
        return {**core.stats(), "session": self.session_name, "rpc_port": self.rpc_port, "data_port": core.data_port,
                "call_groups": grouped.groups, "grouped_calls": grouped.grouped_calls, **self.metrics.snapshot()}

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the engine's wait executor: blocking core calls never block the loop.

        A blocking call cannot be abandoned half-way: if the awaiting task is cancelled (a
        ``task.cancel()``, an ``asyncio.wait_for`` timeout), the call is still waited for (its
        own deadline bounds it), and only then does ``CancelledError`` propagate.  So nothing
        more touches either side's buffers once it returns.  Batches started from the loop are
        cancelled in the core instead (``stop_in_core``)."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await _finish(future)
            raise

    # ------------------------------------------------------------------ transfers

    def join(self, target: str, req: TransferRequest | SingleTransfer,
             session: Session) -> tuple[asyncio.Future, Any] | None:
        """Over TCP, a call from the loop joins the open group of its peer and opcode
        (``Coalescer``): calls that coroutines start in the same turn of the loop go out together
        as a batch.  Returns the call's future of ``(rc, reason)`` (a success is counted by the
        coalescer) and its group, to pass to ``left_group`` if the awaiting task is cancelled;
        None: start the call with ``transfer``.  A plain method, not a coroutine: it runs once
        per call, and a coroutine frame more is a measurable share of a small call's cost."""
        if session.same_host:
            return None
        assert self._coalescer is not None
        return self._coalescer.join(target, session, req)

    async def left_group(self, group: Any, future: asyncio.Future) -> None:
        """The call of ``group`` awaiting ``future`` was cancelled: cancel its own tasks of the
        group's batch (the other calls go on) and return once nothing touches its buffers."""
        stop = cancel_in_group(group, future)
        if stop is not None:
            await self.stop_in_core(stop)

    async def stop_in_core(self, stop: Callable[[], Any]) -> None:
        """Run a blocking cancel of the core (``CoreBatch.cancel``, ``cancel_tasks``) in turn with
        the others (``Cancels``) and return once it has, even through further cancels."""
        assert self._cancels is not None
        await _finish(self._cancels.run(stop))

    async def transfer(self, target: str, req: TransferRequest | SingleTransfer, session: Session) -> tuple[int, str]:
        """A transfer call's first try on ``session`` that did not ``join`` a group:
        ``(rc, reason)``.

        Started from the loop thread, which does not block long: over TCP the core only queues
        the batch or sends a small one as far as the socket takes it at once; on one host it
        copies inside the call, so only copies of up to ``INLINE_COPY_BYTES`` run here and larger
        ones in the executor.  A small call started on its own keeps the loop for up to
        ``LONE_POLL_US`` (none where the engine's ``spin_us`` is 0): its answer is then read here
        and the call costs no thread hop.  Calls that have not ended are awaited through
        ``Completions``.  A cancelled call cancels its batch in the core (which cuts the
        connections carrying it) and waits for that before ``CancelledError`` propagates, so
        nothing touches its buffers after it returns."""
        if session.same_host and req.total_bytes > INLINE_COPY_BYTES:
            return await self.run_blocking(req.run, session, self.config)  # the core counts a success
        started = time.perf_counter()
        rc, why, batch = self._start_one(session, req)
        return (rc, why) if batch is None else await self._await_alone(target, req, batch, started)

    def _start_one(self, session: Session, req: TransferRequest | SingleTransfer) -> tuple[int, str, CoreBatch | None]:
        """Start one call from the loop: ``(rc, why, None)`` if it ended here (a success is
        counted by the core), else ``(0, "", batch)`` in flight.

        Polling serialises the coroutines' calls, which on a few cores still beats handing
        them to the sender, receiver and poller threads (measured: 16 and 64 coroutines of
        4 KiB calls 1.3-1.8x faster).  Once a poll has run out while other calls are waiting
        (a slow peer, large calls, a busy host), calls go to the threads until the loop's
        calls drain or POLL_RETRY_S has passed: a failed poll costs the loop LONE_POLL_US."""
        return self._polled(req.start, session)

    def _start_group(self, session: Session, req: TransferRequest) -> tuple[int, str, CoreBatch | None]:
        """``_start_one`` of several calls merged into ``req``; the core does not count it (the
        facade counts each call).  A group of up to 256 KiB is polled for like a lone small call
        (16 coroutines of 4 KiB: 1.6x the calls/s of leaving it to the poller on 16 cores); the
        core never polls for a larger one."""
        return self._polled(session.peer.start_group, req.opcode, req.count, req.packed)

    def _polled(self, start: Callable[..., tuple[int, str, CoreBatch | None]],
                *args: Any) -> tuple[int, str, CoreBatch | None]:
        """``start(*args, poll_us)``, polling on the loop unless a poll ran out lately with
        calls waiting."""
        started = time.perf_counter()
        poll_us = LONE_POLL_US if self._awaiting == 0 or started >= self._poll_again_at else -1
        rc, why, batch = start(*args, poll_us)
        if poll_us > 0 and batch is not None:
            self._poll_again_at = started + POLL_RETRY_S
        return rc, why, batch

    def _record_calls(self, target: str, opcode: int, calls: int, nbytes: int, seconds: float) -> None:
        self.metrics.record(target, opcode == OP_WRITE, nbytes, seconds, True, calls)

    def _deadline(self, nbytes: int) -> float:
        return time.monotonic() + self.config.timeout_for(nbytes)

    def _hand_over(self, batch: CoreBatch, deadline: float) -> asyncio.Future:
        """The poller's future of ``batch``'s ``(rc, why)``, counted in ``_awaiting`` until it
        resolves."""
        assert self._completions is not None
        future = self._completions.wait(batch, deadline)
        self._awaiting += 1
        future.add_done_callback(self._handed_back)
        return future

    def _handed_back(self, _future: asyncio.Future) -> None:
        self._awaiting -= 1

    async def _await_alone(self, target: str, req: TransferRequest | SingleTransfer, batch: CoreBatch,
                           started: float) -> tuple[int, str]:
        """The outcome of a call started alone (at ``perf_counter()`` ``started``) that did not
        end on the loop, through the poller."""
        future = self._hand_over(batch, self._deadline(req.total_bytes))
        try:
            outcome = await asyncio.shield(future)  # (rc, why)
        except asyncio.CancelledError:
            # Cut what carries it now rather than wait for its deadline; the cancel returns once
            # nothing touches its buffers, and the poller then resolves the batch at once.
            await self.stop_in_core(batch.cancel)
            await _finish(future)
            raise
        if outcome[0] == 0:  # batches ended by the poller are not counted by the core: count here
            self._record_calls(target, req.opcode, 1, req.total_bytes, time.perf_counter() - started)
        return outcome

    async def submit_batch(self, req: TransferRequest | SingleTransfer, session: Session) -> CoreBatch:
        """Start an asynchronous batch (``batch_transfer_async_*``, vectors) from the loop: over
        TCP the core only queues it; on one host it copies inside submit, so copies larger than
        ``INLINE_COPY_BYTES`` go to the executor.  Raises for ranges outside registered memory."""
        if session.same_host and req.total_bytes > INLINE_COPY_BYTES:
            return await self.run_blocking(req.submit, session)
        return req.submit(session)

    async def batch_outcomes(self, waits: list[tuple[CoreBatch, float]]) -> list[tuple[int, str]]:
        """``(rc, why)`` of each ``(batch, deadline)``: those already ended at once, the others
        through the poller, which cancels a batch at its deadline (timeout code).  If the caller
        is cancelled, the batches still running are cancelled and waited for before
        ``CancelledError`` propagates: nothing touches their buffers afterwards."""
        assert self._completions is not None
        futures = [self._completions.outcome(batch, deadline) for batch, deadline in waits]
        self._awaiting += 1
        try:
            return [await asyncio.shield(future) for future in futures]
        except asyncio.CancelledError:
            for (batch, _), future in zip(waits, futures, strict=True):
                if not future.done():
                    await self.stop_in_core(batch.cancel)
                    await _finish(future)
            raise
        finally:
            self._awaiting -= 1

    async def settle(self, target: str, req: TransferRequest | SingleTransfer, session: Session, rc: int,
                     why: str) -> Session:
        """A call's first try came back ``rc``: try once more on a refreshed region table when
        that can help (memory the peer registered since, or a stale address), then raise what is
        left.  Returns the session the call succeeded on."""
        if session.released and rc == errors.PeerConnectionError.code:  # closed under the call by the sweep
            session = await self.require_sessions().get(target)
            rc, why = await self.run_blocking(req.run, session, self.config)
        if needs_refresh(rc):
            session = await self.require_sessions().refresh(target, session)
            rc, why = await self.run_blocking(req.run, session, self.config)
        if rc != 0:
            raise errors.error_for_code(rc, f"{opcode_name(req.opcode)} to {target} failed: {why}")
        return session

    # ------------------------------------------------------------------ publishing our regions

    async def publish_added(self, undo: Callable[[], Any]) -> None:
        """Publish memory just registered; if the metadata server cannot take it, ``undo`` the
        registration and raise, so the call fails whole and can simply be repeated (peers could
        not have found the memory anyway)."""
        try:
            await self._republish()
        except BaseException:
            try:
                await self.run_blocking(undo)
            except errors.FlagcxMcError as exc:
                log.warning("%s: could not undo a registration the metadata server refused: %s", self.name, exc)
            raise

    async def publish_removed(self) -> None:
        """Publish the table after memory left it.  The memory is gone here whatever the metadata
        server says (our registry refuses anything aimed at it), so a server that cannot take the
        change is logged, not raised; the next update brings it up to date."""
        try:
            await self._republish()
        except errors.FlagcxMcError as exc:
            log.warning("%s: the metadata server still lists unregistered memory until the next update: %s",
                        self.name, exc)

    async def _republish(self) -> None:
        """With a metadata server, peers read our regions from it: keep it current.  One update
        at a time, each taking the table as it is when its turn comes: two concurrent updates
        could otherwise land out of order and leave the older table published."""
        if self.store is None:
            return
        async with self._publish_lock:
            if self.store is not None and self._segment is not None:
                await self.store.update(self.name, self._segment.desc_json())

    # ------------------------------------------------------------------ helpers

    def _shared_mappings(self) -> dict:
        return self._managed.shared_mappings() if self._managed is not None else {}

    async def _drain_core_log(self) -> None:
        """Once a second: the core's messages to the log, and the session sweep (sessions.py)."""
        while True:
            await asyncio.sleep(_LOG_DRAIN_INTERVAL)
            if self._core is None:
                return
            for line in self._core.drain_log():
                log.warning("%s: %s", self.session_name, line)
            if self._sessions is not None:
                gone = self._sessions.sweep(self.config.idle_session_timeout)
                if gone:
                    await _off_loop(asyncio.get_running_loop(), _close_all, gone)


def _close_all(sessions: list[Session]) -> None:
    for session in sessions:
        session.close()


async def _off_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` in the loop's default executor, or right here once the interpreter is
    shutting down (an engine dropped without ``close()`` is stopped by its finalizer at exit,
    when no executor takes new work any more)."""
    try:
        future = loop.run_in_executor(None, fn, *args)
    except RuntimeError:
        fn(*args)
        return
    await future


async def _finish(future: asyncio.Future) -> None:
    """Wait for ``future`` to end whatever it returns or raises, even through further cancels."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: its outcome belongs to the cancelled call


_BACKGROUND_STOPS: set = set()  # strong references: a task nobody holds may be collected mid-way


def _stop_in_background(state: EngineState) -> None:
    task = asyncio.get_running_loop().create_task(state.stop())
    _BACKGROUND_STOPS.add(task)
    task.add_done_callback(_BACKGROUND_STOPS.discard)


async def _resolvable_host(name_host: str) -> str:
    """With a metadata server the segment name need not be an address (Mooncake's rule): without
    ``advertise_host`` (``MC_TCP_BIND_ADDRESS``), the name's host if it resolves, else this
    host's name."""
    loop = asyncio.get_running_loop()
    for candidate in (name_host, socket.gethostname()):
        try:
            await loop.getaddrinfo(candidate, None)
            return candidate
        except OSError:
            continue
    raise errors.DnsError("cannot find an address to advertise: set MC_TCP_BIND_ADDRESS")
