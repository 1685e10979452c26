"""How a session name becomes (host, rpc port, segment descriptor).

P2PHANDSHAKE: the name is ``host:rpc_port`` and the peer itself answers a Metadata request.
Metadata server (HTTP, Redis, etcd): the name is any segment name; its descriptor and rpc location
live under Mooncake's keys (``mooncake/ram/<name>``, ``mooncake/rpc_meta/<name>``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from .. import errors
from ..metadata.descriptor import SegmentDesc
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
    """Ask the peer: a Metadata round trip on its rpc port (our descriptor goes with it)."""

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
        reply = await authed_request(self._secret, host, port, MessageType.METADATA, self._local_desc(),
                                     timeout=self._timeout, max_length=self._max_length)
        return host, port, SegmentDesc.from_json_dict(reply)


class StoreResolver:
    """Read the segment and its rpc location from a metadata server."""

    def __init__(self, store: MetadataStore, probe_timeout: float = 2.0) -> None:
        self._store = store
        self._probe_timeout = probe_timeout
        self._mine: dict | None = None  # our rpc_meta entry, once published

    async def resolve(self, name: str) -> Resolved:
        meta = await self._store.get(rpc_meta_key(name))
        raw = await self._store.get(segment_key(name))
        if meta is None or raw is None:
            raise errors.MetadataError(f"segment {name!r} is not published on the metadata server")
        host, port = meta.get("ip_or_host_name"), meta.get("rpc_port")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise errors.MalformedJsonError(f"bad rpc_meta entry for {name!r}: {meta!r}")
        return host, port, SegmentDesc.from_json_dict(raw)

    async def publish(self, name: str, host: str, port: int, desc: dict) -> None:
        """Claim ``name``.  An entry left by a dead engine (a restart) is replaced; one whose
        engine still answers a Probe is a name clash and an error."""
        mine = {"ip_or_host_name": host, "rpc_port": port}
        previous = await self._store.get(rpc_meta_key(name))
        if previous is not None and previous != mine:
            if await self._answers_probe(previous):
                raise errors.MetadataError(
                    f"segment name {name!r} is in use by a live engine at "
                    f"{previous.get('ip_or_host_name')}:{previous.get('rpc_port')}"
                )
            await self._store.delete(rpc_meta_key(name))  # the HTTP server refuses to overwrite it
        self._mine = mine  # from here on the name is ours to withdraw (even if the next put fails)
        await self._store.put(rpc_meta_key(name), mine)
        await self._store.put(segment_key(name), desc)

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
        current = await self._store.get(rpc_meta_key(name))
        if current is not None and current != self._mine:
            log.warning("segment name %r is now held by the engine at %s:%s; this engine's regions are no "
                        "longer published under it", name, current.get("ip_or_host_name"), current.get("rpc_port"))
            return
        if current is None:
            await self._store.put(rpc_meta_key(name), self._mine)
        await self._store.put(segment_key(name), desc)

    async def withdraw(self, name: str) -> None:
        """Remove our entries, best effort.  Only what this engine published: an engine that was
        refused the name, or whose name another engine has since claimed (it took us for dead),
        leaves the keys to their owner."""
        mine, self._mine = self._mine, None
        if mine is None:
            return
        try:
            current = await self._store.get(rpc_meta_key(name))
            if current is not None and current != mine:
                return
            for key in (segment_key(name), rpc_meta_key(name)):
                await self._store.delete(key)
        except errors.FlagcxMcError:
            pass

    async def close(self) -> None:
        await self._store.close()
