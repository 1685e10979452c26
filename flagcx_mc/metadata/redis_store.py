"""Keys in a Redis server, as Mooncake's Redis plugin keeps them (``SET``/``GET``/``DEL``)."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from .._extras import install_hint
from ..errors import (
    EngineStateError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    MetadataError,
    NotSupportedError,
    PeerConnectionError,
)
from .store import (
    DEFAULT_TIMEOUT,
    MetadataStore,
    StoreSettings,
    check_key,
    check_timeout,
    decode_value,
    encode_value,
)

__all__ = ["REDIS_DEFAULT_PORT", "RedisMetadataStore", "split_redis_url"]

_log = logging.getLogger(__name__)

REDIS_DEFAULT_PORT = 6379


def split_redis_url(url: str) -> tuple[str, int]:
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


def redis_db_index(text: str | None) -> int:
    """``MC_REDIS_DB_INDEX`` as Mooncake reads it: 0..255, anything else warns and gives 0."""
    if text is None or text.strip() == "":
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

    Authentication and database come from ``settings`` (an engine's, from Mooncake's
    ``MC_REDIS_PASSWORD``: ``AUTH`` only when non-empty; ``MC_REDIS_USERNAME``, used with the
    password; ``MC_REDIS_DB_INDEX``, 0..255).

    Args:
        url: ``redis://host[:port]`` (port 6379 by default).
        timeout: socket connect and read timeout in seconds.
        settings: credentials and database; none and database 0 by default.

    Raises:
        NotSupportedError: the ``redis`` package is not installed.
        InvalidArgumentError: a malformed URL or timeout.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, *, settings: StoreSettings | None = None) -> None:
        host, port = split_redis_url(url)
        settings = settings or StoreSettings()
        timeout = check_timeout(timeout)
        try:
            import redis.asyncio as aioredis
            import redis.exceptions as redis_errors
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:
            raise NotSupportedError(f"a redis:// metadata server {install_hint('redis', 'redis')}") from None
        self._errors = redis_errors
        self._url = url
        password = settings.redis_password or None
        username = (settings.redis_username or None) if password else None
        self._client = aioredis.Redis(
            host=host,
            port=port,
            db=settings.redis_db_index,
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
        return None if raw is None else decode_value(key, raw)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """``SET key <json>``."""
        body = encode_value(key, value)
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
        check_key(key)
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
