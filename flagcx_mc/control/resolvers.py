"""How a session name becomes (host, rpc port, segment descriptor).

P2PHANDSHAKE: the name is ``host:rpc_port`` and the peer itself answers a Metadata request.
Metadata server (HTTP, Redis, etcd): the name is any segment name; its descriptor and rpc location
live under Mooncake's keys (``mooncake/ram/<name>``, ``mooncake/rpc_meta/<name>``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

from .. import errors
from ..metadata.descriptor import PAGE_KEY, BufferDesc, NativeInfo, RegionDesc, SegmentDesc
from ..metadata.keys import rpc_meta_key, segment_key
from ..metadata.store import MetadataStore
from ..net.addresses import parse_host_port
from .auth import authed_request
from .codec import DEFAULT_MAX_LENGTH, MessageType
from .handshake import request

__all__ = ["Resolver", "P2PResolver", "StoreResolver"]

log = logging.getLogger(__name__)

Resolved = tuple[str, int, SegmentDesc]


class Resolver(Protocol):
    async def resolve(self, name: str) -> Resolved: ...


class P2PResolver:
    """Ask the peer: Metadata round trips on its rpc port.

    The request carries our descriptor without regions (``LocalSegment.request_json``) and asks
    for the table in pages (``PAGE_KEY``).  A flagcx_mc target answers with as many regions as fit
    one frame and where they sit in its table; the rest comes with further requests, one
    connection each, all of one table version.  A page of another version (the target's regions
    changed meanwhile) starts the reading over, at most ``MAX_TABLE_READS`` times; a partial table
    is never used.  Mooncake targets, and flagcx_mc targets from before pages, ignore the request
    key and answer the whole descriptor.
    """

    MAX_TABLE_READS = 8

    def __init__(self, local_desc: Callable[[], dict], timeout: float, secret: bytes | None = None,
                 max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self._local_desc = local_desc
        self._timeout = timeout
        self._secret = secret
        self._max_length = max_length

    async def resolve(self, name: str) -> Resolved:
        try:
            host, port = parse_host_port(name)
        except errors.FlagcxMcError as exc:
            raise errors.InvalidArgumentError(f"bad session name {name!r}: {exc}") from None
        local = self._local_desc()
        for _ in range(self.MAX_TABLE_READS):
            desc = await self._page(host, port, local, 0, None)
            native = desc.native
            if native is None or native.page is None:
                return host, port, desc
            regions = list(native.regions)
            while len(regions) < native.page.total:
                more = (await self._page(host, port, local, len(regions), native.page.version)).native
                if not _same_table(native, more, len(regions)):
                    log.info("%s: its region table changed while it was being read; reading it again", name)
                    break
                assert more is not None
                if not more.regions:
                    raise errors.RemoteProtocolError(f"{name} sent an empty page of its region table")
                regions.extend(more.regions)
            else:
                return host, port, _whole(desc, regions)
        raise errors.HandshakeRejectedError(
            f"{name}: its region table changed during each of {self.MAX_TABLE_READS} readings")

    async def _page(self, host: str, port: int, local: dict, start: int, version: str | None) -> SegmentDesc:
        want: dict = {"start": start, "max_length": self._max_length}
        if version is not None:
            want["version"] = version
        reply = await authed_request(self._secret, host, port, MessageType.METADATA, {**local, PAGE_KEY: want},
                                     timeout=self._timeout, max_length=self._max_length)
        return SegmentDesc.from_json_dict(reply)


def _same_table(first: NativeInfo, page: NativeInfo | None, start: int) -> bool:
    """``page`` continues, at region ``start``, the table whose first page is ``first``."""
    return (page is not None and page.page is not None and first.page is not None
            and page.page.version == first.page.version and page.page.start == start
            and page.page.total == first.page.total and page.pid == first.pid
            and page.boot_id == first.boot_id and page.data_port == first.data_port)


def _whole(desc: SegmentDesc, regions: list[RegionDesc]) -> SegmentDesc:
    """The first page's descriptor with every page's regions (and Mooncake's ``buffers`` for
    them: the pages leave them out)."""
    assert desc.native is not None
    native = dataclasses.replace(desc.native, regions=tuple(regions), page=None)
    buffers = tuple(BufferDesc(desc.name, r.addr, r.length) for r in regions)
    return dataclasses.replace(desc, native=native, buffers=buffers)


class StoreResolver:
    """Read the segment and its rpc location from a metadata server."""

    def __init__(self, store: MetadataStore, probe_timeout: float = 2.0, cluster_id: str = "") -> None:
        self._store = store
        self._cluster = cluster_id
        self._probe_timeout = probe_timeout
        self._mine: dict | None = None  # our rpc_meta entry, once published

    async def resolve(self, name: str) -> Resolved:
        meta = await self._store.get(rpc_meta_key(name, self._cluster))
        raw = await self._store.get(segment_key(name, self._cluster))
        if meta is None or raw is None:
            raise errors.MetadataError(f"segment {name!r} is not published on the metadata server")
        host, port = meta.get("ip_or_host_name"), meta.get("rpc_port")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise errors.MalformedJsonError(f"bad rpc_meta entry for {name!r}: {meta!r}")
        desc = SegmentDesc.from_json_dict(raw)
        if desc.native is not None and not desc.native.complete:
            raise errors.MalformedJsonError(f"the metadata server holds part of {name!r}'s region table")
        return host, port, desc

    async def publish(self, name: str, host: str, port: int, desc: dict) -> None:
        """Claim ``name``.  An entry left by a dead engine (a restart) is replaced; one whose
        engine still answers a Probe is a name clash and an error."""
        mine = {"ip_or_host_name": host, "rpc_port": port}
        previous = await self._store.get(rpc_meta_key(name, self._cluster))
        if previous is not None and previous != mine:
            if await self._answers_probe(previous):
                raise errors.MetadataError(
                    f"segment name {name!r} is in use by a live engine at "
                    f"{previous.get('ip_or_host_name')}:{previous.get('rpc_port')}"
                )
            await self._store.delete(rpc_meta_key(name, self._cluster))  # the HTTP server refuses to overwrite it
        self._mine = mine  # from here on the name is ours to withdraw (even if the next put fails)
        await self._store.put(rpc_meta_key(name, self._cluster), mine)
        await self._store.put(segment_key(name, self._cluster), desc)

    async def _answers_probe(self, entry: dict) -> bool:
        host, port = entry.get("ip_or_host_name"), entry.get("rpc_port")
        if not isinstance(host, str) or type(port) is not int:
            return False
        try:
            await request(host, port, MessageType.PROBE, {}, timeout=self._probe_timeout)
            return True
        except errors.FlagcxMcError:
            return False

    async def update(self, name: str, desc: dict) -> None:
        """Publish a new descriptor (regions changed), unless the name now belongs to another
        engine: its descriptor must not be replaced by ours.  An entry that vanished (a metadata
        server restarted empty) is put back, so peers find us again."""
        if self._mine is None:
            return
        current = await self._store.get(rpc_meta_key(name, self._cluster))
        if current is not None and current != self._mine:
            log.warning("segment name %r is now held by the engine at %s:%s; this engine's regions are no "
                        "longer published under it", name, current.get("ip_or_host_name"), current.get("rpc_port"))
            return
        if current is None:
            await self._store.put(rpc_meta_key(name, self._cluster), self._mine)
        await self._store.put(segment_key(name, self._cluster), desc)

    async def withdraw(self, name: str) -> None:
        """Remove our entries, best effort.  Only what this engine published: an engine that was
        refused the name, or whose name another engine has since claimed (it took us for dead),
        leaves the keys to their owner."""
        mine, self._mine = self._mine, None
        if mine is None:
            return
        try:
            current = await self._store.get(rpc_meta_key(name, self._cluster))
            if current is not None and current != mine:
                return
            for key in (segment_key(name, self._cluster), rpc_meta_key(name, self._cluster)):
                await self._store.delete(key)
        except errors.FlagcxMcError:
            pass

    async def close(self) -> None:
        await self._store.close()
