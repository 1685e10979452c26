"""ZMQ side channel (``zmq.asyncio``): decode asks for KV blocks, prefill pushes them through the engine.

``KVSender`` runs on each prefill worker: a ROUTER listener on a free port.  The serving code
``publish``-es a request's block ids once its KV is computed; a decode worker's ``xfer`` names the
request, the decode blocks, planes and engine session; the sender plans the triplets
(``layout.plan``), calls the engine's ``batch_transfer_sync_write`` and answers one ``result``
per request.

``KVReceiver`` runs on each decode worker: one DEALER per prefill endpoint.  ``fetch`` returns an
``Outcome`` for every request it was given, always, within ``ttl + grace`` seconds:

- ``done``: prefill answered that the data landed (the engine returned success);
- ``failed``: prefill answered that it could not send (reason from prefill);
- ``rejected``: prefill refused the message (malformed, unknown version) or answered garbage;
- ``disconnected``: the connection to prefill broke (process killed, host gone: ZMQ heartbeats);
- ``timeout``: no answer within ``ttl + grace``;
- ``closed``: the receiver was closed first.

Why the bound is safe to act on: prefill starts no transfer later than ``ttl`` after it received
the message, and an engine call is itself bounded by the engine's transfer timeout, so with
``grace`` at least that timeout, nothing writes into decode blocks once a request timed out.  A
broken or never-established connection is closed with linger 0, so a request that was still
queued in it is never delivered later.  When decode cannot know whether a live prefill is still
writing (``disconnected``, ``closed``), ``Outcome.quiet_at`` says when the blocks are safe to reuse.
A prefill worker that closes answers every request it holds first (``KVSender.close``).

The engine is passed in: flagcx_mc's ``AsyncTransferEngine`` (awaited), or any object with
Mooncake's synchronous ``batch_transfer_sync_write`` returning 0 / negative (flagcx_mc's
``TransferEngine``, ``mooncake.engine.TransferEngine``), called from a thread pool as vLLM does.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..errors import FlagcxMcError
from .layout import HeadSplit, KVLayout, LayoutError, Triplets, _ids, _tp, plan
from .messages import (
    MAX_MESSAGE_BYTES,
    ErrorReply,
    Message,
    MessageError,
    Ping,
    Pong,
    ReqBlocks,
    Result,
    WorkerKey,
    Xfer,
    decode,
    encode,
    new_id,
)
from .ports import bound_router

__all__ = ["KVSender", "KVReceiver", "Outcome", "Status", "SideChannelError", "DEFAULT_TTL", "DEFAULT_GRACE"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 30.0  # seconds prefill may take to start a request's transfer
DEFAULT_GRACE = 35.0  # covers Mooncake's default 30 s transfer timeout
DEFAULT_HEARTBEAT = 1.0  # seconds between ZMQ heartbeats; 3 missed ones break the connection
BlockIds = Sequence[Any]  # one block-id sequence per layout group


class SideChannelError(FlagcxMcError):
    """A side-channel call was used wrongly (not started, closed, bad arguments)."""


class Status(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"
    REJECTED = "rejected"
    DISCONNECTED = "disconnected"
    TIMEOUT = "timeout"
    CLOSED = "closed"


@dataclass(frozen=True)
class Outcome:
    """How one requested transfer ended, seen from decode.

    ``quiet_at`` is the event-loop time after which no write for the request can land any more.
    It is 0 when that is already so: prefill answered (done, failed, refused the message) or the
    deadline passed (timeout).  After ``disconnected``, ``closed`` or an unreadable answer, a
    prefill that is still alive (a network fault, not a dead process) may be finishing a transfer
    it started: keep the blocks out of use until ``quiet_at``.
    """

    rid: str
    status: Status
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    quiet_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is Status.DONE


def _tune(sock: zmq.Socket, heartbeat: float) -> None:
    ivl = max(int(heartbeat * 1000), 10)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)


def _groups(layout: KVLayout, blocks: BlockIds, rid: str) -> tuple[tuple[int, ...], ...]:
    if len(blocks) != len(layout.groups):
        raise LayoutError(f"request {rid!r}: {len(blocks)} block lists for {len(layout.groups)} layout groups")
    out = []
    for ids, planes in zip(blocks, layout.groups, strict=True):
        ids = _ids(ids, f"request {rid!r} blocks")
        limit = min(p.num_blocks for p in planes)
        if any(b >= limit for b in ids):
            raise LayoutError(f"request {rid!r} names a block beyond the {limit} blocks of its group")
        out.append(tuple(ids))
    return tuple(out)


# ---------------------------------------------------------------------------------- engine


class _TransferFailed(Exception):
    pass


class _Writer:
    """Calls ``batch_transfer_sync_write`` of an async or a Mooncake-style sync engine."""

    def __init__(self, engine: Any, threads: int) -> None:
        self._fn = engine.batch_transfer_sync_write
        self._is_async = inspect.iscoroutinefunction(self._fn)
        self._executor = None if self._is_async else ThreadPoolExecutor(threads, thread_name_prefix="flagcx-mc-kv")

    async def write(self, session: str, t: Triplets) -> None:
        if self._is_async:
            try:
                await self._fn(session, t.src, t.dst, t.lengths)
            except FlagcxMcError as exc:
                raise _TransferFailed(f"{type(exc).__name__} (code {exc.code}): {exc}") from None
            return
        rc = await asyncio.get_running_loop().run_in_executor(self._executor, self._fn, session, t.src, t.dst,
                                                              t.lengths)
        if rc != 0:
            raise _TransferFailed(f"batch_transfer_sync_write returned {rc}")

    async def close(self) -> None:
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)


# ---------------------------------------------------------------------------------- prefill


@dataclass
class _Published:
    blocks: tuple[tuple[int, ...], ...]
    claims_left: int
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = None
    in_flight: int = 0
    all_ok: bool = True


class _Refused(Exception):
    pass


class KVSender:
    """Prefill side: serves decode's ``xfer`` messages for the requests ``publish``-ed here.

    Args:
        engine: initialized engine holding this worker's KV memory (registered).
        layout: this worker's planes.
        tp: (size, rank) of this worker's tensor-parallel group.
        split: how heads split over TP ranks; needed when decode's TP size differs (or to be
            explicit); without it decode must have the same TP size and rank.
        worker: identity answered to ``ping`` (for checks that a port reaches the right worker).
        session: this worker's engine session, answered to ``ping``.
        max_concurrent: engine calls in flight at once (threads, for a sync engine).
        max_ttl: cap, in seconds, on the ttl a decode message may ask for.
        heartbeat: ZMQ heartbeat interval, seconds.
        context: a ``zmq.asyncio.Context`` to share; by default the sender owns one.
    """

    def __init__(self, engine: Any, layout: KVLayout, *, tp: tuple[int, int] = (1, 0),
                 split: HeadSplit | None = None, worker: WorkerKey | None = None, session: str = "",
                 max_concurrent: int = 8, max_ttl: float = 600.0, heartbeat: float = DEFAULT_HEARTBEAT,
                 context: zmq.asyncio.Context | None = None) -> None:
        if max_concurrent < 1 or not max_ttl > 0:
            raise SideChannelError("max_concurrent and max_ttl must be positive")
        self._max_ttl = max_ttl
        self._writer = _Writer(engine, max_concurrent)
        self._layout = layout
        self._tp = _tp(tp, "tp")
        self._split = split
        self._worker = worker
        self._session = session
        self._heartbeat = heartbeat
        self._slots = asyncio.Semaphore(max_concurrent)
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._serve_task: asyncio.Task | None = None
        self._tasks: set = set()
        self._published: dict[str, _Published] = {}
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self._closed = False
        self.endpoint = ""
        self.stats = {"messages": 0, "refused": 0, "done": 0, "failed": 0, "bytes": 0, "triplets": 0}

    # -------------------------------------------------------------- lifecycle

    async def start(self, host: str = "127.0.0.1", advertise: str | None = None) -> str:
        """Bind the listener to a free port on ``host``; returns the endpoint decode dials."""
        if self._sock is not None or self._closed:
            raise SideChannelError("sender already started" if self._sock else "sender closed")
        self._sock, self.endpoint = bound_router(self._ctx, host, advertise, MAX_MESSAGE_BYTES,
                                                 lambda sock: _tune(sock, self._heartbeat))
        self._serve_task = asyncio.get_running_loop().create_task(self._serve())
        return self.endpoint

    async def close(self) -> None:
        """Stop serving, then answer every request already received, and close.

        Requests still waiting for ``publish`` are answered failed at once; transfers already in
        the engine run to their end (bounded by the engine's timeout) and are answered with how
        they ended, so that decode never gives up on a block that is still being written.
        Published requests not fully served resolve to False.
        """
        if self._closed:
            return
        self._closed = True
        if self._serve_task is not None:
            self._serve_task.cancel()
            await asyncio.gather(self._serve_task, return_exceptions=True)
        for waiters in self._waiting.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid in list(self._published):
            self.cancel(rid)
        if self._sock is not None:
            self._sock.close(linger=1000)  # let the last answers leave
        await self._writer.close()
        if self._own_context:
            await asyncio.get_running_loop().run_in_executor(None, self._ctx.term)

    async def __aenter__(self) -> KVSender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def waiting(self) -> int:
        """Requests decode asked for that are not published yet (each waits up to its ttl)."""
        return sum(len(w) for w in self._waiting.values())

    # -------------------------------------------------------------- requests

    def publish(self, rid: str, blocks: BlockIds, *, consumers: int = 1, expire: float = 120.0) -> asyncio.Future:
        """Offer request ``rid``'s blocks (one id list per group) to ``consumers`` decode workers.

        Returns:
            A future: True once every consumer was served successfully; False when a transfer
            failed, the request was cancelled, or ``expire`` seconds passed before all asked.
            Until it resolves the blocks may be read by the engine: free them only then.

        Raises:
            LayoutError: block ids that do not fit the layout.  SideChannelError: ``rid`` is
            already published, or the sender is closed.
        """
        if self._closed:
            raise SideChannelError("sender closed")
        if rid in self._published:
            raise SideChannelError(f"request {rid!r} is already published")
        if consumers < 1:
            raise SideChannelError("consumers must be positive")
        loop = asyncio.get_running_loop()
        entry = _Published(_groups(self._layout, blocks, rid), consumers, loop.create_future())
        entry.timer = loop.call_later(expire, self._end, rid, entry)
        self._published[rid] = entry
        for fut in self._waiting.pop(rid, ()):
            if not fut.done():
                fut.set_result(None)
        return entry.future

    def cancel(self, rid: str) -> bool:
        """Withdraw ``rid``: no new transfer starts; its future resolves False once none is running."""
        entry = self._published.get(rid)
        if entry is None:
            return False
        self._end(rid, entry)
        return True

    def _end(self, rid: str, entry: _Published) -> None:
        if entry.claims_left:
            entry.claims_left = 0
            entry.all_ok = False
        self._settle(rid, entry)

    def _settle(self, rid: str, entry: _Published) -> None:
        if entry.claims_left or entry.in_flight or self._published.get(rid) is not entry:
            return
        del self._published[rid]
        if entry.timer is not None:
            entry.timer.cancel()
        if not entry.future.done():
            entry.future.set_result(entry.all_ok)

    async def _claim(self, rid: str, deadline: float) -> _Published:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise _Refused("the prefill worker is shutting down")
            entry = self._published.get(rid)
            if entry is not None and entry.claims_left:
                entry.claims_left -= 1
                entry.in_flight += 1
                return entry
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _Refused(f"request {rid!r} was not published on this worker within the ttl")
            fut = loop.create_future()
            waiters = self._waiting.setdefault(rid, [])
            waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters and self._waiting.get(rid) is waiters:
                    del self._waiting[rid]

    # -------------------------------------------------------------- serving

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            ident = frames[0]
            self.stats["messages"] += 1
            if len(frames) != 2:
                await self._reply(ident, ErrorReply(None, f"expected one frame, got {len(frames) - 1}"))
                continue
            try:
                msg = decode(frames[1])
            except MessageError as exc:
                self.stats["refused"] += 1
                log.warning("side channel %s: refused a message: %s", self.endpoint, exc.reason)
                await self._reply(ident, ErrorReply(exc.msg_id, exc.reason))
                continue
            if isinstance(msg, Ping):
                await self._reply(ident, Pong(msg.msg_id, self._worker, self._session))
            elif isinstance(msg, Xfer):
                task = asyncio.get_running_loop().create_task(self._serve_xfer(ident, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                self.stats["refused"] += 1
                await self._reply(ident, ErrorReply(msg.msg_id, f"a sender does not answer {msg.type!r} messages"))

    async def _reply(self, ident: bytes, msg: Message) -> None:
        assert self._sock is not None  # only the serving loop and its tasks answer, after start()
        try:
            await self._sock.send_multipart([ident, encode(msg)])
        except zmq.ZMQError as exc:  # socket closed under us: decode's timeout covers it
            log.warning("side channel %s: could not answer: %s", self.endpoint, exc)

    async def _serve_xfer(self, ident: bytes, msg: Xfer) -> None:
        deadline = asyncio.get_running_loop().time() + min(msg.ttl_ms / 1000, self._max_ttl)
        await asyncio.gather(*(self._serve_request(ident, msg, req, deadline) for req in msg.reqs))

    async def _serve_request(self, ident: bytes, msg: Xfer, req: ReqBlocks, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        entry: _Published | None = None
        ok, reason, nbytes = False, "", 0
        try:
            entry = await self._claim(req.rid, deadline)
            triplets = plan(self._layout, msg.layout, entry.blocks, req.blocks, split=self._split,
                            src_tp=self._tp, dst_tp=msg.tp)
            async with self._slots:
                if loop.time() > deadline:
                    raise _Refused("the ttl passed before a transfer slot was free")
                if len(triplets):
                    await self._writer.write(msg.session, triplets)
            ok, nbytes = True, triplets.nbytes
            self.stats["triplets"] += len(triplets)
        except LayoutError as exc:
            reason = f"layouts do not match: {exc}"
        except (_Refused, _TransferFailed) as exc:
            reason = str(exc)
        except Exception as exc:  # a bug here must still answer decode
            log.exception("side channel %s: request %r", self.endpoint, req.rid)
            reason = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            if entry is not None:
                entry.in_flight -= 1
                entry.all_ok = entry.all_ok and ok
                self._settle(req.rid, entry)
        self.stats["done" if ok else "failed"] += 1
        self.stats["bytes"] += nbytes
        if not ok:
            log.warning("side channel %s: request %r failed: %s", self.endpoint, req.rid, reason)
        await self._reply(ident, Result(msg.msg_id, req.rid, ok, reason, nbytes))


# ---------------------------------------------------------------------------------- decode


@dataclass
class _Pending:
    futures: dict[str, asyncio.Future]
    sent: float
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Peer:
    endpoint: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    pending: dict[str, _Pending] = field(default_factory=dict)
    pings: dict[str, asyncio.Future] = field(default_factory=dict)
    connected: bool = False
    task: asyncio.Task | None = None
    closed: bool = False


class KVReceiver:
    """Decode side: asks prefill workers to push requests' blocks, and learns how each ended.

    Args:
        session: this worker's engine session (``host:rpc_port``), where prefill writes.
        layout: this worker's planes (registered with that engine).
        tp: (size, rank) of this worker's tensor-parallel group.
        ttl: seconds prefill may take to start each transfer (sent in the message).
        grace: further seconds before a request times out; at least the prefill engine's
            transfer timeout, so that no write can land after a timeout.
        heartbeat: ZMQ heartbeat interval; a peer silent for 3 intervals counts as disconnected.
        context: a ``zmq.asyncio.Context`` to share; by default the receiver owns one.
    """

    def __init__(self, session: str, layout: KVLayout, *, tp: tuple[int, int] = (1, 0), ttl: float = DEFAULT_TTL,
                 grace: float = DEFAULT_GRACE, heartbeat: float = DEFAULT_HEARTBEAT,
                 context: zmq.asyncio.Context | None = None) -> None:
        if not ttl > 0 or not grace >= 0:
            raise SideChannelError("ttl must be positive and grace non-negative")
        self._session = session
        self._layout = layout
        self._tp = _tp(tp, "tp")
        self._ttl = ttl
        self._grace = grace
        self._heartbeat = heartbeat
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._peers: dict[str, _Peer] = {}
        self._tasks: set = set()
        self._closed = False

    @property
    def deadline(self) -> float:
        """Seconds after which every request has an outcome (``ttl + grace``)."""
        return self._ttl + self._grace

    # -------------------------------------------------------------- public calls

    async def submit(self, endpoint: str, requests: Mapping[str, BlockIds]) -> dict[str, asyncio.Future[Outcome]]:
        """Send one ``xfer`` for ``requests`` (rid -> block ids per group) to one prefill endpoint.

        Returns:
            rid -> future of its ``Outcome``; every future resolves within ``deadline`` seconds
            and never raises.

        Raises:
            LayoutError: block ids that do not fit this worker's layout.  SideChannelError: closed.
        """
        if self._closed:
            raise SideChannelError("receiver closed")
        reqs = tuple(ReqBlocks(str(rid), _groups(self._layout, blocks, str(rid))) for rid, blocks in requests.items())
        if len({r.rid for r in reqs}) != len(reqs):
            raise SideChannelError("request ids must be distinct")
        loop = asyncio.get_running_loop()
        futures = {r.rid: loop.create_future() for r in reqs}
        if not reqs:
            return futures
        msg = Xfer(new_id(), self._session, self._tp, self._layout, reqs, max(int(self._ttl * 1000), 1))
        peer = self._peer(endpoint)
        pending = _Pending(dict(futures), loop.time())
        pending.timer = loop.call_later(self.deadline, self._expire, peer, msg.msg_id)
        peer.pending[msg.msg_id] = pending
        try:
            await peer.sock.send(encode(msg))
        except zmq.ZMQError as exc:
            self._fail(peer, msg.msg_id, Status.DISCONNECTED, f"could not send to {endpoint}: {exc}")
        return futures

    async def fetch(self, endpoints: str | Sequence[str], requests: Mapping[str, BlockIds]) -> dict[str, Outcome]:
        """Ask every endpoint (the prefill ranks that hold this worker's heads) for ``requests``.

        Returns:
            rid -> ``Outcome``: done only when every endpoint answered done.
        """
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise SideChannelError("no endpoint to fetch from")
        per_endpoint = [await self.submit(ep, requests) for ep in endpoints]
        combined: dict[str, Outcome] = {}
        for rid in (str(r) for r in requests):
            outcomes = [await futures[rid] for futures in per_endpoint]
            bad = [(ep, o) for ep, o in zip(endpoints, outcomes, strict=True) if not o.ok]
            combined[rid] = Outcome(
                rid,
                bad[0][1].status if bad else Status.DONE,
                "; ".join(f"{ep}: {o.status.value}: {o.reason}" for ep, o in bad),
                sum(o.nbytes for o in outcomes),
                max(o.seconds for o in outcomes),
                max(o.quiet_at for o in outcomes),
            )
        return combined

    async def ping(self, endpoint: str, timeout: float = 5.0) -> Pong:
        """Round trip to a prefill worker; returns its identity.

        Raises:
            SideChannelError: no answer within ``timeout`` (or the receiver is closed).
        """
        if self._closed:
            raise SideChannelError("receiver closed")
        peer = self._peer(endpoint)
        msg_id = new_id()
        fut = asyncio.get_running_loop().create_future()
        peer.pings[msg_id] = fut
        try:
            await peer.sock.send(encode(Ping(msg_id)))
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            raise SideChannelError(f"no answer to ping from {endpoint} within {timeout} s ({exc!r})") from None
        finally:
            peer.pings.pop(msg_id, None)

    async def close(self) -> None:
        """Close every connection; requests still pending end as ``closed``."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            await self._drop(peer, Status.CLOSED, "receiver closed")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_context:
            self._ctx.destroy(0)

    async def __aenter__(self) -> KVReceiver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -------------------------------------------------------------- peers

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is not None:
            return peer
        sock = self._ctx.socket(zmq.DEALER)
        _tune(sock, self._heartbeat)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise SideChannelError(f"bad endpoint {endpoint!r}: {exc}") from None
        peer = _Peer(endpoint, sock, monitor)
        peer.task = asyncio.get_running_loop().create_task(self._pump(peer))
        self._peers[endpoint] = peer
        return peer

    async def _pump(self, peer: _Peer) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(peer.sock, zmq.POLLIN)
        poller.register(peer.monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if peer.sock in ready:
                    await self._drain(peer)
                if peer.monitor in ready:
                    event = parse_monitor_message(await peer.monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        peer.connected = True
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        await self._drain(peer)  # answers that arrived before the break still count
                        log.log(logging.WARNING if peer.pending else logging.INFO,
                                "side channel: lost connection to %s (%d messages pending)", peer.endpoint,
                                len(peer.pending))
                        await self._drop(peer, Status.DISCONNECTED, f"connection to {peer.endpoint} lost")
                        return
        except asyncio.CancelledError:
            raise
        except Exception:  # never leave requests hanging because this loop broke
            log.exception("side channel: reader for %s failed", peer.endpoint)
            await self._drop(peer, Status.DISCONNECTED, f"reader for {peer.endpoint} failed")

    async def _drain(self, peer: _Peer) -> None:
        while cast(int, peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # EVENTS is an int option
            frames = await peer.sock.recv_multipart()
            self._on_reply(peer, frames[-1])

    def _on_reply(self, peer: _Peer, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except MessageError as exc:
            log.warning("side channel: unreadable reply from %s: %s", peer.endpoint, exc)
            if exc.msg_id in peer.pending:
                self._fail(peer, exc.msg_id, Status.REJECTED, f"unreadable reply: {exc.reason}")
            return
        if isinstance(msg, Result):
            pending = peer.pending.get(msg.msg_id)
            fut = pending.futures.pop(msg.rid, None) if pending else None
            if pending is None or fut is None:
                log.info("side channel: ignoring a result for unknown request %r from %s", msg.rid, peer.endpoint)
                return
            if not fut.done():
                seconds = asyncio.get_running_loop().time() - pending.sent
                fut.set_result(Outcome(msg.rid, Status.DONE if msg.ok else Status.FAILED, msg.reason, msg.nbytes,
                                       seconds))
            if not pending.futures:
                self._forget(peer, msg.msg_id)
        elif isinstance(msg, ErrorReply):
            if msg.msg_id in peer.pending:
                self._fail(peer, msg.msg_id, Status.REJECTED, msg.reason, answered=True)
            else:
                log.warning("side channel: %s refused a message: %s", peer.endpoint, msg.reason)
        elif isinstance(msg, Pong):
            fut = peer.pings.get(msg.msg_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            log.warning("side channel: unexpected %r message from %s", msg.type, peer.endpoint)

    def _forget(self, peer: _Peer, msg_id: str) -> _Pending | None:
        pending = peer.pending.pop(msg_id, None)
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()
        return pending

    def _fail(self, peer: _Peer, msg_id: str, status: Status, reason: str, answered: bool = False) -> None:
        pending = self._forget(peer, msg_id)
        if pending is None:
            return
        now = asyncio.get_running_loop().time()
        quiet_at = 0.0 if answered or status is Status.TIMEOUT else pending.sent + self.deadline
        for rid, fut in pending.futures.items():
            if not fut.done():
                fut.set_result(Outcome(rid, status, reason, 0, now - pending.sent, quiet_at))

    def _expire(self, peer: _Peer, msg_id: str) -> None:
        if not peer.connected:
            # Nothing sent on a socket that never connected was delivered; closing it (linger 0)
            # makes sure nothing will be, so every request queued there can end now.
            task = asyncio.get_running_loop().create_task(
                self._drop(peer, Status.TIMEOUT, f"{peer.endpoint} unreachable for {self.deadline} s"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._fail(peer, msg_id, Status.TIMEOUT, f"no answer from {peer.endpoint} within {self.deadline} s")

    async def _drop(self, peer: _Peer, status: Status, reason: str) -> None:
        if peer.closed:
            return
        peer.closed = True
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        for msg_id in list(peer.pending):
            self._fail(peer, msg_id, status, reason)
        for fut in peer.pings.values():
            if not fut.done():
                fut.set_exception(SideChannelError(reason))
        task = peer.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        peer.sock.disable_monitor()
        peer.monitor.close(0)
        peer.sock.close(0)
