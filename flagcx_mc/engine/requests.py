"""One transfer call, validated once and runnable from any thread, shared by both facades."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from .. import errors
from .._argpack import pack3
from .._core import OP_READ, OP_WRITE, CoreBatch, ffi
from ..config import EngineConfig
from ..names import TransferNotify, TransferOpcode

__all__ = ["TransferRequest", "SingleTransfer", "RemoteDesc", "needs_refresh", "mooncake_opcode", "opcode_name",
           "OP_READ", "OP_WRITE"]

_U64_MAX = (1 << 64) - 1

# Codes after which the peer's region table may simply be stale: re-read it once and retry.
_REFRESH_CODES = frozenset({errors.AddressNotRegisteredError.code, errors.RemoteRefusedError.code})


def needs_refresh(rc: int) -> bool:
    return rc in _REFRESH_CODES


class TransferRequest:
    """(local, remote, length) triplets packed into one buffer of u64 arrays, plus what the
    deadline needs.

    A plain slotted class: it is built on every transfer call, and a frozen dataclass's
    __init__ alone cost a microsecond there."""

    __slots__ = ("opcode", "count", "total_bytes", "packed")

    def __init__(self, opcode: int, count: int, total_bytes: int, packed: bytes) -> None:
        self.opcode = opcode
        self.count = count
        self.total_bytes = total_bytes
        self.packed = packed

    @classmethod
    def build(
        cls, opcode: int, buffers: Sequence[int], peer_addresses: Sequence[int], lengths: Sequence[int]
    ) -> TransferRequest:
        """Validate the three lists (same length, unsigned 64-bit ints) and pack them, at C speed."""
        try:
            packed, n, total = pack3(buffers, peer_addresses, lengths)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgumentError(str(exc)) from None
        return cls(opcode, n, total, packed)

    @classmethod
    def single(cls, opcode: int, buffer: int, peer_address: int, length: int) -> TransferRequest | SingleTransfer:
        if (type(buffer) is int and type(peer_address) is int and type(length) is int
                and 0 <= buffer <= _U64_MAX and 0 <= peer_address <= _U64_MAX and 0 <= length <= _U64_MAX):
            return SingleTransfer(opcode, buffer, peer_address, length)
        return cls.build(opcode, [buffer], [peer_address], [length])  # raises the precise error

    def run(self, session, config: EngineConfig) -> tuple[int, str]:
        """Move the bytes (blocking, GIL released); returns (rc, reason)."""
        timeout_ms = int(config.timeout_for(self.total_bytes) * 1000)
        return session.peer.transfer_packed(self.opcode, self.count, self.packed, timeout_ms)

    def submit(self, session) -> CoreBatch:
        """Start the transfer without waiting (raises for ranges outside registered memory)."""
        # The batch keeps the view (which keeps `packed`) alive; remote and lengths point into it.
        arrays = ffi.from_buffer("uint64_t[]", self.packed)
        slots = max(self.count, 1)
        return session.peer.submit(self.opcode, self.count, arrays, arrays + slots, arrays + 2 * slots)

    def start(self, session, poll_us: int) -> tuple[int, str, CoreBatch | None]:
        """Start the transfer from an event loop's thread (``CorePeer.start_one``): ``(rc, why,
        None)`` if it ended within ``poll_us``, else ``(0, "", batch)`` in flight."""
        return session.peer.start_packed(self.opcode, self.count, self.packed, poll_us)


class SingleTransfer:
    """One range of plain ints, already checked, with TransferRequest's interface: run() hands
    them to the core as they are, which saves a third of a small synchronous call's Python time
    (no lists, no packing, no views)."""

    __slots__ = ("opcode", "count", "total_bytes", "buffer", "peer_address", "length")

    def __init__(self, opcode: int, buffer: int, peer_address: int, length: int) -> None:
        self.opcode, self.count, self.total_bytes = opcode, 1, length
        self.buffer, self.peer_address, self.length = buffer, peer_address, length

    def run(self, session, config: EngineConfig) -> tuple[int, str]:
        timeout_ms = int(config.timeout_for(self.length) * 1000)
        return session.peer.transfer_one(self.opcode, self.buffer, self.peer_address, self.length, timeout_ms)

    def submit(self, session) -> CoreBatch:
        return TransferRequest.build(self.opcode, [self.buffer], [self.peer_address], [self.length]).submit(session)

    def start(self, session, poll_us: int) -> tuple[int, str, CoreBatch | None]:
        return session.peer.start_one(self.opcode, self.buffer, self.peer_address, self.length, poll_us)


def opcode_name(opcode: int) -> str:
    return "write" if opcode == OP_WRITE else "read"


def mooncake_opcode(opcode: int) -> int:
    """The core's opcode for Mooncake's ``TransferOpcode`` (or its int value)."""
    try:
        if isinstance(opcode, bool):
            raise TypeError("a bool is not an opcode")
        op = TransferOpcode(operator.index(opcode))
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError(f"opcode must be TransferOpcode.Read or .Write, got {opcode!r}") from None
    return OP_WRITE if op is TransferOpcode.Write else OP_READ


def check_notify(notify: object) -> None:
    """A notification is a ``TransferNotify`` (or ``None``); checked before any byte moves."""
    if notify is not None and not (isinstance(notify, TransferNotify)
                                   and isinstance(notify.name, str) and isinstance(notify.msg, str)):
        raise errors.InvalidArgumentError(f"notify must be a TransferNotify(name, msg) of strs, not {notify!r}")


@dataclass(frozen=True)
class RemoteDesc:
    """Where a remote range lives (FlagCX's ``make_desc``): its region's base and key."""

    addr: int
    size: int
    region_base: int
    key: int
