"""Session cache keyed ``"host:port"``: one handshake per peer, shared by every caller.

The first transfer to a session resolves the peer's segment descriptor (a P2PHANDSHAKE Metadata
round trip, or a metadata-server lookup: see resolvers.py) and opens its data streams; concurrent
first transfers await the same task; different peers handshake concurrently.  A broken session is
evicted and re-opened on next use; ``refresh`` re-reads the peer's region table (memory it
registered after first contact).

``sweep`` (once a second, from the engine's loop) closes sessions whose connections broke, so a
peer that went away or restarted leaves no threads or sockets behind, and releases sessions
unused for ``idle_session_timeout``: their connections close and the next call opens them
again.  A call that raced a release (it took the session just before) finds it ``released`` and
is sent again on a new session (``EngineState.settle``), so callers never see the release.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from .. import errors
from .._core import PROTO_MOONCAKE, CoreEngine, CorePeer
from ..config import EngineConfig
from ..control.local_segment import boot_id
from ..control.resolvers import Resolver
from ..metadata.descriptor import SegmentDesc
from .metrics import EngineMetrics

__all__ = ["Session", "SessionCache"]

log = logging.getLogger(__name__)


@dataclass
class Session:
    """An open session: the peer's descriptor and the core's connected peer."""

    name: str
    host: str
    rpc_port: int
    desc: SegmentDesc
    peer: CorePeer
    same_host: bool = False  # the peer's bytes move by process_vm_* here (fixed when the session opens)
    released: bool = False  # closed by the sweep (idle, or broken): a call that still held it goes again
    pinned: bool = False  # handed to the application (get_conn): never released for idleness

    def close(self) -> None:
        self.peer.close()


# Sessions whose data connections are made at once, each on a thread of the engine's executor:
# an engine reaching hundreds of peers at once then holds a few threads for it, not one per peer
# (a connect takes a round trip or two, so a few in parallel keep up with the handshakes).
CONNECTS_AT_ONCE = 4
# A connect still going after this long gives its turn to the next session and goes on beside
# it: a peer whose data port never answers holds one thread until handshake_timeout, not every
# other session's first call as well.  At most a quarter of the wait executor's threads (and 16)
# go to such slow connects, so that peers hanging by the dozen cannot take the threads that wait
# for completions; past that, a slow connect keeps its turn.
SLOW_CONNECT_S = 0.5
SLOW_CONNECTS_MAX = 16


class SessionCache:
    """Open sessions of one engine; lives on the engine's event loop."""

    def __init__(self, core: CoreEngine, config: EngineConfig, executor: Executor, resolver: Resolver,
                 metrics: EngineMetrics) -> None:
        self._core = core
        self._metrics = metrics
        self._config = config
        self._executor = executor
        self._resolver = resolver
        self._open: dict[str, Session] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._reserved: dict[str, int] = {}  # streams of sessions being opened (see _new_peer)
        self._refreshing: dict[str, asyncio.Task] = {}
        self._fallbacks_logged: set = set()
        self._connecting = asyncio.Semaphore(CONNECTS_AT_ONCE)
        self._slow_connects = 0  # connects that gave their turn away (SLOW_CONNECT_S)
        self._slow_connects_max = min(SLOW_CONNECTS_MAX, config.wait_threads // 4)

    def open_sessions(self) -> list:
        """The sessions open now (a snapshot)."""
        return list(self._open.values())

    def peek(self, name: str) -> Session | None:
        """The open, healthy session for ``name`` or None; safe from any thread."""
        session = self._open.get(name)
        if session is not None and session.peer.healthy:
            return session
        return None

    async def get(self, name: str) -> Session:
        """Return the open session, handshaking first if needed (once for concurrent callers)."""
        session = self._open.get(name)
        if session is not None:
            if session.peer.healthy:
                return session
            self.evict(name, session, "its data connection is down")
        task = self._opening.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._open_session(name))
            self._opening[name] = task
            task.add_done_callback(lambda t: self._opening.pop(name, None) if self._opening.get(name) is t else None)
        return await asyncio.shield(task)

    async def refresh(self, name: str, stale: Session) -> Session:
        """Re-read the peer's region table; re-open the session if the peer restarted."""
        if self._open.get(name) is not stale:
            return await self.get(name)
        task = self._refreshing.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._refresh(name, stale))
            self._refreshing[name] = task
            task.add_done_callback(lambda t: self._refreshing.pop(name, None))
        return await asyncio.shield(task)

    def evict(self, name: str, session: Session, reason: str) -> None:
        """Drop a failed session; the next call to ``get`` opens a new one."""
        if self._open.get(name) is session:
            del self._open[name]
            log.warning("session %s evicted: %s", name, reason)
        session.close()

    def sweep(self, idle_timeout: float) -> list[Session]:
        """Take out of the cache the sessions to close now: those whose connections broke, and
        those unused for ``idle_timeout`` seconds (0: never) that no call holds.  The caller
        closes them off the loop (closing joins the core's stream threads)."""
        idle_ms = idle_timeout * 1000
        gone = []
        for name, session in list(self._open.items()):
            if name in self._refreshing:
                continue
            broken = not session.peer.healthy
            if not broken and (not idle_ms or session.pinned or session.peer.idle_ms() < idle_ms):
                continue  # idle_ms() is -1 while a batch is alive
            del self._open[name]
            session.released = True
            gone.append(session)
            if broken:  # the same warning a call's failure gives: a peer went away
                log.warning("session %s evicted: its connections broke", name)
            else:
                log.debug("session %s closed: idle", name)
        return gone

    async def close(self) -> None:
        for task in list(self._opening.values()) + list(self._refreshing.values()):
            task.cancel()
        for session in list(self._open.values()):
            session.close()
        self._open.clear()

    async def _resolve(self, name: str) -> tuple:
        host, port, desc = await self._resolver.resolve(name)
        self._check_peer_kind(name, desc)
        return host, port, desc

    @staticmethod
    def _check_peer_kind(name: str, desc: SegmentDesc) -> None:
        """A flagcx_mc peer, or a plain Mooncake TCP node speaking v2 (v1 never confirms a write)."""
        if desc.native is not None:
            return
        if desc.protocol != "tcp" or not desc.tcp_data_port:
            raise errors.NotSupportedError(
                f"{name} offers protocol {desc.protocol!r}; only flagcx_mc and Mooncake TCP peers are supported"
            )
        if desc.tcp_proto_version < 2:
            raise errors.NotSupportedError(
                f"{name} speaks Mooncake TCP v1, which reports writes done before they land; "
                "need v2 (Mooncake >= 0.3.12)"
            )

    def _streams_in_use(self) -> int:
        """Streams of the open sessions and of those being opened: what stream_budget shares."""
        return sum(s.peer.streams for s in self._open.values()) + sum(self._reserved.values())

    async def _open_session(self, name: str) -> Session:
        host, port, desc = await self._resolve(name)
        try:
            peer = self._new_peer(name, host, desc)
            peer.set_call_stats(self._metrics.core_counts(name))
            timeout_ms = int(self._config.handshake_timeout * 1000)
            await self._connect(peer, timeout_ms)
        finally:
            self._reserved.pop(name, None)
        session = Session(name=name, host=host, rpc_port=port, desc=desc, peer=peer, same_host=peer.same_host)
        self._open[name] = session
        log.debug("session %s open (%s): %d regions", name, "flagcx_mc" if desc.native else "Mooncake TCP",
                  len(desc.buffers))
        return session

    async def _connect(self, peer: CorePeer, timeout_ms: int) -> None:
        """Connect the peer's data streams on the executor, CONNECTS_AT_ONCE sessions at a time
        (a slow one gives its turn away after SLOW_CONNECT_S, while few others have)."""
        loop = asyncio.get_running_loop()
        await self._connecting.acquire()
        turn, slow = True, False

        def give_turn() -> None:
            nonlocal turn, slow
            if turn and self._slow_connects < self._slow_connects_max:
                self._slow_connects += 1
                turn, slow = False, True
                self._connecting.release()

        timer = loop.call_later(SLOW_CONNECT_S, give_turn)
        try:
            await loop.run_in_executor(self._executor, peer.connect, timeout_ms)
        finally:
            timer.cancel()
            if turn:
                self._connecting.release()
            if slow:
                self._slow_connects -= 1

    @property
    def slow_connects(self) -> int:
        """Connects going on beside the CONNECTS_AT_ONCE turns (each on an executor thread)."""
        return self._slow_connects

    def _new_peer(self, name: str, host: str, desc: SegmentDesc) -> CorePeer:
        data_port = desc.native.data_port if desc.native else desc.tcp_data_port
        streams = self._config.streams_for(self._streams_in_use())
        peer = CorePeer(self._core, host, data_port, streams, self._config.slice_size)
        self._reserved[name] = streams  # until the session is open, or failed to open
        if desc.native is None:
            peer.set_protocol(PROTO_MOONCAKE)
        elif desc.native.boot_id and desc.native.boot_id == boot_id():
            peer.set_owner_pid(desc.native.pid)
        self._try_same_host(peer, desc)
        _set_regions(peer, desc, self._fallbacks_logged)
        return peer

    def _try_same_host(self, peer: CorePeer, desc: SegmentDesc) -> None:
        """Copy with process_vm_writev when the peer runs on this kernel and lets us; otherwise
        stay on TCP, saying why once (or fail, if the config demands the same-host path)."""
        wanted = self._config.transport
        native = desc.native
        if wanted == "tcp":
            return
        reason = ""
        if native is None or native.shm_fd < 0:
            reason = "the peer offers no same-host control block"
        elif native.boot_id != boot_id() or not native.boot_id:
            reason = "the peer runs on another host"
        else:
            try:
                peer.enable_same_host(native.pid, native.shm_fd, native.shm_addr)
                return
            except errors.FlagcxMcError as exc:
                reason = str(exc)
        if wanted == "same-host":
            raise errors.NotSupportedError(f"same-host transport to {desc.name} unavailable: {reason}")
        if native is not None and native.boot_id == boot_id() and reason not in self._fallbacks_logged:
            self._fallbacks_logged.add(reason)
            log.warning("same-host transport to %s unavailable, using TCP: %s", desc.name, reason)

    async def _refresh(self, name: str, stale: Session) -> Session:
        _, _, desc = await self._resolve(name)
        if _identity(desc) != _identity(stale.desc):
            self.evict(name, stale, "the peer restarted")
            return await self.get(name)
        _set_regions(stale.peer, desc, self._fallbacks_logged)
        stale.desc = desc
        return stale


def _set_regions(peer: CorePeer, desc: SegmentDesc, logged: set) -> None:
    """The peer's regions, its same-host slots and mappings.  A GPU region that cannot be mapped
    here moves through staging over TCP; why is logged once per peer and reason (``logged``
    remembers), not once per region and refresh."""
    peer.set_regions(_regions(desc))
    if desc.native is None:
        return
    peer.set_region_slots([(r.addr, r.slot, r.gen) for r in desc.native.regions])
    for r in desc.native.regions:
        if r.shm is not None and peer.same_host:
            try:
                peer.set_region_shm(r.addr, r.shm[0], r.shm[1])
            except errors.FlagcxMcError as exc:  # then process_vm_writev serves it
                log.info("cannot map shared region %#x of %s: %s", r.addr, desc.name, exc)
        if r.cuda is not None:
            try:
                reason = peer.set_region_gpu(r.addr, r.cuda)
            except errors.FlagcxMcError as exc:  # that region then goes over TCP
                reason = str(exc)
            if reason and (desc.name, reason) not in logged:
                logged.add((desc.name, reason))
                log.warning("GPU memory of %s goes through host staging over TCP: %s", desc.name, reason)


def _regions(desc: SegmentDesc) -> list[tuple[int, int, int]]:
    """(addr, length, key) of every remote region; Mooncake peers have no keys (0)."""
    if desc.native is not None:
        return [(r.addr, r.length, r.key) for r in desc.native.regions]
    return [(b.addr, b.length, 0) for b in desc.buffers]


def _identity(desc: SegmentDesc) -> tuple:
    """What changes when the peer process behind a name is replaced."""
    if desc.native is not None:
        return ("native", desc.native.data_port, desc.native.pid, desc.native.boot_id)
    return ("mooncake", desc.tcp_data_port)
