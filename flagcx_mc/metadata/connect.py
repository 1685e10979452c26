"""From a ``metadata_server`` argument to a store: Mooncake's connection strings.

Errors, the same for every backend:

- ``InvalidArgumentError``: bad URL, empty key or a key with surrounding whitespace, a
  value that is not a JSON-serialisable dict;
- ``DnsError``: the server's host does not resolve (HTTP);
- ``PeerConnectionError``: connection refused, reset or closed mid-answer;
- ``HandshakeTimeoutError``: no full answer within ``timeout`` seconds;
- ``RemoteProtocolError``: the server's answer is not valid HTTP/1.1;
- ``MetadataError``: the server refused the operation (HTTP status other than 2xx, with
  ``status`` and ``body`` on ``MetadataHttpError``; a Redis error reply, failed AUTH);
- ``MalformedJsonError``: a stored value is not a JSON object;
- ``NotSupportedError``: the ``redis`` package is not installed;
- ``EngineStateError``: the store was closed.

``get`` of a missing key returns ``None``; ``delete`` of a missing key succeeds (HTTP 404
counts as done), as Redis ``DEL`` does.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidArgumentError
from .etcd_store import EtcdMetadataStore, split_etcd_url
from .http_store import HttpMetadataStore, split_http_url
from .redis_store import RedisMetadataStore, split_redis_url
from .store import DEFAULT_TIMEOUT, MetadataStore, StoreSettings

__all__ = ["P2P_HANDSHAKE", "parse_metadata_server", "open_store"]

P2P_HANDSHAKE = "P2PHANDSHAKE"

_SCHEME_KIND = {"http": "http", "https": "http", "redis": "redis", "etcd": "etcd"}


def parse_metadata_server(url: str, metadata_type: str = "") -> tuple[str, str]:
    """Split a ``metadata_server`` argument into a store kind and a full URL.

    Mirrors Mooncake's ``parseConnectionString`` + ``initialize_ext`` (``buildConnString``):
    ``"P2PHANDSHAKE"`` means no store; a string without ``"://"`` gets
    ``metadata_type + "://"`` in front, and with no ``metadata_type`` it is an etcd
    endpoint. Schemes are compared case-insensitively.

    Returns:
        ``("p2p", "")``, ``("http", "http(s)://...")``, ``("redis", "redis://...")`` or
        ``("etcd", "etcd://...")``.

    Raises:
        InvalidArgumentError: empty, unknown scheme, or an HTTP/Redis/etcd URL without a host.
    """
    if not isinstance(url, str) or not url:
        raise InvalidArgumentError(f"metadata_server must be a non-empty str, not {url!r}")
    if not isinstance(metadata_type, str):
        raise InvalidArgumentError(f"metadata_type must be a str, not {metadata_type!r}")
    if url == P2P_HANDSHAKE:
        return "p2p", ""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = metadata_type or "etcd", url
    scheme = scheme.lower()
    kind = _SCHEME_KIND.get(scheme)
    if kind is None:
        raise InvalidArgumentError(
            f"unknown metadata server scheme {scheme!r} in {url!r}: expected "
            f"{P2P_HANDSHAKE}, http://, https://, redis:// or etcd://"
        )
    if not rest:
        raise InvalidArgumentError(f"no address in metadata server {url!r}")
    full = f"{scheme}://{rest}"
    if kind == "http":
        split_http_url(full)
    elif kind == "redis":
        split_redis_url(full)
    else:
        split_etcd_url(full)
    return kind, full


_STORES: dict[str, Callable[..., MetadataStore]] = {
    "http": HttpMetadataStore,
    "redis": RedisMetadataStore,
    "etcd": EtcdMetadataStore,
}


def open_store(kind: str, url: str, *, timeout: float = DEFAULT_TIMEOUT,
               settings: StoreSettings | None = None) -> MetadataStore:
    """The store for a ``(kind, url)`` pair from ``parse_metadata_server``, told ``settings``
    (credentials, database; an engine passes its ``EngineConfig.store_settings()``).

    Raises:
        NotSupportedError: ``redis`` without the ``redis`` package.
        InvalidArgumentError: ``p2p`` (no store), an unknown kind, or a malformed URL.
    """
    cls = _STORES.get(kind)
    if cls is None:
        raise InvalidArgumentError(
            f"no metadata store for kind {kind!r}"
            + (f" ({P2P_HANDSHAKE} exchanges metadata peer to peer)" if kind == "p2p" else "")
        )
    settings = settings or StoreSettings()
    if cls is HttpMetadataStore:
        return HttpMetadataStore(url, timeout=timeout, token=settings.http_token)
    if cls is RedisMetadataStore:
        return RedisMetadataStore(url, timeout=timeout, settings=settings)
    return cls(url, timeout=timeout)
