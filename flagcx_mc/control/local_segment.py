"""This engine's own segment: the descriptor it publishes and the handshake messages it answers."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from .. import errors
from .._core import CoreEngine
from ..metadata.descriptor import BufferDesc, NativeInfo, RegionDesc, SegmentDesc
from ..names import TransferNotify
from .codec import Message, MessageType
from .handshake import Handler

__all__ = ["LocalSegment", "NATIVE_VERSION"]

NATIVE_VERSION = 1


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _whole_region(mapping, length: int):
    """A shared mapping (memfd, size) published for a region only if it covers the whole region."""
    return mapping if mapping is not None and mapping[1] == length else None


class LocalSegment:
    """Builds the segment descriptor from the core's registry; serves Metadata/Probe/Notify."""

    def __init__(self, core: CoreEngine, notifies: deque[TransferNotify],
                 shared_mappings: Callable[[], dict[int, tuple]] = dict) -> None:
        self._core = core
        self._shared_mappings = shared_mappings  # managed memory same-host peers may map
        self._notifies = notifies
        self._boot_id = boot_id()
        self._gpu_shares: dict = {}  # (addr, key) -> GpuShare, or None for host memory
        self.name = ""

    def desc(self) -> SegmentDesc:
        table = self._core.region_table()
        slots = self._core.region_slots()
        shared = self._shared_mappings()
        if len(slots) != len(table):  # registry changed between the two reads: no same-host hints
            slots = [(-1, 0)] * len(table)
        live = {(a, k) for a, _, k in table}
        self._gpu_shares = {ak: share for ak, share in self._gpu_shares.items() if ak in live}
        return SegmentDesc(
            name=self.name,
            protocol="tcp",
            tcp_data_port=self._core.data_port,
            tcp_proto_version=2,
            buffers=tuple(BufferDesc(name=self.name, addr=a, length=n) for a, n, _ in table),
            native=NativeInfo(
                version=NATIVE_VERSION,
                data_port=self._core.data_port,
                regions=tuple(RegionDesc(addr=a, length=n, key=k, slot=sl, gen=g, cuda=self._gpu_share(a, k),
                                         shm=_whole_region(shared.get(a), n))
                              for (a, n, k), (sl, g) in zip(table, slots, strict=True)),
                boot_id=self._boot_id,
                pid=os.getpid(),
                shm_fd=self._core.same_host_fd,
                shm_addr=self._core.same_host_addr,
            ),
        )

    def _gpu_share(self, addr: int, key: int):
        """GPU regions carry what same-host peers need to map them (exported once per
        registration: a region registered anew has a new key)."""
        if (addr, key) not in self._gpu_shares:
            self._gpu_shares[(addr, key)] = self._core.gpu_share(addr)
        return self._gpu_shares[(addr, key)]

    def desc_json(self) -> dict:
        return self.desc().to_json_dict()

    def handlers(self) -> dict[MessageType, Handler]:
        return {
            MessageType.METADATA: self._on_metadata,
            MessageType.PROBE: self._on_probe,
            MessageType.NOTIFY: self._on_notify,
            MessageType.CONNECTION: self._on_connection,
        }

    async def _on_metadata(self, message: Message) -> dict:
        return self.desc_json()

    async def _on_probe(self, message: Message) -> dict:
        return {"status": "success"}

    async def _on_notify(self, message: Message) -> dict:
        name, msg = message.payload.get("name"), message.payload.get("notify_msg")
        if not isinstance(name, str) or not isinstance(msg, str):
            raise errors.MalformedJsonError("notify needs string 'name' and 'notify_msg'")
        self._notifies.append(TransferNotify(name, msg))
        return {"name": "", "notify_msg": "success"}

    async def _on_connection(self, message: Message) -> dict:
        # What Mooncake's TCP transport answers: an all-empty endpoint descriptor.
        return {"local_gid": "", "local_lid": 0, "local_nic_path": "", "payload": "", "peer_nic_path": "",
                "qp_num": [], "reply_msg": ""}
