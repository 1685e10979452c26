"""Mooncake-compatible HTTP metadata server: ``/metadata?key=...`` over an in-memory dict.

Answers as Mooncake's reference server (``mooncake-wheel/mooncake/http_metadata_server.py``)
does, in this order:

- a path other than ``/metadata`` -> 404;
- a server token is set and the request lacks ``Authorization: Bearer <token>`` -> 401;
- no ``key`` query parameter, or a blank one (keys are stripped) -> 400;
- ``GET``: 200 with the stored bytes, or 404;
- ``PUT``: stores the body, 200. A key containing ``rpc_meta`` that already exists: the
  same bytes again -> 200 ("metadata unchanged"), other bytes -> 400 ("Duplicate rpc_meta
  key not allowed"). A new key beyond ``max_keys``, or a store beyond ``max_total_bytes``
  -> 507;
- ``DELETE``: 200, or 404 if the key is absent;
- any other method -> 405.

Added here: bodies above ``max_body`` -> 413; malformed HTTP -> 400 (oversized head or
more than 100 header fields 431, unknown transfer coding 501, HTTP other than 1.x 505,
unknown ``Expect`` 417, both ``Content-Length`` and ``Transfer-Encoding`` 400), after
which the connection is closed. ``Expect: 100-continue`` (curl sends it with larger
bodies) is honoured; connections are kept alive per HTTP/1.1 rules. h11 parses and
formats the messages (``flagcx_mc.net.http`` feeds it from the connection); connections
come from ``flagcx_mc.net.listeners.BoundedServer``. It binds only the host it is given.

Run it as ``python -m flagcx_mc.metadata.server --port 8080``; the first line on stdout is
the bound port.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote, urlsplit

import h11

from ..errors import DnsError, EndpointError, EngineStateError, InvalidArgumentError
from ..net import http as _http
from ..net.addresses import format_host_port
from ..net.listeners import BoundedServer, peer_name

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_MAX_BODY", "DEFAULT_PORT", "MetadataServer", "main"]

_log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 16 * 1024 * 1024
DEFAULT_MAX_KEYS = 65536  # the reference server's MC_METADATA_MAX_KEYS default
DEFAULT_MAX_TOTAL_BYTES = 1 << 30  # ... and its MC_METADATA_MAX_TOTAL_BYTES default
_LISTEN_BACKLOG = 128
_MAX_BLANK_LINES = 16  # stray CRLFs tolerated between requests on one connection
_MAX_HEADERS = 100
_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"


class _Reject(Exception):
    """Answer the request with ``status`` and ``message`` without reading its body."""

    def __init__(self, status: int, message: str, content_type: str = _JSON) -> None:
        super().__init__(message)
        self.status = status
        self.message = message.encode()
        self.content_type = content_type


class MetadataServer:
    """The HTTP metadata server, on the running event loop.

    Args:
        host: address or name to bind; only the first address it resolves to is bound.
        port: port to bind; 0 lets the OS choose (``start`` returns it).
        token: bearer token every request must carry; ``None`` = no authentication.
        max_body: largest request body accepted, in bytes.
        max_keys: most keys held at once.
        max_total_bytes: most value bytes held at once.
        idle_timeout: seconds a connection may wait for, or take to send, one request.
        max_connections: concurrent connections beyond which new ones are closed at once.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        token: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        max_keys: int = DEFAULT_MAX_KEYS,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        idle_timeout: float = 30.0,
        max_connections: int = 1024,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError("host must be given; pass '0.0.0.0' to bind all")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be in 0..65535, not {port!r}")
        for name, value in (
            ("max_body", max_body),
            ("max_keys", max_keys),
            ("max_total_bytes", max_total_bytes),
            ("max_connections", max_connections),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
        if not idle_timeout > 0:
            raise InvalidArgumentError(f"idle_timeout must be positive, not {idle_timeout!r}")
        self._host = host
        self._requested_port = port
        self._token = token.encode() if token else None
        self._max_body = max_body
        self._max_keys = max_keys
        self._max_total_bytes = max_total_bytes
        self._idle_timeout = float(idle_timeout)
        self._store: dict[str, bytes] = {}
        self._total_bytes = 0
        self._listener = BoundedServer(
            self._serve, name="metadata server", log=_log, max_connections=max_connections,
            stream_limit=_http.MAX_HEAD,
        )

    @property
    def port(self) -> int:
        """The bound port (raises EngineStateError before ``start``)."""
        port = self._listener.port
        if port is None:
            raise EngineStateError("metadata server is not started")
        return port

    @property
    def url(self) -> str:
        """``http://host:port/metadata``: what engines pass as ``metadata_server``."""
        return f"http://{format_host_port(self._host, self.port)}/metadata"

    def keys(self) -> list[str]:
        """The keys held now, sorted."""
        return sorted(self._store)

    async def start(self) -> int:
        """Bind and start serving.

        Returns:
            The bound port.

        Raises:
            EngineStateError: already started or closed.
            DnsError: the host does not resolve.
            EndpointError: the port cannot be bound.
        """
        port = await self._listener.start(self._host, [self._requested_port], backlog=_LISTEN_BACKLOG)
        _log.info("metadata server listening on %s", self.url)
        return port

    async def close(self) -> None:
        """Stop listening, drop every connection and wait for their tasks. Idempotent."""
        await self._listener.close()

    async def __aenter__(self) -> Self:
        if self._listener.port is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- connections ----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests until the client or the server closes, or one must close.

        Each request gets an ``h11.Connection`` of its own; bytes it left unread (pipelined
        requests) start the next one, after up to ``_MAX_BLANK_LINES`` empty lines.
        """
        pending, eof = b"", False
        while not self._listener.closed:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_http.MAX_HEAD)
            events = _http.EventReader(conn, reader, pending=pending, eof=eof, blank_lines=_MAX_BLANK_LINES)
            if not await self._handle(conn, events, writer):
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # either side asked to close (Connection: close, HTTP/1.0)
            pending, eof = conn.trailing_data

    async def _handle(self, conn: h11.Connection, events: _http.EventReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; return whether the connection may carry another."""
        loop = asyncio.get_running_loop()
        try:
            request = await events.next_event(loop.time() + self._idle_timeout)
            if not isinstance(request, h11.Request):
                return False  # the client closed between requests
            self._check_request(request)
        except (asyncio.TimeoutError, OSError):
            return False  # idle, or reset
        except h11.RemoteProtocolError as exc:
            _log.info("metadata server: bad request from %s: %s", peer_name(writer), exc)
            await self._send(conn, writer, exc.error_status_hint, str(exc).encode(), close=True, content_type=_TEXT)
            return False
        method = request.method.decode("ascii")
        has_body = _http.header(request, b"transfer-encoding") is not None or bool(_http.declared_length(request))
        if not has_body:
            try:  # h11 reports the empty body's end; the request is then complete
                await events.read_body(0, loop.time() + self._idle_timeout)
            except (asyncio.TimeoutError, OSError, h11.RemoteProtocolError):
                return False
        try:
            key = self._route(method, request.target.decode("ascii"), request)
        except _Reject as reject:
            # An unread body would be taken for the next request: close instead.
            return await self._send(
                conn, writer, reject.status, reject.message, close=has_body,
                head_only=method == "HEAD", content_type=reject.content_type,
            )
        body = b""
        if has_body:
            if conn.they_are_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
            try:
                body = await events.read_body(self._max_body, loop.time() + self._idle_timeout)
            except (asyncio.TimeoutError, OSError):
                return False
            except h11.RemoteProtocolError as exc:
                await self._send(conn, writer, exc.error_status_hint, str(exc).encode(), close=True, content_type=_TEXT)
                return False
        status, message = self._apply(method, key, body)
        _log.debug("metadata server: %s %r -> %d", method, key, status)
        return await self._send(conn, writer, status, message, close=False)

    def _check_request(self, request: h11.Request) -> None:
        """Refuse what h11 lets through but this server will not serve (h11's status hints)."""
        if not request.http_version.startswith(b"1."):
            raise h11.RemoteProtocolError(f"HTTP/{request.http_version.decode()} is not supported", 505)
        if len(request.headers) > _MAX_HEADERS:
            raise h11.RemoteProtocolError(f"more than {_MAX_HEADERS} header fields", 431)
        if _http.header(request, b"transfer-encoding") is not None and _http.header(request, b"content-length"):
            # RFC 9112 6.1 lets a server reject these; they are how requests are smuggled.
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding", 400)
        length = _http.declared_length(request)
        if length is not None and length > self._max_body:
            raise h11.RemoteProtocolError(f"body of {length} bytes exceeds the {self._max_body}-byte limit", 413)
        expect = _http.header(request, b"expect")
        if expect is not None and expect.strip().lower() != "100-continue":
            raise h11.RemoteProtocolError(f"cannot meet expectation {expect!r}", 417)

    def _route(self, method: str, target: str, request: h11.Request) -> str:
        """The key a request addresses; raises ``_Reject`` for anything the store won't do."""
        if target.startswith("/"):
            path, _, query = target.partition("?")
            path = path.partition("#")[0]
            query = query.partition("#")[0]
        elif target[:8].lower().startswith(("http://", "https://")):
            parts = urlsplit(target)
            path, query = parts.path or "/", parts.query
        else:
            raise _Reject(400, f"invalid request target {target[:80]!r}", _TEXT)
        if unquote(path) != "/metadata":
            raise _Reject(404, "404: Not Found", _TEXT)
        if self._token is not None and not self._token_ok(request):
            raise _Reject(401, "unauthorized")
        try:
            params = parse_qsl(query, keep_blank_values=True, errors="strict", max_num_fields=64)
        except (UnicodeDecodeError, ValueError):
            raise _Reject(400, "malformed query string") from None
        key = next((value for name, value in params if name == "key"), "").strip()
        if not key:
            raise _Reject(400, "metadata key is required")
        if method not in ("GET", "PUT", "DELETE"):
            raise _Reject(405, "Method not allowed")
        return key

    def _token_ok(self, request: h11.Request) -> bool:
        assert self._token is not None
        scheme, _, presented = (_http.header(request, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return False
        return hmac.compare_digest(presented.encode("latin-1"), self._token)

    def _apply(self, method: str, key: str, body: bytes) -> tuple[int, bytes]:
        """Run one store operation (no await inside: atomic on the loop)."""
        store = self._store
        if method == "GET":
            value = store.get(key)
            return (404, b"metadata not found") if value is None else (200, value)
        if method == "DELETE":
            old = store.pop(key, None)
            if old is None:
                return 404, b"metadata not found"
            self._total_bytes -= len(old)
            return 200, b"metadata deleted"
        old = store.get(key)
        if "rpc_meta" in key and old is not None:
            # Re-publishing the same location is idempotent; a different one is a clash
            # (two engines claiming one name), as in Mooncake's reference server.
            if old == body:
                return 200, b"metadata unchanged"
            return 400, b"Duplicate rpc_meta key not allowed"
        if old is None and len(store) >= self._max_keys:
            return 507, b"metadata key budget exhausted"
        total = self._total_bytes - (len(old) if old is not None else 0) + len(body)
        if total > self._max_total_bytes:
            return 507, b"metadata size budget exhausted"
        store[key] = body
        self._total_bytes = total
        return 200, b"metadata updated"

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        *,
        close: bool,
        head_only: bool = False,
        content_type: str = _JSON,
    ) -> bool:
        """Send one response; return whether the connection may carry another request."""
        fields = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        if close:
            fields.append(("Connection", "close"))
        try:
            data = conn.send(h11.Response(status_code=status, headers=fields, reason=_http.reason(status)))
            if body and not head_only:
                data += conn.send(h11.Data(data=body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a state in which no response can be sent
            return False
        writer.write(data)
        try:
            await asyncio.wait_for(writer.drain(), self._idle_timeout)
        except (OSError, asyncio.TimeoutError):
            return False
        return not close


# --- command line --------------------------------------------------------------------------


def _int_env(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        _log.warning("ignoring %s=%r: not an integer", name, text)
        return default
    if value < 1:
        _log.warning("ignoring %s=%r: not positive", name, text)
        return default
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flagcx-mc metadata-server",
        description="Mooncake-compatible HTTP metadata server: engines use "
        "metadata_server='http://HOST:PORT/metadata'. Prints the bound port, then "
        "serves until SIGINT or SIGTERM.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind, 0 = any (default: %(default)s)")
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token clients must send (default: $MC_METADATA_HTTP_TOKEN; unset = no authentication)",
    )
    parser.add_argument(
        "--max-body", type=int, default=DEFAULT_MAX_BODY, help="largest PUT body in bytes (default: %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="(default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the metadata server from the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        _parser().error(f"--port must be in 0..65535, not {args.port}")
    if args.max_body < 1:
        _parser().error(f"--max-body must be positive, not {args.max_body}")
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(_serve_until_signal(args))
    except KeyboardInterrupt:  # interrupted before the signal handlers were in place
        return 0


async def _serve_until_signal(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else (os.environ.get("MC_METADATA_HTTP_TOKEN") or None)
    server = MetadataServer(
        args.host,
        args.port,
        token=token,
        max_body=args.max_body,
        max_keys=_int_env("MC_METADATA_MAX_KEYS", DEFAULT_MAX_KEYS),
        max_total_bytes=_int_env("MC_METADATA_MAX_TOTAL_BYTES", DEFAULT_MAX_TOTAL_BYTES),
    )
    try:
        port = await server.start()
    except (DnsError, EndpointError) as exc:
        print(f"flagcx-mc metadata-server: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass  # not the main thread: Ctrl-C still ends asyncio.run
        print(port, flush=True)
        if token is None and not _is_loopback(args.host):
            _log.warning(
                "bound to %s with no token: anyone who can reach it can read and rewrite "
                "cluster metadata; set MC_METADATA_HTTP_TOKEN here and on every engine",
                args.host,
            )
        await stop.wait()
        _log.info("shutting down")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
