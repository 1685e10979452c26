"""Mooncake's HTTP metadata protocol, client side: ``GET|PUT|DELETE <url>?key=<escaped key>``.

``http_request`` (one request per connection, h11 on asyncio streams) is shared with the etcd
store, which speaks etcd's v3 JSON API over the same kind of request.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import h11

from ..errors import (
    DnsError,
    EngineStateError,
    FlagcxMcError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    MetadataError,
    PeerConnectionError,
    RemoteProtocolError,
)
from ..net import http as _http
from ..net.addresses import format_host_port
from ..net.listeners import close_writer
from .store import (
    DEFAULT_TIMEOUT,
    MetadataStore,
    check_key,
    check_timeout,
    decode_value,
    encode_value,
)

__all__ = ["HttpMetadataStore", "MetadataHttpError", "check_http_status", "http_request", "split_http_url"]

_MAX_RESPONSE_BODY = 64 * 1024 * 1024


class MetadataHttpError(MetadataError):
    """The HTTP metadata server answered with a status other than 2xx (or 404 on ``get``)."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def split_http_url(url: str) -> tuple[bool, str, int, str]:
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
    With a ``token`` (an engine's from ``MC_METADATA_HTTP_TOKEN``), every request carries
    ``Authorization: Bearer <token>``, as Mooncake's plugin does.

    Args:
        url: ``http://host:port/metadata`` or ``https://...`` (system CA store).
        timeout: seconds for a whole request, connect included.
        token: bearer token, or ``None`` for none.

    Raises:
        InvalidArgumentError: a malformed URL or timeout.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, *, token: str | None = None) -> None:
        https, self._host, self._port, self._target = split_http_url(url)
        self._url = url
        self._timeout = check_timeout(timeout)
        self._ssl = ssl.create_default_context() if https else None
        token = token or None
        self._auth: tuple[tuple[bytes, bytes], ...] = ()
        if token is not None:
            if any(c in token for c in "\r\n\0"):
                raise InvalidArgumentError("metadata token may not contain CR, LF or NUL")
            try:
                self._auth = ((b"Authorization", b"Bearer " + token.encode("latin-1")),)
            except UnicodeEncodeError:
                raise InvalidArgumentError("metadata token must be latin-1 text") from None
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
        return decode_value(key, body)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` under ``key`` (``PUT``; the server may refuse, e.g. 400 for an
        ``rpc_meta`` key that already holds another value).

        Raises:
            MetadataHttpError: any status but 2xx.
        """
        body = encode_value(key, value)
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
        check_key(key)
        if self._closed:
            raise EngineStateError("metadata store is closed")
        target = self._target + "key=" + quote(key, safe="")
        return await http_request(self._host, self._port, method, target, body, url=self._url,
                                  timeout=self._timeout, what=f"{method} {key!r}", headers=self._auth,
                                  ssl_context=self._ssl)


def check_http_status(what: str, url: str, status: int, body: bytes) -> None:
    """Raise ``MetadataHttpError`` (with the start of the body) unless ``status`` is 2xx."""
    if 200 <= status < 300:
        return
    text = body[:1024].decode("utf-8", "replace")
    raise MetadataHttpError(f"{what} on {url}: HTTP {status}: {text}", status, text)


async def http_request(
    host: str,
    port: int,
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    url: str,
    timeout: float,
    what: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a connection of its own (``Connection: close``): ``(status, body)``.

    The request carries ``Host``, asks for JSON and, with a ``body``, sends it as JSON;
    ``headers`` are added as given.  ``url`` and ``what`` name the server and the operation
    in error messages.

    Raises:
        InvalidArgumentError: a request h11 cannot send (a control character in a header).
        DnsError: the host does not resolve.
        PeerConnectionError: refused, reset, or closed before a full answer.
        HandshakeTimeoutError: no full answer within ``timeout``, connect included.
        RemoteProtocolError: the answer is not HTTP/1.1, or its body exceeds 64 MiB.
    """
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_http.MAX_HEAD)
    fields: list[tuple[bytes, bytes]] = [
        (b"Host", _host_header(host, port, ssl_context is not None)),
        (b"User-Agent", b"flagcx_mc"),
        (b"Accept", b"application/json"),
        (b"Connection", b"close"),
    ]
    if body is not None:
        fields += [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())]
    fields += headers
    try:
        message = conn.send(h11.Request(method=method, target=target, headers=fields))
        if body:
            message += conn.send(h11.Data(data=body))
        message += conn.send(h11.EndOfMessage())
    except (h11.LocalProtocolError, UnicodeEncodeError) as exc:  # h11 sends ASCII names and targets
        raise InvalidArgumentError(f"{what} on {url}: cannot send this request: {exc}") from None
    try:
        return await asyncio.wait_for(_exchange(conn, host, port, message, url, ssl_context), timeout)
    except asyncio.TimeoutError:
        raise HandshakeTimeoutError(f"{what} on {url}: no answer within {timeout}s") from None


def _host_header(host: str, port: int, https: bool) -> bytes:
    """``Host``: the port only when it is not the scheme's default (RFC 9110 7.2); a name
    that is not ASCII in its IDNA form, as DNS knows it."""
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise InvalidArgumentError(f"invalid host name {host!r}: {exc}") from None
    if port == (443 if https else 80):
        return (f"[{host}]" if ":" in host else host).encode("ascii")
    return format_host_port(host, port).encode("ascii")


async def _exchange(conn: h11.Connection, host: str, port: int, message: bytes, url: str,
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
    events = _http.EventReader(conn, reader)
    try:
        writer.write(message)
        await writer.drain()
        return await _read_response(events)
    except h11.RemoteProtocolError as exc:
        if events.eof:  # h11 needed more than the server sent before it closed
            raise PeerConnectionError(
                f"metadata server {url} closed the connection before a full answer"
            ) from None
        raise RemoteProtocolError(f"bad answer from metadata server {url}: {exc}") from None
    except FlagcxMcError:
        raise
    except OSError as exc:
        raise PeerConnectionError(f"connection to metadata server {url} failed: {exc}") from None
    finally:
        await close_writer(writer)


async def _read_response(events: _http.EventReader) -> tuple[int, bytes]:
    while True:
        event = await events.next_event()
        if isinstance(event, h11.Response):
            break
        if not isinstance(event, h11.InformationalResponse):  # the server closed: no answer
            raise h11.RemoteProtocolError(f"no response, got {type(event).__name__}", 400)
        # 1xx: an interim answer (100 Continue); the real one follows.
    length = _http.declared_length(event)
    if length is not None and length > _MAX_RESPONSE_BODY:
        raise h11.RemoteProtocolError(f"a {length}-byte body exceeds the {_MAX_RESPONSE_BODY}-byte limit", 413)
    return event.status_code, await events.read_body(_MAX_RESPONSE_BODY)
