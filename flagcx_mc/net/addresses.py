"""Host/port parsing and formatting, and the RPC port range Mooncake picks handshake ports from.

Segment names are ``host:port`` strings with IPv6 literals in brackets (Mooncake's
``maybeWrapIpV6``); peers parse them back to find the handshake listener, so both
directions live here.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from ..errors import InvalidArgumentError

__all__ = [
    "DEFAULT_RPC_PORT_RANGE",
    "format_host_port",
    "parse_host_port",
    "rpc_port_range",
]

_log = logging.getLogger(__name__)

DEFAULT_RPC_PORT_RANGE: tuple[int, int] = (15000, 17000)

# Linux's default ephemeral range; Mooncake refuses RPC ranges that touch it so that a
# random handshake port cannot collide with outgoing connections.
_EPHEMERAL_LOW = 32768
_EPHEMERAL_HIGH = 60999


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


def _port_from_env(primary: str, legacy: str, default: int) -> int:
    for name in (primary, legacy):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value.strip())
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return default


def rpc_port_range() -> tuple[int, int]:
    """Return the inclusive range random handshake ports are drawn from.

    Mirrors Mooncake: ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (each falling back to the
    legacy ``MC_MIN_PRC_PORT``/``MC_MAX_PRC_PORT`` spelling), default 15000..17000. A value
    that is not an int, is outside 1024..65535, inverts the range or overlaps the
    ephemeral range 32768..60999 makes the whole range fall back to the default.
    """
    low, high = DEFAULT_RPC_PORT_RANGE
    try:
        lo = _port_from_env("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT", low)
        hi = _port_from_env("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT", high)
        if not (1024 <= lo <= 65535 and 1024 <= hi <= 65535):
            raise ValueError(f"range {lo}..{hi} is outside 1024..65535")
        if lo > hi:
            raise ValueError(f"minimum {lo} is above maximum {hi}")
        if lo <= _EPHEMERAL_HIGH and hi >= _EPHEMERAL_LOW:
            raise ValueError(
                f"range {lo}..{hi} overlaps the ephemeral ports "
                f"{_EPHEMERAL_LOW}..{_EPHEMERAL_HIGH}"
            )
    except ValueError as exc:
        _log.warning("ignoring RPC port range from environment (%s); using %d..%d", exc, low, high)
        return low, high
    return lo, hi
