"""Segment descriptor: the JSON a peer returns for a METADATA handshake.

The common keys match Mooncake's ``encodeSegmentDesc`` for the ``tcp`` protocol, so a
Mooncake peer can read ours and we can read theirs. Our own data-plane details (native
port, registered regions with their keys) ride under the extra key ``"flagcx_mc"``, which
Mooncake ignores; a descriptor without it comes from a plain Mooncake peer.

The regions under ``"flagcx_mc"`` come in one of two forms: ``"regions"``, a list of objects
(what engines before the compact form read), or ``"table"``, parallel arrays of differences
(see ``encode_table``), about a tenth of the size for regions registered side by side.  A
table can be one page of a longer one (``TablePage``): a handshake reply carries at most one
frame's worth and the initiator asks for the rest (``control/resolvers.py``).

Decoding is strict because the descriptor comes off the network: addresses and lengths
from it end up steering remote writes.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import datetime
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import MalformedJsonError

__all__ = [
    "NATIVE_KEY",
    "PAGE_KEY",
    "BufferDesc",
    "GpuShare",
    "gpu_uuid_bytes",
    "gpu_uuid_text",
    "RegionDesc",
    "NativeInfo",
    "SegmentDesc",
    "TABLE_PAGE_SLACK",
    "TablePage",
    "TableEncoder",
    "decode_table",
    "encode_table",
    "now_timestamp",
]

NATIVE_KEY = "flagcx_mc"
# In a Metadata request: the initiator reads tables in pages, ``{"start", "version", "max_length"}``
# (the first region it wants, the table it is reading, the largest frame it accepts).
PAGE_KEY = "flagcx_mc_page"

_U64 = 1 << 64
_U32 = 1 << 32
MAX_GPU_CHUNKS = 8192  # VMM chunks of one region (the C core's FMC_CUDA_VMM_MAX_CHUNKS)


def now_timestamp() -> str:
    """Local time formatted like Mooncake's descriptor timestamps (microseconds)."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


@dataclass(frozen=True)
class BufferDesc:
    """One registered buffer as Mooncake describes it."""

    name: str
    addr: int
    length: int


@dataclass(frozen=True)
class GpuShare:
    """A GPU region, and how a same-host peer can map it: a legacy CUDA IPC handle (``cuMemAlloc``
    memory), or VMM chunks (``cuMemCreate`` memory, e.g. torch's expandable segments) as file
    descriptors of the owner's process.  Neither: peers still know it is GPU memory (TCP staging).

    ``device`` is the ordinal in the owner's process, which names another GPU (or none) in a
    process with other visible devices; ``uuid`` names the GPU itself (``GPU-`` and the UUID as
    nvidia-smi prints it; "" from peers that do not send it)."""

    device: int
    uuid: str = ""
    ipc: str = ""  # 64-byte handle as hex, with the allocation base it maps
    base: int = 0
    vmm: tuple[tuple[int, int, int], ...] = ()  # (base, size, fd) per chunk, in address order


@dataclass(frozen=True)
class RegionDesc:
    """One registered region as our native data plane addresses it (``key`` is a u32)."""

    addr: int
    length: int
    key: int
    slot: int = -1  # same-host control slot (-1: none), with its generation
    gen: int = 0
    cuda: GpuShare | None = None  # GPU memory
    shm: tuple | None = None   # engine-allocated shared memory: (memfd number in `pid`, size)


@dataclass(frozen=True)
class TablePage:
    """Where a table's regions sit in the whole table: regions ``start`` onwards of ``total``, of
    the table the target numbered ``version`` (a new number whenever its regions change)."""

    version: str
    start: int
    total: int


@dataclass(frozen=True)
class NativeInfo:
    """What a flagcx_mc peer adds to its descriptor under ``"flagcx_mc"``."""

    version: int
    data_port: int
    regions: tuple[RegionDesc, ...]
    boot_id: str
    pid: int
    shm_fd: int = -1  # fd number of the same-host control block in process `pid` (-1: none)
    shm_addr: int = 0  # its address there (peers probe it with process_vm_readv)
    page: TablePage | None = None  # set when ``regions`` is one page of a longer table

    @property
    def complete(self) -> bool:
        """``regions`` is the whole table."""
        return self.page is None or (self.page.start == 0 and self.page.total == len(self.regions))

    def to_json_dict(self, *, compact: bool = False) -> dict[str, Any]:
        """JSON form stored under the ``"flagcx_mc"`` key: regions as the list of objects (what
        engines before the table read), or as a table (``compact``)."""
        out: dict[str, Any] = {"version": self.version, "data_port": self.data_port}
        if compact:
            out["table"] = encode_table(self.regions)
        else:
            out["regions"] = [_region_json(r) for r in self.regions]
        out.update(self.header_json())
        return out

    def header_json(self) -> dict[str, Any]:
        """The block's keys other than its regions (``version`` and ``data_port`` included)."""
        out: dict[str, Any] = {"version": self.version, "data_port": self.data_port,
                               "boot_id": self.boot_id, "pid": self.pid}
        if self.shm_fd >= 0:
            out["shm_fd"], out["shm_addr"] = self.shm_fd, self.shm_addr
        return out

    @classmethod
    def from_json_dict(cls, d: object) -> NativeInfo:
        """Validate and decode the ``"flagcx_mc"`` object.

        Raises:
            MalformedJsonError: any key missing or of the wrong type or range.
        """
        obj = _as_object(d, NATIVE_KEY)
        page = None
        if "table" in obj:
            regions, page = decode_table(obj["table"], f"{NATIVE_KEY}.table")
        else:
            regions = _regions_from_list(_req_list(obj, "regions", NATIVE_KEY))
        return cls(
            version=_req_uint(obj, "version", NATIVE_KEY),
            data_port=_req_port(obj, "data_port", NATIVE_KEY),
            regions=tuple(regions),
            boot_id=_req_str(obj, "boot_id", NATIVE_KEY),
            pid=_req_uint(obj, "pid", NATIVE_KEY),
            shm_fd=_req_uint(obj, "shm_fd", NATIVE_KEY, bound=1 << 31) if "shm_fd" in obj else -1,
            shm_addr=_req_uint(obj, "shm_addr", NATIVE_KEY) if "shm_fd" in obj else 0,
            page=page,
        )


def _regions_from_list(items: list[Any]) -> list[RegionDesc]:
    """The list form: one object per region."""
    regions = []
    for i, item in enumerate(items):
        where = f"{NATIVE_KEY}.regions[{i}]"
        r = _as_object(item, where)
        addr = _req_uint(r, "addr", where)
        length = _req_uint(r, "length", where)
        if addr + length > _U64:
            raise MalformedJsonError(f"{where}: addr + length overflows 64 bits")
        slot, gen, cuda = -1, 0, None
        if "slot" in r:
            slot = _req_uint(r, "slot", where, bound=_U32)
            gen = _req_uint(r, "gen", where, bound=_U32)
        if "cuda" in r:
            cuda = _gpu_share(r["cuda"], addr, length, f"{where}.cuda")
        shm = None
        if "shm" in r:
            m = _as_object(r["shm"], f"{where}.shm")
            shm = (_req_uint(m, "fd", f"{where}.shm", bound=1 << 31), _req_uint(m, "size", f"{where}.shm"))
            if shm[1] != length:
                raise MalformedJsonError(f"{where}.shm: size differs from the region's length")
        regions.append(RegionDesc(addr, length, _req_uint(r, "key", where, bound=_U32), slot, gen, cuda, shm))
    return regions


def _gpu_share(value: object, addr: int, length: int, where: str) -> GpuShare:
    """``{"dev"}`` plus ``"ipc"`` and ``"base"``, or ``"vmm"``: chunks that, side by side, cover the region."""
    c = _as_object(value, where)
    device = _req_uint(c, "dev", where, bound=1024)
    uuid = _req_str(c, "uuid", where) if "uuid" in c else ""
    if uuid and gpu_uuid_bytes(uuid) is None:
        raise MalformedJsonError(f"{where}.uuid: not a GPU UUID")
    if "ipc" in c and "vmm" in c:
        raise MalformedJsonError(f"{where}: both ipc and vmm")
    if "ipc" in c:
        handle = _req_str(c, "ipc", where)
        if len(handle) != 128 or any(ch not in "0123456789abcdef" for ch in handle):
            raise MalformedJsonError(f"{where}.ipc: not a 64-byte hex handle")
        return GpuShare(device, uuid, ipc=handle, base=_req_uint(c, "base", where))
    if "vmm" not in c:
        return GpuShare(device, uuid)
    items = _req_list(c, "vmm", where)
    if not 0 < len(items) <= MAX_GPU_CHUNKS:
        raise MalformedJsonError(f"{where}.vmm: {len(items)} chunks (1 to {MAX_GPU_CHUNKS})")
    chunks: list[tuple[int, int, int]] = []
    for i, item in enumerate(items):
        if (not isinstance(item, list) or len(item) != 3
                or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in item)):
            raise MalformedJsonError(f"{where}.vmm[{i}]: not [base, size, fd]")
        base, size, fd = item
        if size == 0 or base + size > _U64 or fd >= 1 << 31:
            raise MalformedJsonError(f"{where}.vmm[{i}]: out of range")
        if chunks and base != chunks[-1][0] + chunks[-1][1]:
            raise MalformedJsonError(f"{where}.vmm[{i}]: not right after the chunk before")
        chunks.append((base, size, fd))
    if chunks[0][0] > addr or chunks[-1][0] + chunks[-1][1] < addr + length:
        raise MalformedJsonError(f"{where}.vmm: the chunks do not cover the region")
    return GpuShare(device, uuid, vmm=tuple(chunks))


def gpu_uuid_text(raw: bytes) -> str:
    """A 16-byte GPU UUID as nvidia-smi prints it: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def gpu_uuid_bytes(text: str) -> bytes | None:
    """The 16 bytes of a UUID in ``gpu_uuid_text``'s form (``GPU-`` and dashes optional), or None."""
    h = text.removeprefix("GPU-").replace("-", "")
    if len(h) != 32 or any(ch not in "0123456789abcdefABCDEF" for ch in h):
        return None
    return bytes.fromhex(h)


def _region_json(r: RegionDesc) -> dict[str, Any]:
    out: dict[str, Any] = {"addr": r.addr, "length": r.length, "key": r.key}
    if r.slot >= 0:
        out["slot"], out["gen"] = r.slot, r.gen
    if r.cuda is not None:
        out["cuda"] = _cuda_json(r.cuda)
    if r.shm is not None:
        out["shm"] = {"fd": r.shm[0], "size": r.shm[1]}
    return out


def _cuda_json(share: GpuShare) -> dict[str, Any]:
    out: dict[str, Any] = {"dev": share.device}  # the ordinal still, for peers that know no uuid
    if share.uuid:
        out["uuid"] = share.uuid
    if share.ipc:
        out.update(ipc=share.ipc, base=share.base)
    if share.vmm:
        out["vmm"] = [list(chunk) for chunk in share.vmm]
    return out


def encode_table(regions: Sequence[RegionDesc], page: TablePage | None = None) -> dict[str, Any]:
    """The compact form of ``regions``: parallel arrays, each number the difference from the
    region before, so that regions registered side by side cost a few bytes each.

    ``n``: how many regions; ``addr``: the gap from the end of the region before (the first
    region's address itself); ``length``, ``slot``, ``gen``: the difference from the region
    before (from 0, -1 and 0 for the first); ``key``: the keys as base64 of little-endian u32s
    (random numbers do not shrink as differences).  ``slot`` and ``gen`` are left out when no
    region has a same-host slot; ``cuda`` and ``shm`` map a region's index (a decimal string) to
    what the list form carries under those keys, and are left out when empty.  A page of a
    longer table adds ``version``, ``start`` and ``total`` (``TablePage``).
    """
    return TableEncoder(regions).encode(0, len(regions), page)


class TableEncoder:
    """``encode_table`` for any run of one table's regions: the differences are worked out once,
    so that a page costs a slice of them."""

    def __init__(self, regions: Sequence[RegionDesc]) -> None:
        self.regions = regions
        addrs, lengths, slots, gens = [], [], [], []
        end = length = gen = 0
        slot = -1
        for r in regions:
            addrs.append(r.addr - end)
            lengths.append(r.length - length)
            slots.append(r.slot - slot)
            gens.append(r.gen - gen)
            end, length, slot, gen = r.addr + r.length, r.length, r.slot, r.gen
        self._columns = (addrs, lengths, slots, gens)
        self._keys = struct.pack(f"<{len(regions)}I", *(r.key for r in regions))
        self._with_slots = any(r.slot >= 0 for r in regions)
        self._extras = [i for i, r in enumerate(regions) if r.cuda is not None or r.shm is not None]

    def costs(self) -> list[int]:
        """An upper bound of the bytes each region adds to the JSON text, for cutting the table
        into pages that fit a frame.  A page's first region is written from zero rather than
        from the region before: allow ``TABLE_PAGE_SLACK`` bytes per page for that."""
        addrs, lengths, slots, gens = self._columns
        # Two commas, and a key's 5.33 base64 characters.
        costs = [len(str(a)) + len(str(n)) + 8 for a, n in zip(addrs, lengths, strict=True)]
        if self._with_slots:
            costs = [c + len(str(s)) + len(str(g)) + 2 for c, s, g in zip(costs, slots, gens, strict=True)]
        for i in self._extras:
            r = self.regions[i]
            if r.cuda is not None:
                costs[i] += len(orjson.dumps(_cuda_json(r.cuda))) + 12  # "index": and a comma
            if r.shm is not None:
                costs[i] += len(orjson.dumps([r.shm[0], r.shm[1]])) + 12
        return costs

    def encode(self, start: int, stop: int, page: TablePage | None = None) -> dict[str, Any]:
        """Regions ``start`` to ``stop`` (not included) as a table of their own."""
        regions = self.regions
        columns = [c[start:stop] for c in self._columns]
        if start < stop:  # the first region from zero, not from the one before
            first = regions[start]
            columns[0][0], columns[1][0], columns[2][0], columns[3][0] = (
                first.addr, first.length, first.slot + 1, first.gen)
        out: dict[str, Any] = {
            "n": stop - start,
            "addr": columns[0],
            "length": columns[1],
            "key": base64.b64encode(self._keys[4 * start:4 * stop]).decode("ascii"),
        }
        if self._with_slots:
            out["slot"], out["gen"] = columns[2], columns[3]
        inside = self._extras[bisect.bisect_left(self._extras, start):bisect.bisect_left(self._extras, stop)]
        cuda = {str(i - start): _cuda_json(c) for i in inside if (c := regions[i].cuda) is not None}
        if cuda:
            out["cuda"] = cuda
        shm = {str(i - start): [m[0], m[1]] for i in inside if (m := regions[i].shm) is not None}
        if shm:
            out["shm"] = shm
        if page is not None:
            out["version"], out["start"], out["total"] = page.version, page.start, page.total
        return out


TABLE_PAGE_SLACK = 256  # TableEncoder.costs' allowance per page: a first region's full numbers, the keys' padding


def decode_table(value: object, where: str) -> tuple[list[RegionDesc], TablePage | None]:
    """Validate and decode ``encode_table``'s form; the page, if it is one.

    Raises:
        MalformedJsonError: a key missing, an array of the wrong length or with a non-integer,
            a region outside 64 bits, or a page that runs past its table's end.
    """
    t = _as_object(value, where)
    n = _req_uint(t, "n", where, bound=_U32)
    addrs = _int_list(t, "addr", where, n)
    lengths = _int_list(t, "length", where, n)
    try:
        raw = base64.b64decode(_req_str(t, "key", where), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedJsonError(f"{where}.key: not base64") from None
    if len(raw) != 4 * n:
        raise MalformedJsonError(f"{where}.key: {len(raw)} bytes for {n} regions")
    keys = struct.unpack(f"<{n}I", raw)
    if "slot" in t or "gen" in t:
        slots, gens = _int_list(t, "slot", where, n), _int_list(t, "gen", where, n)
    else:
        slots, gens = [0] * n, [0] * n  # every slot -1
    cuda = _by_index(t, "cuda", where, n)
    shm = _by_index(t, "shm", where, n)
    regions = []
    end = length = gen = 0
    slot = -1
    for i in range(n):
        addr = end + addrs[i]
        length += lengths[i]
        slot += slots[i]
        gen += gens[i]
        if not (0 <= addr < _U64 and 0 <= length < _U64 and addr + length <= _U64):
            raise MalformedJsonError(f"{where}: region {i} lies outside 64 bits")
        if not (-1 <= slot < _U32 and 0 <= gen < _U32):
            raise MalformedJsonError(f"{where}: region {i}'s same-host slot or generation is out of range")
        end = addr + length
        share = None
        if i in cuda:
            share = _gpu_share(cuda[i], addr, length, f"{where}.cuda.{i}")
        mapping = None
        if i in shm:
            item = shm[i]
            if (not isinstance(item, list) or len(item) != 2 or any(type(v) is not int for v in item)
                    or not 0 <= item[0] < 1 << 31 or item[1] != length):
                raise MalformedJsonError(f"{where}.shm.{i}: not [fd, the region's length]")
            mapping = (item[0], item[1])
        regions.append(RegionDesc(addr, length, keys[i], slot if slot >= 0 else -1, gen if slot >= 0 else 0,
                                  share, mapping))
    page = None
    if "version" in t:
        page = TablePage(_req_str(t, "version", where), _req_uint(t, "start", where, bound=_U32),
                         _req_uint(t, "total", where, bound=_U32))
        if page.start + n > page.total:
            raise MalformedJsonError(f"{where}: regions {page.start}..{page.start + n} of a table of {page.total}")
    return regions, page


def _int_list(obj: Mapping[str, Any], key: str, where: str, n: int) -> list[int]:
    items = _req_list(obj, key, where)
    if len(items) != n or any(type(v) is not int for v in items):
        raise MalformedJsonError(f"{where}.{key}: not {n} integers")
    return items


def _by_index(obj: Mapping[str, Any], key: str, where: str, n: int) -> dict[int, Any]:
    if key not in obj:
        return {}
    out = {}
    for index, item in _as_object(obj[key], f"{where}.{key}").items():
        if not index.isdigit() or int(index) >= n:
            raise MalformedJsonError(f"{where}.{key}: {index!r} is not a region index below {n}")
        out[int(index)] = item
    return out


@dataclass(frozen=True)
class SegmentDesc:
    """A segment descriptor; ``native`` is None for a plain Mooncake peer."""

    name: str
    protocol: str = "tcp"
    tcp_data_port: int = 0
    tcp_proto_version: int = 2
    timestamp: str = ""
    buffers: tuple[BufferDesc, ...] = ()
    native: NativeInfo | None = None

    def to_json_dict(self, *, compact: bool = False, native: bool = True) -> dict[str, Any]:
        """Mooncake's keys (plus ``"flagcx_mc"`` when native is set and wanted, its regions as a
        table if ``compact``, see ``NativeInfo.to_json_dict``); stamps the time if unset."""
        d = self.mooncake_json(self.buffers)
        if native and self.native is not None:
            d[NATIVE_KEY] = self.native.to_json_dict(compact=compact)
        return d

    def mooncake_json(self, buffers: Sequence[BufferDesc]) -> dict[str, Any]:
        """Mooncake's keys alone, listing ``buffers``."""
        return {
            "name": self.name,
            "protocol": self.protocol,
            "tcp_data_port": self.tcp_data_port,
            "tcp_proto_version": self.tcp_proto_version,
            "timestamp": self.timestamp or now_timestamp(),
            "buffers": [{"name": b.name, "addr": b.addr, "length": b.length} for b in buffers],
        }

    @classmethod
    def from_json_dict(cls, d: object) -> SegmentDesc:
        """Validate and decode a descriptor received from a peer.

        Unknown keys are ignored (Mooncake RDMA peers add ``devices``, ``rkey``...).
        ``tcp_proto_version`` defaults to 1 when absent, as Mooncake reads it.

        Raises:
            MalformedJsonError: a required key is missing (``name``, ``protocol``,
                ``buffers``, and ``tcp_data_port`` for ``tcp``), a value has the wrong type
                (a bool is not an int) or range, or a buffer has an empty name, a zero
                address or length, or wraps past 2**64.
        """
        obj = _as_object(d, "segment")
        protocol = _req_str(obj, "protocol", "segment")
        if protocol == "tcp" or "tcp_data_port" in obj:
            tcp_data_port = _req_port(obj, "tcp_data_port", "segment")
        else:
            tcp_data_port = 0
        buffers = []
        for i, item in enumerate(_req_list(obj, "buffers", "segment")):
            where = f"buffers[{i}]"
            b = _as_object(item, where)
            name = _req_str(b, "name", where)
            addr = _req_uint(b, "addr", where)
            length = _req_uint(b, "length", where)
            if not name or addr == 0 or length == 0:
                raise MalformedJsonError(f"{where}: empty name or zero addr/length")
            if addr + length > _U64:
                raise MalformedJsonError(f"{where}: addr + length overflows 64 bits")
            buffers.append(BufferDesc(name, addr, length))
        native = None
        if NATIVE_KEY in obj:
            native = NativeInfo.from_json_dict(obj[NATIVE_KEY])
        return cls(
            name=_req_str(obj, "name", "segment"),
            protocol=protocol,
            tcp_data_port=tcp_data_port,
            tcp_proto_version=(
                _req_uint(obj, "tcp_proto_version", "segment")
                if "tcp_proto_version" in obj
                else 1
            ),
            timestamp=_req_str(obj, "timestamp", "segment") if "timestamp" in obj else "",
            buffers=tuple(buffers),
            native=native,
        )


def _as_object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MalformedJsonError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _require(obj: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise MalformedJsonError(f"{where}: missing key {key!r}") from None


def _req_str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = _require(obj, key, where)
    if not isinstance(value, str):
        raise MalformedJsonError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _req_list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = _require(obj, key, where)
    if not isinstance(value, list):
        raise MalformedJsonError(f"{where}.{key}: expected an array, got {type(value).__name__}")
    return value


def _req_uint(obj: Mapping[str, Any], key: str, where: str, *, bound: int = _U64) -> int:
    value = _require(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedJsonError(f"{where}.{key}: expected an integer, got {type(value).__name__}")
    if not 0 <= value < bound:
        raise MalformedJsonError(f"{where}.{key}: {value} is outside 0..{bound - 1}")
    return value


def _req_port(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _req_uint(obj, key, where)
    if value > 65535:
        raise MalformedJsonError(f"{where}.{key}: port {value} is outside 0..65535")
    return value
