"""Mooncake's HTTP metadata protocol, client side: ``GET|PUT|DELETE <url>?key=<escaped key>``.

The HTTP exchange here (one request per connection) is shared with the etcd store, which speaks
etcd's v3 JSON API over the same kind of request.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from typing import Any
from urllib.parse import quote, urlsplit

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
from .store import (
    DEFAULT_TIMEOUT,
    MetadataStore,
    check_key,
    check_timeout,
    decode_value,
    encode_value,
)

__all__ = ["HttpMetadataStore", "MetadataHttpError", "check_http_status", "format_request", "http_roundtrip",
           "split_http_url"]

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
        https, self._host, self._port, self._target = split_http_url(url)
        self._url = url
        self._timeout = check_timeout(timeout)
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
