"""Host/port parsing and formatting.

Segment names are ``host:port`` strings with IPv6 literals in brackets (Mooncake's
``maybeWrapIpV6``); peers parse them back to find the handshake listener, so both
directions live here.
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import InvalidArgumentError

__all__ = ["parse_host_port", "format_host_port", "numeric_stream_addrinfo"]


def _parse_port(text: str, source: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgumentError(f"invalid port {text!r} in {source!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise InvalidArgumentError(f"port {port} in {source!r} is outside 1..65535")
    return port


def _check_ipv6(host: str, source: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise InvalidArgumentError(f"invalid IPv6 address {host!r} in {source!r}") from None


def parse_host_port(s: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[addr]:port``) into host and port.

    A bare host (``"h"``, ``"[::1]"``, ``"::1"``) takes ``default_port``; the returned host
    never has brackets, so it can go straight to ``getaddrinfo``.

    Raises:
        InvalidArgumentError: empty host, malformed brackets, bad port, or no port and no
            ``default_port``.
    """
    if not isinstance(s, str):
        raise InvalidArgumentError(f"host:port must be a str, not {type(s).__name__}")
    port_text: str | None = None
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise InvalidArgumentError(f"unclosed '[' in {s!r}")
        host, rest = s[1:end], s[end + 1 :]
        _check_ipv6(host, s)
        if rest:
            if not rest.startswith(":"):
                raise InvalidArgumentError(f"unexpected {rest!r} after ']' in {s!r}")
            port_text = rest[1:]
    elif s.count(":") >= 2:
        # An unbracketed IPv6 literal cannot carry a port: the last group is ambiguous.
        host = s
        _check_ipv6(host, s)
    elif ":" in s:
        host, port_text = s.split(":")
    else:
        host = s
    if not host or any(c.isspace() for c in host):
        raise InvalidArgumentError(f"invalid host in {s!r}")
    if port_text is not None:
        return host, _parse_port(port_text, s)
    if default_port is None:
        raise InvalidArgumentError(f"no port in {s!r} and no default port")
    if isinstance(default_port, bool) or not isinstance(default_port, int):
        raise InvalidArgumentError(f"default port must be an int, not {default_port!r}")
    if not 1 <= default_port <= 65535:
        raise InvalidArgumentError(f"default port {default_port} is outside 1..65535")
    return host, default_port


def format_host_port(host: str, port: int) -> str:
    """Join host and port, bracketing IPv6 literals so the result parses back unambiguously."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def numeric_stream_addrinfo(host: str, port: int) -> list[tuple] | None:
    """``getaddrinfo``'s answer for a TCP connect to a numeric IPv4 or IPv6 address (no scope),
    made here; None for a name.  The event loop's resolver runs on a thread pool (uvloop's
    holds 4 threads once used), which numeric peers, the usual case, need not start."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 4:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
    if "%" in host:
        return None  # a scoped address: its zone needs the resolver
    return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, 0))]
