"""``AsyncTransferEngine``: Mooncake's TransferEngine methods as coroutines raising typed errors.

The control plane (handshake server, session cache) runs on the caller's event loop; payload
bytes move in the C core's threads, and waiting for them happens in an executor thread with
the GIL released, so the loop never blocks on a transfer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, List, Optional, Sequence, Tuple

from . import errors
from ._core import CoreEngine
from .config import EngineConfig
from .handshake.codec import Message, MessageType
from .handshake.server import HandshakeServer
from .metadata import BufferDesc, NativeInfo, RegionDesc, SegmentDesc
from .netaddr import format_host_port, parse_host_port, rpc_port_range
from .sessions import Session, SessionCache
from .transfer import OP_READ, OP_WRITE, TransferRequest, needs_refresh, opcode_name

__all__ = ["AsyncTransferEngine", "P2P_HANDSHAKE"]

log = logging.getLogger("flagcx_mc.engine")

P2P_HANDSHAKE = "P2PHANDSHAKE"
NATIVE_VERSION = 1
_LOG_DRAIN_INTERVAL = 1.0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


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
        self._executor: Optional[ThreadPoolExecutor] = None
        self._log_task: Optional[asyncio.Task] = None
        self._host = ""
        self._rpc_port = 0
        self._notifies: Deque[Tuple[str, str]] = collections.deque(maxlen=65536)
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
            InvalidArgumentError, EndpointError: bad host name, no free port.
        """
        if self._core is not None or self._closed:
            raise errors.EngineStateError("engine already initialized" if self._core else "engine closed")
        if metadata_server != P2P_HANDSHAKE:
            raise errors.NotSupportedError(
                f"metadata server {metadata_server!r} is not supported yet; use {P2P_HANDSHAKE!r}"
            )
        if protocol not in ("tcp", ""):
            log.info("protocol %r requested: this build moves data over its native TCP transport", protocol)
        host, _ = parse_host_port(local_hostname, default_port=12001)  # port ignored in P2P mode
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self._config.wait_threads, thread_name_prefix="flagcx-mc-wait")
        low, high = rpc_port_range()
        try:
            self._core = await loop.run_in_executor(self._executor, CoreEngine, host, low, high)
            self._server = HandshakeServer(
                {
                    MessageType.METADATA: self._on_metadata,
                    MessageType.PROBE: self._on_probe,
                    MessageType.NOTIFY: self._on_notify,
                    MessageType.CONNECTION: self._on_connection,
                }
            )
            self._rpc_port = await self._server.start(host, None)
        except BaseException:
            await self._teardown()
            raise
        self._host = host
        self._sessions = SessionCache(self._core, self._config, self._executor, self._local_desc_json)
        self._log_task = loop.create_task(self._drain_core_log())
        log.info("engine %s up (data port %d)", self.session_name, self._core.data_port)

    async def close(self) -> None:
        """Close sessions, stop the servers and free the core (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._teardown()

    async def _teardown(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            self._log_task = None
        if self._server is not None:
            await self._server.close()
        if self._sessions is not None:
            await self._sessions.close()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
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
        """``host:rpc_port``: the name peers pass as ``target_hostname``."""
        return format_host_port(self._host, self._rpc_port)

    @property
    def config(self) -> EngineConfig:
        return self._config

    async def get_rpc_port(self) -> int:
        self._require_core()
        return self._rpc_port

    def stats(self) -> dict:
        """Counters of the C core (bytes, batches, refusals, connections)."""
        return self._require_core().stats()

    # ------------------------------------------------------------------ memory

    async def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> None:
        """Register [buffer_addr, buffer_addr + capacity) for remote reads and writes.

        Raises:
            InvalidArgumentError: zero length, unmapped memory.  AddressOverlappedError: overlap.
        """
        core = self._require_core()
        await self._in_executor(core.register, buffer_addr, capacity)

    async def unregister_memory(self, buffer_addr: int) -> None:
        """Unregister; once this returns no remote operation touches the region.

        Raises:
            AddressNotRegisteredError: ``buffer_addr`` does not start a registered region.
        """
        core = self._require_core()
        await self._in_executor(core.unregister, buffer_addr)

    async def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                                    location: str = "*") -> None:
        """Register several regions, all or none."""
        if len(buffer_addresses) != len(capacities):
            raise errors.InvalidArgumentError("buffer_addresses and capacities differ in length")
        core = self._require_core()
        await self._in_executor(_register_all, core, list(buffer_addresses), list(capacities))

    async def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> None:
        """Unregister every address; raises the first error after trying them all."""
        core = self._require_core()
        first: Optional[errors.FlagcxMcError] = None
        for addr in list(buffer_addresses):
            try:
                await self._in_executor(core.unregister, addr)
            except errors.FlagcxMcError as exc:
                first = first or exc
        if first is not None:
            raise first

    # ------------------------------------------------------------------ transfers

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

    async def _transfer(self, target: str, req: TransferRequest) -> None:
        sessions = self._require_sessions()
        if req.count == 0:
            return
        session = await sessions.get(target)
        rc, why = await self._in_executor(req.run, session, self._config)
        if needs_refresh(rc):
            session = await sessions.refresh(target, session)
            rc, why = await self._in_executor(req.run, session, self._config)
        if rc != 0:
            raise errors.error_for_code(rc, f"{opcode_name(req.opcode)} to {target} failed: {why}")

    # ------------------------------------------------------------------ notifies

    def get_notifies(self) -> List[Tuple[str, str]]:
        """Drain the (name, message) notifications peers sent to this engine."""
        items = list(self._notifies)
        self._notifies.clear()
        return items

    # ------------------------------------------------------------------ handshake handlers

    def _local_desc(self) -> SegmentDesc:
        core = self._require_core()
        name = self.session_name
        table = core.region_table()
        return SegmentDesc(
            name=name,
            protocol="tcp",
            tcp_data_port=core.data_port,
            tcp_proto_version=2,
            buffers=tuple(BufferDesc(name=name, addr=a, length=n) for a, n, _ in table),
            native=NativeInfo(
                version=NATIVE_VERSION,
                data_port=core.data_port,
                regions=tuple(RegionDesc(addr=a, length=n, key=k) for a, n, k in table),
                boot_id=_boot_id(),
                pid=os.getpid(),
            ),
        )

    def _local_desc_json(self) -> dict:
        return self._local_desc().to_json_dict()

    async def _on_metadata(self, message: Message) -> dict:
        return self._local_desc_json()

    async def _on_probe(self, message: Message) -> dict:
        return {"status": "success"}

    async def _on_notify(self, message: Message) -> dict:
        name, msg = message.payload.get("name"), message.payload.get("notify_msg")
        if not isinstance(name, str) or not isinstance(msg, str):
            raise errors.MalformedJsonError("notify needs string 'name' and 'notify_msg'")
        self._notifies.append((name, msg))
        return {"name": "", "notify_msg": "success"}

    async def _on_connection(self, message: Message) -> dict:
        # What Mooncake's TCP transport answers: an all-empty endpoint descriptor.
        return {"local_gid": "", "local_lid": 0, "local_nic_path": "", "payload": "", "peer_nic_path": "",
                "qp_num": [], "reply_msg": ""}

    # ------------------------------------------------------------------ helpers

    def _require_core(self) -> CoreEngine:
        if self._core is None:
            raise errors.EngineStateError("engine closed" if self._closed else "engine not initialized")
        return self._core

    def _require_sessions(self) -> SessionCache:
        self._require_core()
        assert self._sessions is not None
        return self._sessions

    async def _in_executor(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _drain_core_log(self) -> None:
        while True:
            await asyncio.sleep(_LOG_DRAIN_INTERVAL)
            if self._core is None:
                return
            for line in self._core.drain_log():
                log.warning("%s: %s", self.session_name, line)


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
