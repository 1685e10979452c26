"""Side-channel messages: versioned, validated, encoded with orjson.  Sans-I/O: bytes in, objects out.

Every message is one JSON object ``{"v": 1, "type": ..., "id": ..., ...}``.  ``id`` is the
sender's message id; a reply carries the id of the message it answers.

Decode worker -> prefill worker (the prefill worker's listener):

- ``xfer``: "push these requests' blocks into my memory".  ``session`` (decode engine's
  ``host:rpc_port``), ``tp`` ([size, rank] of the decode worker), ``layout`` (decode planes per
  group, each ``[base, block_len, num_blocks, stride, span_addr, span_nbytes]``), ``reqs``
  (``[{"rid", "blocks": [[block ids] per group]}]``), ``ttl_ms`` (prefill starts no transfer later
  than this after receiving the message).
- ``ping``: liveness and identity probe.

Prefill worker -> decode worker:

- ``result``: one per request of an ``xfer``: ``rid``, ``ok``, ``reason`` (empty when ok),
  ``bytes`` moved.
- ``pong``: ``worker`` (``{"instance", "dp", "pp", "tp"}``) and the worker's engine ``session``.
- ``error``: the whole message was refused (``reason``, ``supported`` versions); ``id`` is the
  refused message's id when it could be read, else null.

Worker <-> bootstrap registry (``ports.py``):

- ``register`` (``worker``, ``endpoint``) -> ``ack``; ``lookup`` (``instance``) -> ``workers``
  (``[{"instance", "dp", "pp", "tp", "endpoint"}]``); ``error`` as above.

``decode`` raises ``MessageError`` (``UnsupportedVersionError`` for another version) and nothing
else, whatever the bytes; fields it does not know are ignored, so a version can grow fields.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .layout import KVLayout, LayoutError, TPRank

__all__ = [
    "VERSION",
    "SUPPORTED_VERSIONS",
    "MAX_MESSAGE_BYTES",
    "MessageError",
    "UnsupportedVersionError",
    "WorkerKey",
    "ReqBlocks",
    "Xfer",
    "Result",
    "Ping",
    "Pong",
    "ErrorReply",
    "Register",
    "Ack",
    "Lookup",
    "Workers",
    "Message",
    "encode",
    "decode",
    "new_id",
]

VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)
MAX_MESSAGE_BYTES = 64 << 20

_MAX_ID = 128
_MAX_TEXT = 4096
_MAX_REQS = 4096
_MAX_GROUPS = 64
_MAX_PLANES = 8192
_MAX_BLOCK_IDS = 1 << 22  # per message, all requests and groups together
_MAX_TTL_MS = 24 * 3600 * 1000
_U64 = 1 << 64


class MessageError(ValueError):
    """Bytes that are not a valid message; ``msg_id`` is the message's id when it could be read."""

    def __init__(self, reason: str, msg_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.msg_id = msg_id


class UnsupportedVersionError(MessageError):
    """A message of a version this side does not speak."""


_counter = itertools.count()
_prefix = os.urandom(6).hex()


def new_id() -> str:
    """A message id unique across processes and hosts (random prefix, counter)."""
    return f"{_prefix}-{next(_counter)}"


# ---------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class WorkerKey:
    """One worker of a serving instance: its data-, pipeline- and tensor-parallel ranks."""

    instance: str
    dp: int
    pp: int
    tp: int

    def to_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "dp": self.dp, "pp": self.pp, "tp": self.tp}


@dataclass(frozen=True)
class ReqBlocks:
    """One request of an ``xfer``: its id and the decode block ids of each group."""

    rid: str
    blocks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Xfer:
    """Decode asks prefill to write ``reqs`` into its memory (``layout``, engine ``session``)."""

    msg_id: str
    session: str
    tp: TPRank
    layout: KVLayout
    reqs: tuple[ReqBlocks, ...]
    ttl_ms: int
    type = "xfer"


@dataclass(frozen=True)
class Result:
    """How one request of an ``xfer`` ended."""

    msg_id: str
    rid: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    type = "result"


@dataclass(frozen=True)
class Ping:
    msg_id: str
    type = "ping"


@dataclass(frozen=True)
class Pong:
    msg_id: str
    worker: WorkerKey | None
    session: str = ""
    type = "pong"


@dataclass(frozen=True)
class ErrorReply:
    """The message ``msg_id`` (None if unreadable) was refused as a whole."""

    msg_id: str | None
    reason: str
    supported: tuple[int, ...] = SUPPORTED_VERSIONS
    type = "error"


@dataclass(frozen=True)
class Register:
    msg_id: str
    worker: WorkerKey
    endpoint: str
    type = "register"


@dataclass(frozen=True)
class Ack:
    msg_id: str
    type = "ack"


@dataclass(frozen=True)
class Lookup:
    msg_id: str
    instance: str
    type = "lookup"


@dataclass(frozen=True)
class Workers:
    msg_id: str
    workers: tuple[tuple[WorkerKey, str], ...]
    type = "workers"


Message = Xfer | Result | Ping | Pong | ErrorReply | Register | Ack | Lookup | Workers


# ---------------------------------------------------------------------------------- encode


def _body(msg: Message) -> dict[str, Any]:
    if isinstance(msg, Xfer):
        return {"session": msg.session, "tp": list(msg.tp), "layout": msg.layout.to_list(),
                "reqs": [{"rid": r.rid, "blocks": [list(g) for g in r.blocks]} for r in msg.reqs],
                "ttl_ms": msg.ttl_ms}
    if isinstance(msg, Result):
        return {"rid": msg.rid, "ok": msg.ok, "reason": msg.reason, "bytes": msg.nbytes}
    if isinstance(msg, Pong):
        return {"worker": msg.worker.to_json() if msg.worker else None, "session": msg.session}
    if isinstance(msg, ErrorReply):
        return {"reason": msg.reason, "supported": list(msg.supported)}
    if isinstance(msg, Register):
        return {"worker": msg.worker.to_json(), "endpoint": msg.endpoint}
    if isinstance(msg, Lookup):
        return {"instance": msg.instance}
    if isinstance(msg, Workers):
        return {"workers": [{**k.to_json(), "endpoint": ep} for k, ep in msg.workers]}
    if isinstance(msg, (Ping, Ack)):
        return {}
    raise TypeError(f"not a message: {type(msg).__name__}")


def encode(msg: Message, version: int = VERSION) -> bytes:
    """Serialize a message (``version`` exists so tests can forge other versions)."""
    return orjson.dumps({"v": version, "type": msg.type, "id": msg.msg_id, **_body(msg)})


# ---------------------------------------------------------------------------------- decode


class _Fields:
    """Typed access to one JSON object; every failure is a MessageError naming the field."""

    def __init__(self, obj: dict[str, Any], where: str, msg_id: str | None) -> None:
        self.obj, self.where, self.msg_id = obj, where, msg_id

    def fail(self, reason: str) -> MessageError:
        return MessageError(f"{self.where}: {reason}", self.msg_id)

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False, default: Any = None) -> Any:
        if name not in self.obj:
            if optional:
                return default
            raise self.fail(f"missing field {name!r}")
        value = self.obj[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(f"{name!r} must be an integer")
        if kind is not int and not isinstance(value, kind):
            expected = getattr(kind, "__name__", "an object or null")
            raise self.fail(f"{name!r} must be {expected}, not {type(value).__name__}")
        return value

    def text(self, name: str, *, limit: int = _MAX_TEXT, optional: bool = False, empty: bool = False) -> str:
        value = self.get(name, str, optional=optional, default="")
        if len(value) > limit:
            raise self.fail(f"{name!r} is longer than {limit} characters")
        if not value and not empty and not optional:
            raise self.fail(f"{name!r} is empty")
        return value

    def uint(self, name: str, *, low: int = 0, high: int = _U64 - 1, optional: bool = False, default: int = 0) -> int:
        value = self.get(name, int, optional=optional, default=default)
        if not low <= value <= high:
            raise self.fail(f"{name!r} = {value} is outside {low}..{high}")
        return value

    def sub(self, name: str, value: Any) -> _Fields:
        if not isinstance(value, dict):
            raise self.fail(f"{name!r} must be an object")
        return _Fields(value, f"{self.where}.{name}", self.msg_id)


def _worker(f: _Fields, value: Any, name: str = "worker") -> WorkerKey:
    w = f.sub(name, value)
    return WorkerKey(w.text("instance", limit=_MAX_ID), w.uint("dp", high=1 << 20), w.uint("pp", high=1 << 20),
                     w.uint("tp", high=1 << 20))


def _block_lists(f: _Fields, value: Any, budget: list[int]) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list) or len(value) > _MAX_GROUPS:
        raise f.fail(f"'blocks' must be a list of at most {_MAX_GROUPS} lists")
    groups = []
    for ids in value:
        if not isinstance(ids, list):
            raise f.fail("'blocks' must hold one list of block ids per group")
        budget[0] -= len(ids)
        if budget[0] < 0:
            raise f.fail(f"more than {_MAX_BLOCK_IDS} block ids in one message")
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < _U64:
                raise f.fail(f"block id {b!r} is not an unsigned integer")
        groups.append(tuple(ids))
    return tuple(groups)


def _xfer(f: _Fields, msg_id: str) -> Xfer:
    session = f.text("session", limit=512)
    tp = f.get("tp", list)
    if len(tp) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in tp) \
            or not 0 <= tp[1] < tp[0] <= 1 << 20:
        raise f.fail("'tp' must be [size, rank] with 0 <= rank < size")
    layout_json = f.get("layout", list)
    if len(layout_json) > _MAX_GROUPS or any(not isinstance(g, list) or len(g) > _MAX_PLANES for g in layout_json):
        raise f.fail(f"'layout' must be at most {_MAX_GROUPS} groups of at most {_MAX_PLANES} planes")
    try:
        layout = KVLayout.from_list(layout_json)
    except LayoutError as exc:
        raise f.fail(f"'layout': {exc}") from None
    reqs_json = f.get("reqs", list)
    if len(reqs_json) > _MAX_REQS:
        raise f.fail(f"more than {_MAX_REQS} requests in one message")
    budget = [_MAX_BLOCK_IDS]
    reqs, seen = [], set()
    for i, item in enumerate(reqs_json):
        r = f.sub(f"reqs[{i}]", item)
        rid = r.text("rid", limit=_MAX_TEXT)
        if rid in seen:
            raise f.fail(f"request {rid!r} appears twice")
        seen.add(rid)
        blocks = _block_lists(r, r.get("blocks", list), budget)
        if len(blocks) != len(layout.groups):
            raise r.fail(f"{len(blocks)} block lists for {len(layout.groups)} layout groups")
        reqs.append(ReqBlocks(rid, blocks))
    ttl_ms = f.uint("ttl_ms", low=1, high=_MAX_TTL_MS)
    return Xfer(msg_id, session, TPRank(tp[0], tp[1]), layout, tuple(reqs), ttl_ms)


def _result(f: _Fields, msg_id: str) -> Result:
    return Result(msg_id, f.text("rid"), f.get("ok", bool), f.text("reason", optional=True),
                  f.uint("bytes", optional=True))


def _pong(f: _Fields, msg_id: str) -> Pong:
    worker = f.get("worker", (dict, type(None)), optional=True)
    return Pong(msg_id, _worker(f, worker) if worker is not None else None, f.text("session", limit=512, optional=True))


def _error(f: _Fields, msg_id: str | None) -> ErrorReply:
    supported = f.get("supported", list, optional=True, default=[])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in supported) or len(supported) > 64:
        raise f.fail("'supported' must be a list of versions")
    return ErrorReply(msg_id, f.text("reason", empty=True), tuple(supported))


def _workers(f: _Fields, msg_id: str) -> Workers:
    items = f.get("workers", list)
    if len(items) > 1 << 16:
        raise f.fail("too many workers")
    out = []
    for i, item in enumerate(items):
        w = f.sub(f"workers[{i}]", item)
        out.append((_worker(f, item, f"workers[{i}]"), w.text("endpoint", limit=512)))
    return Workers(msg_id, tuple(out))


_PARSERS: dict[str, Callable[[_Fields, str], Message]] = {
    "xfer": _xfer,
    "result": _result,
    "ping": lambda f, i: Ping(i),
    "pong": _pong,
    "register": lambda f, i: Register(i, _worker(f, f.get("worker", dict)), f.text("endpoint", limit=512)),
    "ack": lambda f, i: Ack(i),
    "lookup": lambda f, i: Lookup(i, f.text("instance", limit=_MAX_ID)),
    "workers": _workers,
}


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message.

    Raises:
        UnsupportedVersionError: a version other than ``SUPPORTED_VERSIONS``.
        MessageError: anything else wrong; ``msg_id`` set when the id could be read.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MessageError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MessageError(f"a message is a JSON object, not {type(obj).__name__}")
    raw_id = obj.get("id")
    msg_id = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= _MAX_ID else None
    version = obj.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise MessageError("missing or non-integer version 'v'", msg_id)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"version {version} is not supported (speaks {list(SUPPORTED_VERSIONS)})", msg_id)
    kind = obj.get("type")
    if kind == "error":  # an error may answer a message whose id was unreadable
        if raw_id is not None and msg_id is None:
            raise MessageError("'id' must be a non-empty string or null")
        return _error(_Fields(obj, "error", msg_id), msg_id)
    if msg_id is None:
        raise MessageError(f"'id' must be a string of 1..{_MAX_ID} characters")
    if not isinstance(kind, str) or (parser := _PARSERS.get(kind)) is None:
        raise MessageError(f"unknown message type {kind!r}", msg_id)
    return parser(_Fields(obj, kind, msg_id), msg_id)
