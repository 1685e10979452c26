"""``AsyncTransferEngine``: Mooncake's TransferEngine methods as coroutines raising typed errors.

The control plane (handshake server, session cache) runs on the caller's event loop; payload
bytes move in the C core's threads, and waiting for them happens in an executor thread with
the GIL released, so the loop never blocks on a transfer.  What the engine holds, and its
start and stop, live in ``EngineState`` (state.py), which the sync facade shares.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

from .. import errors
from .._core import CoreEngine, as_u64, as_u64_list
from ..config import EngineConfig
from ..control.auth import authed_request
from ..control.codec import MessageType
from ..control.handshake import request
from ..metadata.connect import P2P_HANDSHAKE
from ..names import TransferNotify
from ..net.addresses import parse_host_port
from .batches import PendingBatch
from .requests import (
    OP_READ,
    OP_WRITE,
    RemoteDesc,
    SingleTransfer,
    TransferRequest,
    check_notify,
    mooncake_opcode,
)
from .sessions import Session
from .state import EngineState

__all__ = ["AsyncTransferEngine", "RemoteDesc", "P2P_HANDSHAKE"]


class AsyncTransferEngine:
    """An engine driven from asyncio.  Use ``async with`` (or ``close()``) for a clean shutdown.

    Keyword arguments override ``EngineConfig`` fields (``transfer_timeout``,
    ``handshake_timeout``, ``streams_per_peer``, ``slice_size``, ``wait_threads``).
    """

    def __init__(self, **config: Any) -> None:
        self._state = EngineState(EngineConfig.from_env(**config))
        # Code written for Mooncake never closes an engine: dropping the last reference does.
        weakref.finalize(self, self._state.abandon)

    @classmethod
    def over(cls, state: EngineState) -> AsyncTransferEngine:
        """A facade over an existing state (the sync facade's coroutines run through one)."""
        engine = cls.__new__(cls)
        engine._state = state
        return engine

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def create(cls, local_hostname: str, metadata_server: str = P2P_HANDSHAKE, protocol: str = "tcp",
                     device_name: str = "", **config: Any) -> AsyncTransferEngine:
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
            InvalidArgumentError, EndpointError, DnsError: bad host name, no free port.
            MetadataError, PeerConnectionError, HandshakeTimeoutError: the metadata server
                cannot be reached or refuses the engine's name.
        """
        await self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    async def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                             metadata_type: str) -> None:
        """``initialize`` with Mooncake's ``metadata_type`` (prefixed to a scheme-less server)."""
        await self._state.start(local_hostname, metadata_server, protocol, metadata_type)

    async def close(self) -> None:
        """Close sessions, stop the servers and free the core (idempotent)."""
        await self._state.stop()

    async def __aenter__(self) -> AsyncTransferEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ identity

    @property
    def session_name(self) -> str:
        """The name peers pass as ``target_hostname``: ``host:rpc_port`` in P2P mode, else the
        ``local_hostname`` given to ``initialize``."""
        return self._state.session_name

    @property
    def config(self) -> EngineConfig:
        return self._state.config

    async def get_rpc_port(self) -> int:
        self._require_core()
        return self._state.rpc_port

    def stats(self) -> dict:
        """The C core's counters (bytes, batches, refusals, connections) as flat keys, plus
        ``session``, ``totals`` and ``peers`` (per-peer bytes, transfers, failures and a latency
        histogram of transfer calls; see metrics.py), and ``call_groups`` / ``grouped_calls``:
        how many batches carried several coroutines' calls together, and those calls."""
        return self._state.stats()

    async def get_local_topology(self, device_name: str | None = None) -> str:
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
        await self._state.publish_added(lambda: core.unregister(buffer_addr))

    async def unregister_memory(self, buffer_addr: int) -> None:
        """Unregister; once this returns no remote operation touches the region.

        Raises:
            AddressNotRegisteredError: ``buffer_addr`` does not start a registered region.
            InvalidArgumentError: it is memory of ``allocate_managed_buffer`` (the pool's chunks
                hold other buffers too: release it with ``free_managed_buffer``).
        """
        core = self._require_core()
        await self._in_executor(core.unregister, self._refuse_managed(buffer_addr))
        await self._state.publish_removed()

    async def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                                    location: str = "*") -> None:
        """Register several regions, all or none."""
        addrs = as_u64_list(buffer_addresses, "buffer_addresses")
        lengths = as_u64_list(capacities, "capacities")
        if len(addrs) != len(lengths):
            raise errors.InvalidArgumentError("buffer_addresses and capacities differ in length")
        core = self._require_core()
        await self._in_executor(_register_all, core, addrs, lengths)
        await self._state.publish_added(lambda: _unregister_each(core, addrs))

    def _refuse_managed(self, addr: int) -> int:
        """``addr`` as an int, unless it is managed memory (which only free_managed_buffer releases)."""
        addr = as_u64(addr, "address")
        if self._state.is_managed(addr):
            raise errors.InvalidArgumentError(
                f"{addr:#x} is managed memory (allocate_managed_buffer): release it with free_managed_buffer")
        return addr

    async def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> None:
        """Unregister every address; raises the first error after trying them all."""
        core = self._require_core()
        first: errors.FlagcxMcError | None = None
        for addr in as_u64_list(buffer_addresses, "buffer_addresses"):
            try:
                await self._in_executor(core.unregister, self._refuse_managed(addr))
            except errors.FlagcxMcError as exc:
                first = first or exc
        await self._state.publish_removed()
        if first is not None:
            raise first

    async def allocate_managed_buffer(self, length: int) -> int:
        """An engine-owned, registered block of at least ``length`` bytes (shared memory)."""
        managed = self._state.require_managed()
        addr = await self._in_executor(managed.allocate, length)
        await self._state.publish_added(lambda: managed.free(addr, length))
        return addr

    async def free_managed_buffer(self, buffer_addr: int, length: int) -> None:
        self._state.require_managed().free(buffer_addr, length)
        await self._state.publish_removed()

    async def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> None:
        """Copy ``src[:length]`` into registered memory at ``dest_address``."""
        try:
            data = memoryview(src).cast("B")
        except TypeError:
            raise errors.InvalidArgumentError(f"src must be bytes-like, not {type(src).__name__}") from None
        length = as_u64(length, "length")
        if length > len(data):
            raise errors.InvalidArgumentError(f"length {length} outside the {len(data)} source bytes")
        dest_address, length = self._check_local(dest_address, length)
        ctypes.memmove(dest_address, bytes(data[:length]), length)

    async def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Return ``length`` bytes of registered memory at ``source_address``."""
        source_address, length = self._check_local(source_address, length)
        return ctypes.string_at(source_address, length)

    def _check_local(self, addr: int, length: int) -> tuple[int, int]:
        """``(addr, length)`` as ints, once they are known to lie inside one registered region."""
        core = self._require_core()
        addr, length = as_u64(addr, "address"), as_u64(length, "length")
        if length == 0:
            return addr, length
        if not any(a <= addr and addr + length <= a + n for a, n, _ in core.region_table()):
            raise errors.AddressNotRegisteredError(f"[{addr:#x}, +{length}) is not inside one registered region")
        return addr, length

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
                            opcode: int, notify: TransferNotify | None = None, transport_hint: str = "") -> None:
        """One transfer by opcode; ``notify`` reaches the target after the data landed."""
        await self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    async def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int,
                                  notify: TransferNotify | None = None, transport_hint: str = "") -> None:
        check_notify(notify)
        req = TransferRequest.build(mooncake_opcode(opcode), buffers, peer_buffer_addresses, lengths)
        session = await self._transfer(target_hostname, req)
        if notify is not None:
            await self.send_notify(target_hostname, notify, session)

    async def _transfer(self, target: str, req: TransferRequest | SingleTransfer) -> Session | None:
        state = self._state
        sessions = state.require_sessions()
        if req.count == 0:
            return None
        started = time.perf_counter()
        try:  # the failure count by hand: a context manager costs a small call a tenth of its time
            session = sessions.peek(target) or await sessions.get(target)
            joined = state.join(target, req, session)
            if joined is None:
                rc, why = await state.transfer(target, req, session)
            else:
                try:
                    rc, why = await joined[0]
                except asyncio.CancelledError:
                    await state.left_group(joined[1], joined[0])
                    raise
            if rc != 0:
                session = await state.settle(target, req, session, rc, why)
            return session
        except BaseException:
            state.metrics.record(target, req.opcode == OP_WRITE, req.total_bytes, time.perf_counter() - started,
                                 False)
            raise

    # ------------------------------------------------------------------ asynchronous batches

    async def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                         peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                         transport_hint: str = "") -> int:
        """Start a write batch; returns its id for ``get_batch_transfer_status``."""
        return await self._submit(target_hostname,
                                  TransferRequest.build(OP_WRITE, buffers, peer_buffer_addresses, lengths))

    async def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                        peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                        transport_hint: str = "") -> int:
        return await self._submit(target_hostname,
                                  TransferRequest.build(OP_READ, buffers, peer_buffer_addresses, lengths))

    async def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int,
                                   transport_hint: str = "") -> int:
        req = TransferRequest.build(mooncake_opcode(opcode), buffers, peer_buffer_addresses, lengths)
        return await self._submit(target_hostname, req)

    async def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                                    transport_hint: str = "") -> int:
        """Start one write; poll it with ``transfer_check_status``.

        Unlike Mooncake, the batch still gets the transfer deadline, so nothing can wait forever.
        """
        req = TransferRequest.single(OP_WRITE, buffer, peer_buffer_address, length)
        return await self._submit(target_hostname, req)

    async def _submit(self, target: str, req: TransferRequest | SingleTransfer) -> int:
        sessions = self._state.require_sessions()
        session = await sessions.get(target)
        try:
            batch = await self._state.submit_batch(req, session)
        except errors.AddressNotRegisteredError:
            session = await sessions.refresh(target, session)
            batch = await self._state.submit_batch(req, session)
        deadline = time.monotonic() + self._state.config.timeout_for(req.total_bytes)
        return self._state.batches.add(PendingBatch(batch, target, deadline))

    async def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> None:
        """Wait for every batch; each is forgotten once done.  Raises the first failure."""
        first: errors.FlagcxMcError | None = None
        waits: list[tuple[int, PendingBatch]] = []
        for batch_id in as_u64_list(batch_ids, "batch_ids"):
            try:
                waits.append((batch_id, self._state.batches.get(batch_id)))
            except errors.FlagcxMcError as exc:
                first = first or exc
        outcomes = await self._state.batch_outcomes([(p.batch, p.deadline) for _, p in waits])
        for (batch_id, pending), (rc, why) in zip(waits, outcomes, strict=True):
            self._state.batches.discard(batch_id)
            if rc != 0 and first is None:
                first = errors.error_for_code(rc, f"batch {batch_id} to {pending.target} failed: {why}")
        if first is not None:
            raise first

    async def transfer_check_status(self, batch_id: int) -> int:
        """1 done (and forgotten), 0 still running; raises if it failed or passed its deadline."""
        pending = self._state.batches.get(batch_id)
        state = pending.batch.poll()
        if state == 0 and time.monotonic() > pending.deadline:
            await self._state.stop_in_core(pending.batch.cancel)
            self._state.batches.discard(batch_id)
            raise errors.TransferTimeoutError(f"batch {batch_id} to {pending.target} timed out")
        if state == 0:
            return 0
        self._state.batches.discard(batch_id)
        if state < 0:
            raise errors.error_for_code(state, f"batch {batch_id} to {pending.target} failed")
        return 1

    # ------------------------------------------------------------------ FlagCX-style low-level API

    async def get_conn(self, session_name: str) -> Session:
        """The cached connection to a peer (handshakes on first use).  The application holds
        it, so it stays open however long it goes unused (``idle_session_timeout``)."""
        session = await self._state.require_sessions().get(session_name)
        session.pinned = True
        return session

    def make_desc(self, conn: Session, remote_addr: int, size: int) -> RemoteDesc:
        """The remote region and key that wholly hold [remote_addr, remote_addr + size)."""
        remote_addr, size = as_u64(remote_addr, "remote_addr"), as_u64(size, "size")
        base, key = _session(conn).peer.find_region(remote_addr, size)
        return RemoteDesc(remote_addr, size, base, key)

    async def write_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                           sizes: Sequence[int]) -> int:
        """Start writes of ``sizes[i]`` bytes from ``local_addrs[i]`` to ``descs[i]``; returns a transfer id."""
        return await self._vector(OP_WRITE, conn, local_addrs, descs, sizes)

    async def read_vector(self, conn: Session, local_addrs: Sequence[int], descs: Sequence[RemoteDesc],
                          sizes: Sequence[int]) -> int:
        return await self._vector(OP_READ, conn, local_addrs, descs, sizes)

    async def _vector(self, op: int, conn: Session, local_addrs, descs, sizes) -> int:
        conn = _session(conn)
        sizes = as_u64_list(sizes, "sizes")
        if not isinstance(descs, (list, tuple)) or not all(isinstance(d, RemoteDesc) for d in descs):
            raise errors.InvalidArgumentError("descs must be a list of make_desc results")
        if len(descs) != len(sizes) or any(s > d.size for d, s in zip(descs, sizes, strict=True)):
            raise errors.InvalidArgumentError("each size must be at most its descriptor's size")
        req = TransferRequest.build(op, local_addrs, [d.addr for d in descs], sizes)
        deadline = time.monotonic() + self._state.config.timeout_for(req.total_bytes)
        batch = await self._state.submit_batch(req, conn)
        return self._state.batches.add(PendingBatch(batch, conn.name, deadline))

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
        sessions = self._state.require_sessions()
        session = await sessions.get(segment_name)
        if not session.desc.buffers:
            session = await sessions.refresh(segment_name, session)
        return session.desc.buffers[0].addr if session.desc.buffers else 0

    async def send_probe(self, peer_server_name: str) -> None:
        """Check that a peer's handshake server answers (Mooncake's Probe message)."""
        if self._state.store is not None:
            host, port, _ = await self._state.store.resolve(peer_server_name)
        else:
            host, port = parse_host_port(peer_server_name)
        config = self._state.config
        reply = await request(host, port, MessageType.PROBE, {}, timeout=config.handshake_timeout,
                              max_length=config.handshake_max_length)
        if reply.get("status") != "success":
            raise errors.HandshakeRejectedError(f"{peer_server_name} answered the probe with {reply!r}")

    async def send_notify(self, target_hostname: str, notify: TransferNotify,
                          session: Session | None = None) -> None:
        """Deliver ``notify`` to the target's ``get_notifies()``."""
        if session is None:
            session = await self._state.require_sessions().get(target_hostname)
        config = self._state.config
        await authed_request(config.secret, session.host, session.rpc_port, MessageType.NOTIFY,
                             {"name": notify.name, "notify_msg": notify.msg}, timeout=config.handshake_timeout,
                             max_length=config.handshake_max_length)

    def get_notifies(self) -> list[TransferNotify]:
        """Drain the notifications peers sent to this engine, oldest first."""
        items = list(self._state.notifies)
        self._state.notifies.clear()
        return items

    # ------------------------------------------------------------------ what this build cannot do

    async def transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        raise errors.NotSupportedError("transfer_write_on_cuda needs the CUDA data path, which this build lacks")

    transfer_read_on_cuda = batch_transfer_write_on_cuda = batch_transfer_read_on_cuda = transfer_write_on_cuda

    async def warmup_efa_segment(self, segment_name: str) -> int:
        return 0  # Mooncake: a no-op outside EFA builds

    # ------------------------------------------------------------------ helpers

    def _require_core(self) -> CoreEngine:
        return self._state.require_core()

    async def _in_executor(self, fn, *args):
        return await self._state.run_blocking(fn, *args)


def _session(conn: object) -> Session:
    if not isinstance(conn, Session):
        raise errors.InvalidArgumentError(f"conn must be what get_conn returned, not {type(conn).__name__}")
    return conn


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unregister_each(core: CoreEngine, addrs: list[int]) -> None:
    """Unregister every address, the first error raised after trying them all."""
    first: errors.FlagcxMcError | None = None
    for addr in addrs:
        try:
            core.unregister(addr)
        except errors.FlagcxMcError as exc:
            first = first or exc
    if first is not None:
        raise first


def _register_all(core: CoreEngine, addrs: list[int], lens: list[int]) -> None:
    done: list[int] = []
    try:
        for addr, length in zip(addrs, lens, strict=True):
            core.register(addr, length)
            done.append(addr)
    except BaseException:
        for addr in done:
            core.unregister(addr)
        raise
