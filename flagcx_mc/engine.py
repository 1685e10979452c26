"""``AsyncTransferEngine``: Mooncake's TransferEngine methods as coroutines raising typed errors.

The control plane (handshake server, session cache) runs on the caller's event loop; payload
bytes move in the C core's threads, and waiting for them happens in an executor thread with
the GIL released, so the loop never blocks on a transfer.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Sequence

from . import errors
from ._core import CoreEngine
from .auth import authed_request, guard_handlers
from .batches import BatchTable, PendingBatch
from .config import EngineConfig
from .handshake.codec import MessageType
from .handshake.server import HandshakeServer, request
from .local_segment import LocalSegment
from .managed import ManagedPool
from .metrics import EngineMetrics
from .metastore import open_store, parse_metadata_server
from .names import TransferNotify, TransferOpcode
from .netaddr import format_host_port, parse_host_port, rpc_port_range
from .resolvers import P2PResolver, StoreResolver
from .sessions import Session, SessionCache
from .transfer import OP_READ, OP_WRITE, SingleTransfer, TransferRequest, needs_refresh, opcode_name

__all__ = ["AsyncTransferEngine", "RemoteDesc", "P2P_HANDSHAKE"]

log = logging.getLogger("flagcx_mc.engine")

P2P_HANDSHAKE = "P2PHANDSHAKE"
_LOG_DRAIN_INTERVAL = 1.0


@dataclass(frozen=True)
class RemoteDesc:
    """Where a remote range lives (seed 000's ``make_desc``): its region's base and key."""

    addr: int
    size: int
    region_base: int
    key: int


def _opcode(opcode: int) -> int:
    try:
        op = TransferOpcode(int(opcode))
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError(f"opcode must be TransferOpcode.Read or .Write, got {opcode!r}") from None
    return OP_WRITE if op is TransferOpcode.Write else OP_READ


class AsyncTransferEngine:
    """An engine driven from asyncio.  Use ``async with`` (or ``close()``) for a clean shutdown.

    Keyword arguments override ``EngineConfig`` fields (``transfer_timeout``,
    ``handshake_timeout``, ``streams_per_peer``, ``slice_size``, ``wait_threads``).
    """

    def __init__(self, **config: Any) -> None:
        self._config = EngineConfig.from_env(**config)
        self._core: Optional[CoreEngine] = None
        self._server: Optional[HandshakeServer] = None
        self._sessions: Optional[SessionCache] = None
        self._segment: Optional[LocalSegment] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._log_task: Optional[asyncio.Task] = None
        self._managed: Optional[ManagedPool] = None
        self._batches = BatchTable()
        self.metrics = EngineMetrics()
        self._notifies: Deque[TransferNotify] = collections.deque(maxlen=65536)
        self._store: Optional[StoreResolver] = None  # set when a metadata server is used
        self._publish_lock = asyncio.Lock()  # orders updates of our descriptor on it
        self._host = ""
        self._name = ""
        self._rpc_port = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def create(cls, local_hostname: str, metadata_server: str = P2P_HANDSHAKE, protocol: str = "tcp",
                     device_name: str = "", **config: Any) -> "AsyncTransferEngine":
        engine = cls(**config)
        await engine.initialize(local_hostname, metadata_server, protocol, device_name)
        return engine

    async def initialize(self, local_hostname: str, metadata_server: str = P2P_HANDSHAKE, protocol: str = "tcp",
                         device_name: str = "") -> None:
        """Start the handshake server and the data listener on ``local_hostname``.

        As in Mooncake's P2PHANDSHAKE mode, a port inside ``local_hostname`` is ignored: the rpc
        port is a free random port in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] (default 15000-17000).

        Raises:
            EngineStateError: already initialized or closed.
            NotSupportedError: a metadata server other than P2PHANDSHAKE.
            InvalidArgumentError, EndpointError, DnsError: bad host name, no free port.
        """
        await self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    async def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                             metadata_type: str) -> None:
        """``initialize`` with Mooncake's ``metadata_type`` (prefixed to a scheme-less server)."""
        if self._core is not None or self._closed:
            raise errors.EngineStateError("engine already initialized" if self._core else "engine closed")
        kind, url = parse_metadata_server(metadata_server, metadata_type)
        if protocol not in ("tcp", ""):
            log.info("protocol %r requested: this build moves data over its native TCP transport", protocol)
        host, _ = parse_host_port(local_hostname, default_port=12001)  # the port is ignored, as in Mooncake
        if kind != "p2p":
            host = await _advertised_host(host)
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._executor = ThreadPoolExecutor(self._config.wait_threads, thread_name_prefix="flagcx-mc-wait")
        low, high = rpc_port_range()
        try:
            store = open_store(kind, url, timeout=self._config.handshake_timeout) if kind != "p2p" else None
            self._core = await loop.run_in_executor(self._executor, CoreEngine, host, low, high, self._config)
            secret = self._config.secret
            if secret is not None:
                self._core.set_secret(secret)
            self._segment = LocalSegment(self._core, self._notifies, self._shared_mappings)
            self._server = HandshakeServer(guard_handlers(self._segment.handlers(), secret))
            self._rpc_port = await self._server.start(host, None)
            self._host = host
            # P2P: the name is host:rpc_port.  With a metadata server it is local_hostname verbatim.
            self._name = format_host_port(host, self._rpc_port) if store is None else local_hostname
            self._segment.name = self._name
            if store is None:
                resolver = P2PResolver(self._segment.desc_json, self._config.handshake_timeout, secret)
            else:
                resolver = self._store = StoreResolver(store)
                await self._store.publish(self._name, host, self._rpc_port, self._segment.desc_json())
        except BaseException:
            await self._teardown()
            # Nothing of the failed attempt may outlive it: initialize can be called again.
            self._server = self._segment = self._loop = None
            self._host, self._name, self._rpc_port = "", "", 0
            raise
        self._managed = ManagedPool(self._core.register, self._core.unregister)
        self._sessions = SessionCache(self._core, self._config, self._executor, resolver, self.metrics)
        self._log_task = loop.create_task(self._drain_core_log())
        log.info("engine %s up (data port %d%s)", self._name, self._core.data_port,
                 "" if store is None else f", metadata server {url}")

    async def close(self) -> None:
        """Close sessions, stop the servers and free the core (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._teardown()

    async def _teardown(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            await store.withdraw(self._name)
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
            await asyncio.get_running_loop().run_in_executor(None, self._batches.cancel_all)
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
        if self._managed is not None:
            self._managed.close()
            self._managed = None
        if self._core is not None:
            core, self._core = self._core, None
            core.close()

    async def __aenter__(self) -> "AsyncTransferEngine":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ identity

    @property
    def session_name(self) -> str:
        """The name peers pass as ``target_hostname``: ``host:rpc_port`` in P2P mode, else the
        ``local_hostname`` given to ``initialize``."""
        return self._name or format_host_port(self._host, self._rpc_port)

    @property
    def config(self) -> EngineConfig:
        return self._config

    async def get_rpc_port(self) -> int:
        self._require_core()
        return self._rpc_port

    def stats(self) -> dict:
        """The C core's counters (bytes, batches, refusals, connections) as flat keys, plus
        ``session``, ``totals`` and ``peers`` (per-peer bytes, transfers, failures and a latency
        histogram of transfer calls; see metrics.py)."""
        return {**self._require_core().stats(), "session": self.session_name, **self.metrics.snapshot()}

    async def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """Mooncake's priority matrix as JSON; with no RDMA devices every location maps to none."""
        nodes = sorted(
            int(n[4:]) for n in _listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit()
        ) or [0]
        return json.dumps({f"cpu:{n}": [[], []] for n in nodes})

    # ------------------------------------------------------------------ memory

    async def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> None:
        """Register [buffer_addr, buffer_addr + capacity) for remote reads and writes.

        Raises:
            InvalidArgumentError: zero length, unmapped memory.  AddressOverlappedError: overlap.
            MetadataError, PeerConnectionError, HandshakeTimeoutError: with a metadata server, it
                could not publish the region; the region is then not registered either.
        """
        core = self._require_core()
        await self._in_executor(core.register, buffer_addr, capacity)
        await self._publish_added(lambda: core.unregister(buffer_addr))

    async def unregister_memory(self, buffer_addr: int) -> None:
        """Unregister; once this returns no remote operation touches the region.

        Raises:
            AddressNotRegisteredError: ``buffer_addr`` does not start a registered region.
            InvalidArgumentError: it is memory of ``allocate_managed_buffer`` (the pool's chunks
                hold other buffers too: release it with ``free_managed_buffer``).
        """
        core = self._require_core()
        self._refuse_managed(buffer_addr)
        await self._in_executor(core.unregister, buffer_addr)
        await self._publish_removed()

    async def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                                    location: str = "*") -> None:
        """Register several regions, all or none."""
        if len(buffer_addresses) != len(capacities):
            raise errors.InvalidArgumentError("buffer_addresses and capacities differ in length")
        core = self._require_core()
        addrs = list(buffer_addresses)
        await self._in_executor(_register_all, core, addrs, list(capacities))
        await self._publish_added(lambda: _unregister_each(core, addrs))

    def _refuse_managed(self, addr: int) -> None:
        if self._managed is not None and addr in self._managed.shared_mappings():
            raise errors.InvalidArgumentError(
                f"{addr:#x} is managed memory (allocate_managed_buffer): release it with free_managed_buffer")

    async def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> None:
        """Unregister every address; raises the first error after trying them all."""
        core = self._require_core()
        first: Optional[errors.FlagcxMcError] = None
        for addr in list(buffer_addresses):
            try:
                self._refuse_managed(addr)
                await self._in_executor(core.unregister, addr)
            except errors.FlagcxMcError as exc:
                first = first or exc
        await self._publish_removed()
        if first is not None:
            raise first

    async def allocate_managed_buffer(self, length: int) -> int:
        """An engine-owned, registered block of at least ``length`` bytes (shared memory)."""
        self._require_core()
        addr = await self._in_executor(self._managed.allocate, length)
        await self._publish_added(lambda: self._managed.free(addr, length))
        return addr

    async def free_managed_buffer(self, buffer_addr: int, length: int) -> None:
        self._require_core()
        self._managed.free(buffer_addr, length)
        await self._publish_removed()

    async def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> None:
        """Copy ``src[:length]`` into registered memory at ``dest_address``."""
        data = memoryview(src).cast("B")
        if not 0 <= length <= len(data):
            raise errors.InvalidArgumentError(f"length {length} outside the {len(data)} source bytes")
        self._check_local(dest_address, length)
        ctypes.memmove(dest_address, bytes(data[:length]), length)

    async def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Return ``length`` bytes of registered memory at ``source_address``."""
        self._check_local(source_address, length)
        return ctypes.string_at(source_address, length)

    def _check_local(self, addr: int, length: int) -> None:
        core = self._require_core()
        if length == 0:
            return
        if not any(a <= addr and addr + length <= a + n for a, n, _ in core.region_table()):
            raise errors.AddressNotRegisteredError(f"[{addr:#x}, +{length}) is not inside one registered region")

    # ------------------------------------------------------------------ synchronous transfers

    async def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                                  length: int, transport_hint: str = "") -> None:
        await self._transfer(target_hostname, TransferRequest.single(OP_WRITE, buffer, peer_buffer_address, length))

    async def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                                 length: int, transport_hint: str = "") -> None:
        await self._transfer(target_hostname, TransferRequest.single(OP_READ, buffer, peer_buffer_address, length))

    async def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                        peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                        transport_hint: str = "") -> None:
        """Write local ``buffers[i]`` to the peer's ``peer_buffer_addresses[i]``; returns once all landed.

        Raises:
            InvalidArgumentError: lists of different lengths, non-integers.
            AddressNotRegisteredError: a local or remote range outside registered memory.
            TransferTimeoutError: not done in time (the buffers are no longer touched).
            PeerConnectionError, HandshakeTimeoutError, DnsError: the peer cannot be reached.
        """
        await self._transfer(target_hostname, TransferRequest.build(OP_WRITE, buffers, peer_buffer_addresses, lengths))

    async def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                       peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                       transport_hint: str = "") -> None:
        """Read the peer's ``peer_buffer_addresses[i]`` into local ``buffers[i]``."""
        await self._transfer(target_hostname, TransferRequest.build(OP_READ, buffers, peer_buffer_addresses, lengths))

    async def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> None:
        """One transfer by opcode; ``notify`` reaches the target after the data landed."""
        await self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    async def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int,
                                  notify: Optional[TransferNotify] = None, transport_hint: str = "") -> None:
        req = TransferRequest.build(_opcode(opcode), buffers, peer_buffer_addresses, lengths)
        session = await self._transfer(target_hostname, req)
        if notify is not None:
            await self.send_notify(target_hostname, notify, session)

    async def _transfer(self, target: str, req: TransferRequest) -> Optional[Session]:
        sessions = self._require_sessions()
        if req.count == 0:
            return None
        with self.metrics.failure_counted(target, req.opcode == OP_WRITE, req.total_bytes):
            session = await sessions.get(target)
            rc, why = await self._in_executor(req.run, session, self._config)
            return await self._settle(target, req, session, rc, why)  # the core counted it (metrics.py)

    async def _settle(self, target: str, req: "TransferRequest | SingleTransfer", session: Session, rc: int,
                      why: str) -> Session:
        """A call's first try came back ``rc``: try once more on a refreshed region table when
        that can help (memory the peer registered since, or a stale address), then raise what is
        left.  Returns the session the call succeeded on."""
        if needs_refresh(rc):
            session = await self._require_sessions().refresh(target, session)
            rc, why = await self._in_executor(req.run, session, self._config)
        if rc != 0:
            raise errors.error_for_code(rc, f"{opcode_name(req.opcode)} to {target} failed: {why}")
        return session

    # ------------------------------------------------------------------ asynchronous batches

    async def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                         peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                         transport_hint: str = "") -> int:
        """Start a write batch; returns its id for ``get_batch_transfer_status``."""
        return await self._submit(target_hostname, TransferRequest.build(OP_WRITE, buffers, peer_buffer_addresses, lengths))

    async def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                        peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                        transport_hint: str = "") -> int:
        return await self._submit(target_hostname, TransferRequest.build(OP_READ, buffers, peer_buffer_addresses, lengths))

    async def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int,
                                   transport_hint: str = "") -> int:
        req = TransferRequest.build(_opcode(opcode), buffers, peer_buffer_addresses, lengths)
        return await self._submit(target_hostname, req)

    async def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                                    transport_hint: str = "") -> int:
        """Start one write; poll it with ``transfer_check_status``.

        Unlike Mooncake, the batch still gets the transfer deadline, so nothing can wait forever.
        """
        req = TransferRequest.single(OP_WRITE, buffer, peer_buffer_address, length)
        return await self._submit(target_hostname, req)

    async def _submit(self, target: str, req: TransferRequest) -> int:
        sessions = self._require_sessions()
        session = await sessions.get(target)
        try:  # off the loop: on one host the copy happens inside submit
            batch = await self._in_executor(req.submit, session)
        except errors.AddressNotRegisteredError:
            session = await sessions.refresh(target, session)
            batch = await self._in_executor(req.submit, session)
        deadline = time.monotonic() + self._config.timeout_for(req.total_bytes)
        return self._batches.add(PendingBatch(batch, target, deadline))

    async def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> None:
        """Wait for every batch; each is forgotten once done.  Raises the first failure."""
        first: Optional[errors.FlagcxMcError] = None
        for batch_id in list(batch_ids):
            try:
                pending = self._batches.get(batch_id)
            except errors.FlagcxMcError as exc:
                first = first or exc
                continue
            rc, why = await self._in_executor(pending.batch.wait, pending.remaining_ms())
            self._batches.discard(batch_id)
            if rc != 0 and first is None:
                first = errors.error_for_code(rc, f"batch {batch_id} to {pending.target} failed: {why}")
        if first is not None:
            raise first

    async def transfer_check_status(self, batch_id: int) -> int:
        """1 done (and forgotten), 0 still running; raises if it failed or passed its deadline."""
        pending = self._batches.get(batch_id)
        state = pending.batch.poll()
        if state == 0 and time.monotonic() > pending.deadline:
            await self._in_executor(pending.batch.cancel)
            self._batches.discard(batch_id)
            raise errors.TransferTimeoutError(f"batch {batch_id} to {pending.target} timed out")
        if state == 0:
            return 0
        self._batches.discard(batch_id)
        if state < 0:
            raise errors.error_for_code(state, f"batch {batch_id} to {pending.target} failed")
        return 1

    # ------------------------------------------------------------------ FlagCX-style low-level API

    async def get_conn(self, session_name: str) -> Session:
        """The cached connection to a peer (handshakes on first use)."""
        return await self._require_sessions().get(session_name)

    def make_desc(self, conn: Session, remote_addr: int, size: int) -> RemoteDesc:
        """The remote region and key that wholly hold [remote_addr, remote_addr + size)."""
        base, key = conn.peer.find_region(remote_addr, size)
        return RemoteDesc(remote_addr, size, base, key)

    async def write_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                           sizes: Sequence[int]) -> int:
        """Start writes of ``sizes[i]`` bytes from ``local_addrs[i]`` to ``descs[i]``; returns a transfer id."""
        return await self._vector(OP_WRITE, conn, local_addrs, descs, sizes)

    async def read_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                          sizes: Sequence[int]) -> int:
        return await self._vector(OP_READ, conn, local_addrs, descs, sizes)

    async def _vector(self, op: int, conn: Session, local_addrs, descs, sizes) -> int:
        if len(descs) != len(sizes) or any(s > d.size for d, s in zip(descs, sizes)):
            raise errors.InvalidArgumentError("each size must be at most its descriptor's size")
        req = TransferRequest.build(op, local_addrs, [d.addr for d in descs], sizes)
        deadline = time.monotonic() + self._config.timeout_for(req.total_bytes)
        batch = await self._in_executor(req.submit, conn)
        return self._batches.add(PendingBatch(batch, conn.name, deadline))

    async def xfer_status(self, xfer_id: int) -> int:
        """1 done, 0 in progress; raises on failure (FlagCX's XferStatus)."""
        return await self.transfer_check_status(xfer_id)

    async def write_vector_sync(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                                sizes: Sequence[int]) -> None:
        await self.get_batch_transfer_status([await self.write_vector(conn, local_addrs, descs, sizes)])

    async def read_vector_sync(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                               sizes: Sequence[int]) -> None:
        await self.get_batch_transfer_status([await self.read_vector(conn, local_addrs, descs, sizes)])

    # ------------------------------------------------------------------ segments, probes, notifies

    async def get_first_buffer_address(self, segment_name: str) -> int:
        """Address of the first buffer the named segment registered (0 if none)."""
        sessions = self._require_sessions()
        session = await sessions.get(segment_name)
        if not session.desc.buffers:
            session = await sessions.refresh(segment_name, session)
        return session.desc.buffers[0].addr if session.desc.buffers else 0

    async def send_probe(self, peer_server_name: str) -> None:
        """Check that a peer's handshake server answers (Mooncake's Probe message)."""
        if self._store is not None:
            host, port, _ = await self._store.resolve(peer_server_name)
        else:
            host, port = parse_host_port(peer_server_name)
        reply = await request(host, port, MessageType.PROBE, {}, timeout=self._config.handshake_timeout)
        if reply.get("status") != "success":
            raise errors.HandshakeRejectedError(f"{peer_server_name} answered the probe with {reply!r}")

    async def send_notify(self, target_hostname: str, notify: TransferNotify,
                          session: Optional[Session] = None) -> None:
        """Deliver ``notify`` to the target's ``get_notifies()``."""
        if session is None:
            session = await self._require_sessions().get(target_hostname)
        await authed_request(self._config.secret, session.host, session.rpc_port, MessageType.NOTIFY,
                             {"name": notify.name, "notify_msg": notify.msg}, timeout=self._config.handshake_timeout)

    def get_notifies(self) -> List[TransferNotify]:
        """Drain the notifications peers sent to this engine, oldest first."""
        items = list(self._notifies)
        self._notifies.clear()
        return items

    # ------------------------------------------------------------------ what this build cannot do

    async def transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        raise errors.NotSupportedError("transfer_write_on_cuda needs the CUDA data path, which this build lacks")

    transfer_read_on_cuda = batch_transfer_write_on_cuda = batch_transfer_read_on_cuda = transfer_write_on_cuda

    async def warmup_efa_segment(self, segment_name: str) -> int:
        return 0  # Mooncake: a no-op outside EFA builds

    # ------------------------------------------------------------------ helpers

    def _require_core(self) -> CoreEngine:
        if self._core is None:
            raise errors.EngineStateError("engine closed" if self._closed else "engine not initialized")
        return self._core

    def _require_sessions(self) -> SessionCache:
        self._require_core()
        assert self._sessions is not None
        return self._sessions

    def _shared_mappings(self) -> dict:
        return self._managed.shared_mappings() if self._managed is not None else {}

    async def _republish(self) -> None:
        """With a metadata server, peers read our regions from it: keep it current.  One update
        at a time, each taking the table as it is when its turn comes: two concurrent updates
        could otherwise land out of order and leave the older table published."""
        if self._store is None:
            return
        async with self._publish_lock:
            if self._store is not None:
                await self._store.update(self._name, self._segment.desc_json())

    async def _publish_added(self, undo: Callable[[], Any]) -> None:
        """Publish memory just registered; if the metadata server cannot take it, ``undo`` the
        registration and raise, so the call fails whole and can simply be repeated (peers could
        not have found the memory anyway)."""
        try:
            await self._republish()
        except BaseException:
            try:
                await self._in_executor(undo)
            except errors.FlagcxMcError as exc:
                log.warning("%s: could not undo a registration the metadata server refused: %s", self._name, exc)
            raise

    async def _publish_removed(self) -> None:
        """Publish the table after memory left it.  The memory is gone here whatever the metadata
        server says (our registry refuses anything aimed at it), so a server that cannot take the
        change is logged, not raised; the next update brings it up to date."""
        try:
            await self._republish()
        except errors.FlagcxMcError as exc:
            log.warning("%s: the metadata server still lists unregistered memory until the next update: %s",
                        self._name, exc)

    async def _in_executor(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _drain_core_log(self) -> None:
        while True:
            await asyncio.sleep(_LOG_DRAIN_INTERVAL)
            if self._core is None:
                return
            for line in self._core.drain_log():
                log.warning("%s: %s", self.session_name, line)


async def _advertised_host(name_host: str) -> str:
    """With a metadata server the segment name need not be an address (Mooncake's rule):
    ``MC_TCP_BIND_ADDRESS`` if set, else the name's host if it resolves, else this host's name."""
    explicit = os.environ.get("MC_TCP_BIND_ADDRESS", "").strip()
    if explicit:
        return explicit
    loop = asyncio.get_running_loop()
    for candidate in (name_host, socket.gethostname()):
        try:
            await loop.getaddrinfo(candidate, None)
            return candidate
        except OSError:
            continue
    raise errors.DnsError(f"cannot find an address to advertise: set MC_TCP_BIND_ADDRESS")


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unregister_each(core: CoreEngine, addrs: List[int]) -> None:
    """Unregister every address, the first error raised after trying them all."""
    first: Optional[errors.FlagcxMcError] = None
    for addr in addrs:
        try:
            core.unregister(addr)
        except errors.FlagcxMcError as exc:
            first = first or exc
    if first is not None:
        raise first


def _register_all(core: CoreEngine, addrs: List[int], lens: List[int]) -> None:
    done: List[int] = []
    try:
        for addr, length in zip(addrs, lens):
            core.register(addr, length)
            done.append(addr)
    except BaseException:
        for addr in done:
            core.unregister(addr)
        raise
