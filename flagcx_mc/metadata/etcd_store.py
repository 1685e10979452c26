"""An etcd metadata store: Mooncake's default when ``metadata_server`` has no scheme.

Mooncake's etcd plugin (a Go etcd v3 client) keeps each key (``keys.segment_key`` /
``rpc_meta_key``) with its JSON text as the value.  etcd also serves its v3 API as JSON over
HTTP (the gRPC gateway, on by default on the client port: ``POST /v3/kv/put``, ``/v3/kv/range``,
``/v3/kv/deleterange``, keys and values base64-encoded), so this store needs no gRPC stack and
reads and writes the very keys a Mooncake node uses: a flagcx_mc engine and a Mooncake engine
on one etcd find each other by name.

URL: ``etcd://host[:port]`` (port 2379), or several endpoints of one cluster separated by
``;`` or ``,`` (``etcd://10.0.0.1:2379;10.0.0.2:2379``), as Mooncake takes them.  A request that
cannot reach an endpoint tries the next one; the answer of the first one reached counts.
Plain HTTP only, without etcd authentication (Mooncake's plugin uses neither).

Errors are those of every store (``flagcx_mc.metadata.connect``); an answer that is not etcd's JSON is a
``RemoteProtocolError``, an etcd error answer (HTTP status other than 2xx) a ``MetadataHttpError``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any
from urllib.parse import urlsplit

import orjson

from ..errors import (
    EngineStateError,
    InvalidArgumentError,
    PeerConnectionError,
    RemoteProtocolError,
)
from ..net.addresses import format_host_port
from .http_store import check_http_status, http_request
from .store import (
    DEFAULT_TIMEOUT,
    MetadataStore,
    check_key,
    check_timeout,
    decode_value,
    encode_value,
    json_object,
)

__all__ = ["ETCD_DEFAULT_PORT", "EtcdMetadataStore", "split_etcd_url"]

ETCD_DEFAULT_PORT = 2379


def split_etcd_url(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` endpoints of ``etcd://host[:port][;host[:port]...]``.

    Raises:
        InvalidArgumentError: not etcd://, no endpoint, a bad port, or a path, query or user info.
    """
    if not isinstance(url, str) or not url.lower().startswith("etcd://"):
        raise InvalidArgumentError(f"etcd URL {url!r} does not start with etcd://")
    endpoints = []
    for part in url[len("etcd://"):].replace(",", ";").split(";"):
        if not part:
            continue
        try:
            parts = urlsplit("etcd://" + part)
            port = parts.port
        except ValueError as exc:
            raise InvalidArgumentError(f"invalid etcd endpoint {part!r} in {url!r}: {exc}") from None
        if not parts.hostname:
            raise InvalidArgumentError(f"no host in etcd endpoint {part!r} of {url!r}")
        if parts.username is not None or parts.path or parts.query or parts.fragment:
            raise InvalidArgumentError(f"etcd endpoint {part!r} of {url!r} must be host[:port]")
        endpoints.append((parts.hostname, port if port is not None else ETCD_DEFAULT_PORT))
    if not endpoints:
        raise InvalidArgumentError(f"no endpoint in etcd URL {url!r}")
    return endpoints


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class EtcdMetadataStore(MetadataStore):
    """Keys in an etcd cluster, through etcd's v3 JSON API.

    Args:
        url: ``etcd://host[:port]``, or endpoints separated by ``;`` or ``,``.
        timeout: seconds for one request to one endpoint, connect included.

    Raises:
        InvalidArgumentError: a malformed URL or timeout.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._endpoints = split_etcd_url(url)
        self._url = url
        self._timeout = check_timeout(timeout)
        self._closed = False

    @property
    def url(self) -> str:
        """The URL the store was opened with."""
        return self._url

    async def get(self, key: str) -> dict[str, Any] | None:
        """The object stored under ``key``, or ``None`` if etcd has no such key."""
        answer = await self._call("range", key, {"key": _b64(key.encode())})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        try:
            raw = base64.b64decode(kvs[0]["value"], validate=True) if kvs[0].get("value") else b""
        except (KeyError, TypeError, binascii.Error) as exc:
            raise RemoteProtocolError(f"etcd range {key!r} on {self._url}: bad value in answer: {exc}") from None
        return decode_value(key, raw)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` as JSON text under ``key``."""
        body = encode_value(key, value)
        await self._call("put", key, {"key": _b64(key.encode()), "value": _b64(body)})

    async def delete(self, key: str) -> None:
        """Remove ``key`` (etcd reports nothing deleted for a missing key: not an error)."""
        await self._call("deleterange", key, {"key": _b64(key.encode())})

    async def close(self) -> None:
        """Mark the store closed (it holds no connection between requests)."""
        self._closed = True

    async def _call(self, op: str, key: str, request: dict[str, Any]) -> dict[str, Any]:
        """POST ``/v3/kv/<op>`` to the first endpoint that answers; its JSON answer."""
        check_key(key)
        if self._closed:
            raise EngineStateError("metadata store is closed")
        body = orjson.dumps(request)
        unreachable: PeerConnectionError | None = None
        what = f"etcd {op} {key!r}"
        for host, port in self._endpoints:
            where = f"etcd://{format_host_port(host, port)}"
            try:
                status, answer = await http_request(host, port, "POST", f"/v3/kv/{op}", body, url=where,
                                                    timeout=self._timeout, what=what)
            except PeerConnectionError as exc:
                unreachable = exc  # try the cluster's next member
                continue
            check_http_status(what, where, status, answer)
            return json_object(answer, RemoteProtocolError, f"{what} on {where}: the answer")
        assert unreachable is not None
        raise unreachable
