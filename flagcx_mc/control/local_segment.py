"""This engine's own segment: the descriptor it publishes and the handshake messages it answers."""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .. import errors
from .._core import CoreEngine
from ..metadata.descriptor import (
    NATIVE_KEY,
    PAGE_KEY,
    TABLE_PAGE_SLACK,
    BufferDesc,
    NativeInfo,
    RegionDesc,
    SegmentDesc,
    TableEncoder,
    TablePage,
)
from ..names import TransferNotify
from .codec import DEFAULT_MAX_LENGTH, Message, MessageType
from .handshake import Handler

__all__ = ["LocalSegment", "NATIVE_VERSION"]

log = logging.getLogger(__name__)

NATIVE_VERSION = 1
# Bytes of a reply frame kept free of the descriptor: the frame's header and newline, and the
# signature a shared secret adds (``auth.sign_reply``: about 90 bytes).
_REPLY_RESERVE = 512
_MIN_PAGE_FRAME = 4096  # the smallest frame an initiator may ask pages for


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _whole_region(mapping, length: int):
    """A shared mapping (memfd, size) published for a region only if it covers the whole region."""
    return mapping if mapping is not None and mapping[1] == length else None


@dataclass
class _Snapshot:
    """The descriptor built from one reading of the registry, numbered ``version``; kept until
    the registry reads differently, so that the pages an initiator fetches one by one all come
    from the same table."""

    inputs: tuple
    desc: SegmentDesc
    version: str
    table: TableEncoder
    ends: list[int]  # ends[i]: the costs of regions 0..i together (TableEncoder.costs)
    whole: dict[str, Any] | None = None  # the answer to initiators that do not page, once built


class LocalSegment:
    """Builds the segment descriptor from the core's registry; serves Metadata/Probe/Notify.

    A Metadata request that asks for pages (``PAGE_KEY``: flagcx_mc initiators) is answered with
    the regions as a compact table, as many as fit one frame, and where they sit in the whole
    table; the initiator asks for the rest.  Any other request (Mooncake, and flagcx_mc before
    pages) gets the whole descriptor in the list form; when that does not fit one frame, Mooncake's
    keys alone (all a Mooncake peer reads); when even those do not fit, an error, logged here:
    never a shortened region list.
    """

    def __init__(self, core: CoreEngine, notifies: deque[TransferNotify],
                 shared_mappings: Callable[[], dict[int, tuple]] = dict,
                 max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self._core = core
        self._shared_mappings = shared_mappings  # managed memory same-host peers may map
        self._notifies = notifies
        self._boot_id = boot_id()
        self._gpu_shares: dict = {}  # (addr, key) -> GpuShare, or None for host memory
        self._max_length = max_length  # the largest frame this engine's handshake server sends
        self._snap: _Snapshot | None = None
        self._epoch = secrets.token_hex(4)  # table versions of this engine: epoch.counter
        self._versions = 0
        self.name = ""

    def desc(self) -> SegmentDesc:
        return self._snapshot().desc

    def _snapshot(self) -> _Snapshot:
        table = self._core.region_table()
        slots = self._core.region_slots()
        shared = self._shared_mappings()
        if len(slots) != len(table):  # registry changed between the two reads: no same-host hints
            slots = [(-1, 0)] * len(table)
        inputs = (table, slots, shared)
        snap = self._snap
        if snap is not None and snap.inputs == inputs and snap.desc.name == self.name:
            return snap
        live = {(a, k) for a, _, k in table}
        self._gpu_shares = {ak: share for ak, share in self._gpu_shares.items() if ak in live}
        regions = tuple(RegionDesc(addr=a, length=n, key=k, slot=sl, gen=g, cuda=self._gpu_share(a, k),
                                   shm=_whole_region(shared.get(a), n))
                        for (a, n, k), (sl, g) in zip(table, slots, strict=True))
        desc = SegmentDesc(
            name=self.name,
            protocol="tcp",
            tcp_data_port=self._core.data_port,
            tcp_proto_version=2,
            buffers=tuple(BufferDesc(name=self.name, addr=a, length=n) for a, n, _ in table),
            native=self._native(regions),
        )
        encoder = TableEncoder(regions)
        self._versions += 1
        self._snap = _Snapshot(inputs, desc, f"{self._epoch}.{self._versions}", encoder,
                               list(itertools.accumulate(encoder.costs())))
        return self._snap

    def _native(self, regions: tuple[RegionDesc, ...]) -> NativeInfo:
        return NativeInfo(
            version=NATIVE_VERSION,
            data_port=self._core.data_port,
            regions=regions,
            boot_id=self._boot_id,
            pid=os.getpid(),
            shm_fd=self._core.same_host_fd,
            shm_addr=self._core.same_host_addr,
        )

    def _gpu_share(self, addr: int, key: int):
        """GPU regions carry what same-host peers need to map them (exported once per
        registration: a region registered anew has a new key)."""
        if (addr, key) not in self._gpu_shares:
            self._gpu_shares[(addr, key)] = self._core.gpu_share(addr)
        return self._gpu_shares[(addr, key)]

    def desc_json(self) -> dict:
        """The whole descriptor, regions as a table: what a metadata server holds."""
        return self.desc().to_json_dict(compact=True)

    def request_json(self) -> dict:
        """What this engine sends in its own Metadata requests: its descriptor without regions.
        Targets, ours and Mooncake's, do not read the initiator's regions, and a table of any
        size must not keep this engine from reaching a peer."""
        return SegmentDesc(name=self.name, tcp_data_port=self._core.data_port, tcp_proto_version=2,
                           native=self._native(())).to_json_dict(compact=True)

    def handlers(self) -> dict[MessageType, Handler]:
        return {
            MessageType.METADATA: self._on_metadata,
            MessageType.PROBE: self._on_probe,
            MessageType.NOTIFY: self._on_notify,
            MessageType.CONNECTION: self._on_connection,
        }

    async def _on_metadata(self, message: Message) -> dict:
        snap = self._snapshot()
        want = message.payload.get(PAGE_KEY)
        if want is None:
            if snap.whole is None:
                snap.whole = self._whole_reply(snap)
            return snap.whole
        if not isinstance(want, dict):
            raise errors.MalformedJsonError(f"{PAGE_KEY}: expected a JSON object")
        start, limit = want.get("start", 0), want.get("max_length", self._max_length)
        if type(start) is not int or type(limit) is not int or start < 0:
            raise errors.MalformedJsonError(f"{PAGE_KEY}: start and max_length must be non-negative integers")
        return self._page_reply(snap, start, max(_MIN_PAGE_FRAME, min(limit, self._max_length)))

    def _page_reply(self, snap: _Snapshot, start: int, limit: int) -> dict:
        """Regions ``start`` onwards of ``snap``, as many as fit a frame of ``limit`` bytes."""
        desc, native = snap.desc, snap.desc.native
        assert native is not None
        regions, total = native.regions, len(native.regions)
        if start > total:
            return {"error": f"the region table ({snap.version}) has {total} regions, not {start}"}
        out = desc.mooncake_json(())
        head = native.header_json()
        out[NATIVE_KEY] = head
        budget = limit - len(orjson.dumps(out)) - _REPLY_RESERVE - TABLE_PAGE_SLACK
        base = snap.ends[start - 1] if start else 0
        stop = min(total, bisect.bisect_right(snap.ends, base + budget, lo=start))
        while True:
            if stop == start and start < total:
                log.warning("region %#x (%d of %d) cannot be described in a %d-byte handshake frame",
                            regions[start].addr, start, total, limit)
                return {"error": f"region {start} of {total} does not fit a {limit}-byte handshake frame"}
            head["table"] = snap.table.encode(start, stop, TablePage(snap.version, start, total))
            if len(orjson.dumps(out)) + _REPLY_RESERVE <= limit:
                return out
            stop = start + (stop - start) // 2  # table_costs is an upper bound: never expected

    def _whole_reply(self, snap: _Snapshot) -> dict:
        """The whole descriptor for an initiator that does not page (a Mooncake peer): as it has
        always been when it fits a frame, else Mooncake's keys alone, else an error."""
        desc = snap.desc
        full = desc.to_json_dict(compact=False)
        if self._fits(full):
            return full
        bare = desc.to_json_dict(native=False)
        n = len(desc.buffers)
        if self._fits(bare):
            log.info("%s: the descriptor of %d regions exceeds the %d-byte handshake frame; initiators that "
                     "do not read it in pages (Mooncake) get Mooncake's keys alone", self.name, n, self._max_length)
            return bare
        reason = (f"{n} registered regions do not fit the {self._max_length}-byte handshake frame "
                  f"(MC_HANDSHAKE_MAX_LENGTH) in Mooncake's descriptor format")
        log.warning("%s: refusing Metadata requests from initiators that do not read the descriptor in pages "
                    "(Mooncake): %s", self.name, reason)
        return {"error": reason}

    def _fits(self, payload: dict) -> bool:
        return len(orjson.dumps(payload)) + _REPLY_RESERVE <= self._max_length

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
