"""Central metadata stores: where engines publish segments and find each other by name.

With a metadata server (anything but ``P2PHANDSHAKE``) Mooncake keeps two kinds of keys,
both holding one JSON object:

- ``segment_key(name)``  -> the segment descriptor (``flagcx_mc.metadata.SegmentDesc``);
- ``rpc_meta_key(name)`` -> ``{"ip_or_host_name": str, "rpc_port": int}``, where the
  engine's handshake listener is.

Three backends are built in: HTTP (Mooncake's HTTP storage plugin, served by
``flagcx_mc.metadata_server`` or Mooncake's own ``http_metadata_server``), Redis
(``pip install flagcx_mc[redis]``) and etcd (``flagcx_mc.metastore_etcd``: etcd's v3 JSON
API over HTTP, the same keys and values Mooncake's etcd client keeps).

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

import abc
import asyncio
import logging
import os
import socket
import ssl
from typing import Any, Callable
from urllib.parse import quote, urlsplit

import orjson

from . import _http
from .errors import (
    DnsError,
    EngineStateError,
    FlagcxMcError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    MalformedJsonError,
    MetadataError,
    NotSupportedError,
    PeerConnectionError,
    RemoteProtocolError,
)
from .netaddr import format_host_port

__all__ = [
    "P2P_HANDSHAKE",
    "DEFAULT_TIMEOUT",
    "key_prefix",
    "segment_key",
    "rpc_meta_key",
    "parse_metadata_server",
    "MetadataStore",
    "MetadataHttpError",
    "HttpMetadataStore",
    "RedisMetadataStore",
    "check_http_status",
    "format_request",
    "http_roundtrip",
    "open_store",
]

_log = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_TIMEOUT = 3.0  # Mooncake's HTTP plugin: CURLOPT_TIMEOUT_MS 3000
REDIS_DEFAULT_PORT = 6379
_MAX_RESPONSE_BODY = 64 * 1024 * 1024


# --- key layout --------------------------------------------------------------------------
#
# Implemented exactly as Mooncake's TransferMetadata (transfer_metadata.cpp):
#   prefix      = "mooncake/" + C, where C = $MC_METADATA_CLUSTER_ID with a "/" appended
#                 unless it already ends in one; C = "" when the variable is unset or empty
#   segment key = prefix + "ram/" + name     (getFullMetadataKey, name without "/")
#               = prefix + name              (name already containing "/" is a path)
#   rpc key     = prefix + "rpc_meta/" + name
# e.g. MC_METADATA_CLUSTER_ID=prod: "mooncake/prod/ram/10.0.0.5:15873" and
# "mooncake/prod/rpc_meta/10.0.0.5:15873". Mooncake reads the variable once per engine;
# these functions read it at each call unless ``cluster_id`` is passed.


def key_prefix(cluster_id: str | None = None) -> str:
    """The common key prefix: ``"mooncake/"`` or ``"mooncake/<cluster_id>/"``.

    Args:
        cluster_id: ``None`` reads ``MC_METADATA_CLUSTER_ID``; ``""`` means no cluster id.
    """
    if cluster_id is None:
        cluster_id = os.environ.get("MC_METADATA_CLUSTER_ID", "")
    if cluster_id and not cluster_id.endswith("/"):
        cluster_id += "/"
    return "mooncake/" + cluster_id


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} must be a non-empty str, not {name!r}")


def segment_key(name: str, cluster_id: str | None = None) -> str:
    """Key of a segment descriptor (Mooncake's ``getFullMetadataKey``).

    Raises:
        InvalidArgumentError: ``name`` is empty.
    """
    _check_name(name, "segment name")
    if "/" in name:
        return key_prefix(cluster_id) + name
    return key_prefix(cluster_id) + "ram/" + name


def rpc_meta_key(name: str, cluster_id: str | None = None) -> str:
    """Key of an engine's RPC location ``{"ip_or_host_name", "rpc_port"}``.

    Raises:
        InvalidArgumentError: ``name`` is empty.
    """
    _check_name(name, "server name")
    return key_prefix(cluster_id) + "rpc_meta/" + name


# --- connection strings ------------------------------------------------------------------

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
        _split_http_url(full)
    elif kind == "redis":
        _split_redis_url(full)
    else:
        from .metastore_etcd import split_etcd_url

        split_etcd_url(full)
    return kind, full


# --- the store interface -----------------------------------------------------------------


class MetadataStore(abc.ABC):
    """Async key/value store of JSON objects, one per key.

    Usable as ``async with``; ``close`` is idempotent.
    """

    @abc.abstractmethod
    async def get(self, key: str) -> dict[str, Any] | None:
        """The object stored under ``key``, or ``None`` if there is none."""

    @abc.abstractmethod
    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` under ``key``, replacing what was there."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; later calls raise ``EngineStateError``."""

    async def __aenter__(self) -> "MetadataStore":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _check_key(key: str) -> None:
    # The reference HTTP server strips the key, so " k" and "k" would collide there.
    if not isinstance(key, str) or not key or key != key.strip():
        raise InvalidArgumentError(
            f"metadata key must be a non-empty str without surrounding whitespace, not {key!r}"
        )


def _encode(key: str, value: dict[str, Any]) -> bytes:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"value for {key!r} must be a dict, not {type(value).__name__}")
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        raise InvalidArgumentError(f"value for {key!r} is not JSON-serialisable: {exc}") from None


def _json_object(raw: bytes, error: type[FlagcxMcError], what: str) -> dict[str, Any]:
    """``raw`` parsed as one JSON object, else ``error`` saying what ``what`` was."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{what} is a {type(value).__name__}, not an object")
    return value


def _decode(key: str, raw: bytes) -> dict[str, Any]:
    return _json_object(raw, MalformedJsonError, f"value of {key!r}")


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a positive number, not {timeout!r}")
    return float(timeout)


# --- HTTP --------------------------------------------------------------------------------


class MetadataHttpError(MetadataError):
    """The HTTP metadata server answered with a status other than 2xx (or 404 on ``get``)."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def _split_http_url(url: str) -> tuple[bool, str, int, str]:
    """``(https, host, port, request-target prefix)`` of an http(s) URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"invalid metadata server URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidArgumentError(f"metadata server URL {url!r} is not http:// or https://")
    if not parts.hostname:
        raise InvalidArgumentError(f"no host in metadata server URL {url!r}")
    if parts.username is not None or parts.fragment:
        raise InvalidArgumentError(f"metadata server URL {url!r} may not carry user info or a fragment")
    https = scheme == "https"
    if port is None:
        port = 443 if https else 80
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    target = path + (f"?{parts.query}&" if parts.query else "?")
    return https, parts.hostname, port, target


class HttpMetadataStore(MetadataStore):
    """Mooncake's HTTP metadata protocol: ``GET|PUT|DELETE <url>?key=<escaped key>``.

    One connection per request (``Connection: close``); values travel as JSON bodies.
    If ``MC_METADATA_HTTP_TOKEN`` is set (or ``token`` given), every request carries
    ``Authorization: Bearer <token>``, as Mooncake's plugin does.

    Args:
        url: ``http://host:port/metadata`` or ``https://...`` (system CA store).
        timeout: seconds for a whole request, connect included.
        token: bearer token; ``None`` reads ``MC_METADATA_HTTP_TOKEN``.

    Raises:
        InvalidArgumentError: a malformed URL or timeout.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, *, token: str | None = None) -> None:
        https, self._host, self._port, self._target = _split_http_url(url)
        self._url = url
        self._timeout = _check_timeout(timeout)
        self._ssl = ssl.create_default_context() if https else None
        # Host header: the port only when it is not the scheme's default (RFC 9110 7.2).
        if self._port == (443 if https else 80):
            self._host_header = f"[{self._host}]" if ":" in self._host else self._host
        else:
            self._host_header = format_host_port(self._host, self._port)
        if token is None:
            token = os.environ.get("MC_METADATA_HTTP_TOKEN") or None
        if token is not None and any(c in token for c in "\r\n\0"):
            raise InvalidArgumentError("metadata token may not contain CR, LF or NUL")
        self._token = token
        self._closed = False

    @property
    def url(self) -> str:
        """The server URL requests go to."""
        return self._url

    async def get(self, key: str) -> dict[str, Any] | None:
        """The object stored under ``key``; ``None`` on HTTP 404.

        Raises:
            MetadataHttpError: any status but 2xx and 404.
            MalformedJsonError: the stored value is not a JSON object.
        """
        status, body = await self._request("GET", key, None)
        if status == 404:
            return None
        self._check_status("GET", key, status, body)
        return _decode(key, body)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` under ``key`` (``PUT``; the server may refuse, e.g. 400 for an
        ``rpc_meta`` key that already holds another value).

        Raises:
            MetadataHttpError: any status but 2xx.
        """
        body = _encode(key, value)
        status, answer = await self._request("PUT", key, body)
        self._check_status("PUT", key, status, answer)

    async def delete(self, key: str) -> None:
        """Remove ``key``; 404 (already absent) counts as success.

        Raises:
            MetadataHttpError: any status but 2xx and 404.
        """
        status, body = await self._request("DELETE", key, None)
        if status != 404:
            self._check_status("DELETE", key, status, body)

    async def close(self) -> None:
        """Mark the store closed (it holds no connection between requests)."""
        self._closed = True

    def _check_status(self, method: str, key: str, status: int, body: bytes) -> None:
        check_http_status(f"{method} {key!r}", self._url, status, body)

    async def _request(self, method: str, key: str, body: bytes | None) -> tuple[int, bytes]:
        _check_key(key)
        if self._closed:
            raise EngineStateError("metadata store is closed")
        target = self._target + "key=" + quote(key, safe="")
        extra = (f"Authorization: Bearer {self._token}",) if self._token is not None else ()
        try:
            message = format_request(method, target, self._host_header, body, extra)
        except UnicodeEncodeError:
            raise InvalidArgumentError("metadata token must be latin-1 text") from None
        return await http_roundtrip(self._host, self._port, message, method, self._url, self._timeout,
                                    what=f"{method} {key!r}", ssl_context=self._ssl)


def format_request(method: str, target: str, host_header: str, body: bytes | None,
                   extra_headers: tuple[str, ...] = ()) -> bytes:
    """One HTTP/1.1 request as the metadata clients send it: JSON in and out, one connection per
    request.  Raises UnicodeEncodeError for header text that is not latin-1."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host_header}", "User-Agent: flagcx_mc",
             "Accept: application/json", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += extra_headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def check_http_status(what: str, url: str, status: int, body: bytes) -> None:
    """Raise ``MetadataHttpError`` (with the start of the body) unless ``status`` is 2xx."""
    if 200 <= status < 300:
        return
    text = body[:1024].decode("utf-8", "replace")
    raise MetadataHttpError(f"{what} on {url}: HTTP {status}: {text}", status, text)


async def http_roundtrip(host: str, port: int, message: bytes, method: str, url: str, timeout: float, *,
                         what: str, ssl_context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request (``Connection: close``) and read its answer: ``(status, body)``.

    The errors are the module's: ``DnsError``, ``PeerConnectionError``, ``HandshakeTimeoutError``
    (no full answer within ``timeout``), ``RemoteProtocolError``.  ``url`` and ``what`` name the
    server and the operation in their messages.
    """
    try:
        return await asyncio.wait_for(_exchange(host, port, message, method, url, ssl_context), timeout)
    except asyncio.TimeoutError:
        raise HandshakeTimeoutError(f"{what} on {url}: no answer within {timeout}s") from None


async def _exchange(host: str, port: int, message: bytes, method: str, url: str,
                    ssl_context: ssl.SSLContext | None) -> tuple[int, bytes]:
    try:
        reader, writer = await asyncio.open_connection(
            host,
            port,
            ssl=ssl_context,
            server_hostname=host if ssl_context is not None else None,
            limit=_http.MAX_HEAD,
        )
    except socket.gaierror as exc:
        raise DnsError(f"cannot resolve metadata server {url}: {exc}") from None
    except OSError as exc:
        raise PeerConnectionError(f"cannot connect to metadata server {url}: {exc}") from None
    try:
        writer.write(message)
        await writer.drain()
        return await _read_response(reader, method)
    except _http.HttpViolation as exc:
        raise RemoteProtocolError(f"bad answer from metadata server {url}: {exc}") from None
    except asyncio.IncompleteReadError:
        raise PeerConnectionError(f"metadata server {url} closed the connection before a full answer") from None
    except FlagcxMcError:
        raise
    except OSError as exc:
        raise PeerConnectionError(f"connection to metadata server {url} failed: {exc}") from None
    finally:
        await _http.close_writer(writer)


async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[int, bytes]:
    while True:
        head = _http.parse_response_head(await _http.read_head(reader))
        status = int(head.start[0])
        if status >= 200:
            break
        if status == 101:
            raise _http.HttpViolation("unexpected protocol switch")
        # 1xx: an interim answer (100 Continue); the real one follows.
    if method == "HEAD" or status in (204, 304):
        return status, b""
    if head.get("transfer-encoding") is None and head.get("content-length") is None:
        return status, await _http.read_until_eof(reader, _MAX_RESPONSE_BODY)
    framing = _http.body_framing(head, _MAX_RESPONSE_BODY)
    return status, await _http.read_body(reader, framing, _MAX_RESPONSE_BODY)


# --- Redis -------------------------------------------------------------------------------


def _split_redis_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``redis://host[:port]`` (the only form Mooncake accepts)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"invalid Redis URL {url!r}: {exc}") from None
    if parts.scheme.lower() != "redis":
        raise InvalidArgumentError(f"Redis URL {url!r} does not start with redis://")
    if not parts.hostname:
        raise InvalidArgumentError(f"no host in Redis URL {url!r}")
    if parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidArgumentError(
            f"Redis URL {url!r} must be redis://host[:port]; credentials and database come "
            "from MC_REDIS_USERNAME, MC_REDIS_PASSWORD and MC_REDIS_DB_INDEX"
        )
    return parts.hostname, port if port is not None else REDIS_DEFAULT_PORT


def _redis_db_index() -> int:
    """``MC_REDIS_DB_INDEX`` as Mooncake reads it: 0..255, anything else warns and gives 0."""
    text = os.environ.get("MC_REDIS_DB_INDEX")
    if text is None:
        return 0
    try:
        index = int(text)
    except ValueError:
        _log.warning("cannot parse MC_REDIS_DB_INDEX=%r, using database 0", text)
        return 0
    if not 0 <= index <= 255:
        _log.warning("invalid Redis DB index %d, using database 0", index)
        return 0
    return index


class RedisMetadataStore(MetadataStore):
    """Keys in a Redis server, as Mooncake's Redis plugin keeps them (``SET``/``GET``/``DEL``).

    Authentication and database come from the environment, as in Mooncake:
    ``MC_REDIS_PASSWORD`` (``AUTH`` only when non-empty), ``MC_REDIS_USERNAME`` (used
    with the password), ``MC_REDIS_DB_INDEX`` (0..255).

    Args:
        url: ``redis://host[:port]`` (port 6379 by default).
        timeout: socket connect and read timeout in seconds.

    Raises:
        NotSupportedError: the ``redis`` package is not installed.
        InvalidArgumentError: a malformed URL or timeout.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        host, port = _split_redis_url(url)
        timeout = _check_timeout(timeout)
        try:
            import redis.asyncio as aioredis
            import redis.exceptions as redis_errors
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:
            raise NotSupportedError(
                "a redis:// metadata server needs the 'redis' package: "
                "pip install flagcx_mc[redis]  (or: pip install redis)"
            ) from None
        self._errors = redis_errors
        self._url = url
        password = os.environ.get("MC_REDIS_PASSWORD") or None
        username = (os.environ.get("MC_REDIS_USERNAME") or None) if password else None
        self._client = aioredis.Redis(
            host=host,
            port=port,
            db=_redis_db_index(),
            username=username,
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # fail fast, like Mooncake's single attempt
        )
        self._closed = False

    @property
    def url(self) -> str:
        """The server URL."""
        return self._url

    async def get(self, key: str) -> dict[str, Any] | None:
        """The object stored under ``key``, or ``None`` if the key is absent."""
        raw = await self._call("GET", key, self._client.get, key)
        return None if raw is None else _decode(key, raw)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """``SET key <json>``."""
        body = _encode(key, value)
        await self._call("SET", key, self._client.set, key, body)

    async def delete(self, key: str) -> None:
        """``DEL key``."""
        await self._call("DEL", key, self._client.delete, key)

    async def close(self) -> None:
        """Close the connection pool."""
        if self._closed:
            return
        self._closed = True
        await self._client.aclose()

    async def _call(self, command: str, key: str, fn: Any, *args: Any) -> Any:
        _check_key(key)
        if self._closed:
            raise EngineStateError("metadata store is closed")
        errors = self._errors
        where = f"{command} {key!r} on {self._url}"
        try:
            return await fn(*args)
        except errors.AuthenticationError as exc:
            raise MetadataError(f"{where}: authentication failed: {exc}") from None
        except errors.TimeoutError as exc:
            raise HandshakeTimeoutError(f"{where}: timed out: {exc}") from None
        except errors.ConnectionError as exc:
            raise PeerConnectionError(f"{where}: {exc}") from None
        except errors.RedisError as exc:
            raise MetadataError(f"{where}: {exc}") from None
        except OSError as exc:
            raise PeerConnectionError(f"{where}: {exc}") from None


# --- factory -----------------------------------------------------------------------------

_STORES: dict[str, Callable[..., MetadataStore]] = {
    "http": HttpMetadataStore,
    "redis": RedisMetadataStore,
}


def open_store(kind: str, url: str, *, timeout: float = DEFAULT_TIMEOUT) -> MetadataStore:
    """The store for a ``(kind, url)`` pair from ``parse_metadata_server``.

    Raises:
        NotSupportedError: ``redis`` without the ``redis`` package.
        InvalidArgumentError: ``p2p`` (no store), an unknown kind, or a malformed URL.
    """
    if kind == "etcd":
        from .metastore_etcd import EtcdMetadataStore  # it builds on this module

        return EtcdMetadataStore(url, timeout=timeout)
    cls = _STORES.get(kind)
    if cls is None:
        raise InvalidArgumentError(
            f"no metadata store for kind {kind!r}"
            + (f" ({P2P_HANDSHAKE} exchanges metadata peer to peer)" if kind == "p2p" else "")
        )
    return cls(url, timeout=timeout)
