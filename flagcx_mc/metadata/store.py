"""Central metadata stores: where engines publish segments and find each other by name.

This module holds the interface every backend implements, and the value checks they share.  Keys are
``flagcx_mc.metadata.keys``; the backends are ``http_store`` (Mooncake's HTTP storage plugin,
served by ``flagcx_mc.metadata.server`` or Mooncake's own ``http_metadata_server``),
``redis_store`` (``pip install flagcx_mc[redis]``) and ``etcd_store`` (etcd's v3 JSON API over
HTTP); ``connect.open_store`` picks one.

The errors each backend raises are listed in ``connect``; ``get`` of a missing key returns
``None`` and ``delete`` of a missing key succeeds, in every backend.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import orjson

from ..errors import FlagcxMcError, InvalidArgumentError, MalformedJsonError

__all__ = ["DEFAULT_TIMEOUT", "MetadataStore", "StoreSettings", "check_key", "check_timeout", "decode_value",
           "encode_value", "json_object"]

DEFAULT_TIMEOUT = 3.0  # Mooncake's HTTP plugin: CURLOPT_TIMEOUT_MS 3000


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What the stores are told, rather than read from the environment themselves:
    ``EngineConfig`` reads Mooncake's variables (``MC_METADATA_CLUSTER_ID``,
    ``MC_METADATA_HTTP_TOKEN``, ``MC_REDIS_USERNAME``/``PASSWORD``/``DB_INDEX``) once per engine."""

    cluster_id: str = ""                 # prefixes every key (keys.key_prefix)
    http_token: str | None = dataclasses.field(default=None, repr=False)  # Authorization: Bearer
    redis_username: str | None = None    # used with the password only
    redis_password: str | None = dataclasses.field(default=None, repr=False)  # AUTH when set
    redis_db_index: int = 0              # 0..255


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

    async def __aenter__(self) -> MetadataStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def check_key(key: str) -> None:
    # The reference HTTP server strips the key, so " k" and "k" would collide there.
    if not isinstance(key, str) or not key or key != key.strip():
        raise InvalidArgumentError(
            f"metadata key must be a non-empty str without surrounding whitespace, not {key!r}"
        )


def encode_value(key: str, value: dict[str, Any]) -> bytes:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"value for {key!r} must be a dict, not {type(value).__name__}")
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        raise InvalidArgumentError(f"value for {key!r} is not JSON-serialisable: {exc}") from None


def json_object(raw: bytes, error: type[FlagcxMcError], what: str) -> dict[str, Any]:
    """``raw`` parsed as one JSON object, else ``error`` saying what ``what`` was."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{what} is a {type(value).__name__}, not an object")
    return value


def decode_value(key: str, raw: bytes) -> dict[str, Any]:
    return json_object(raw, MalformedJsonError, f"value of {key!r}")


def check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a positive number, not {timeout!r}")
    return float(timeout)
