"""Exception tree and the single mapping between C/Mooncake return codes and exceptions.

Codes reuse Mooncake's bands (include/error.h): -1..-7 request errors, -10x network and
handshake, -20x metadata, -30x system.  Codes Mooncake does not have (-105..-107) sit in the
network band.  ``CODE_TO_ERROR`` is the one table between codes and exception classes:
``error_for_code`` (and ``check_rc``, which passes non-negative codes through) builds exceptions
from it, and only the sync facade turns exceptions back into codes (``exc.code``).
"""

from __future__ import annotations

__all__ = [
    "FlagcxMcError",
    "UnknownCoreError",
    "InvalidArgumentError",
    "EngineStateError",
    "TooManyRequestsError",
    "AddressNotRegisteredError",
    "BatchBusyError",
    "DeviceNotFoundError",
    "AddressOverlappedError",
    "DnsError",
    "PeerConnectionError",
    "MalformedJsonError",
    "HandshakeRejectedError",
    "TransferTimeoutError",
    "RemoteRefusedError",
    "HandshakeTimeoutError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "MetadataError",
    "EndpointError",
    "ContextError",
    "NumaError",
    "ClockError",
    "OutOfMemoryError",
    "NotSupportedError",
    "check_rc",
    "error_for_code",
    "CODE_TO_ERROR",
]


class FlagcxMcError(Exception):
    """Base of every error flagcx_mc raises; ``code`` is the Mooncake-style negative code."""

    code: int = -1

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        if code is not None:
            self.code = code


class UnknownCoreError(FlagcxMcError):
    """The core returned a code this version does not know."""


class InvalidArgumentError(FlagcxMcError, ValueError):
    """An argument is invalid (bad length, mismatched lists, zero size...)."""

    code = -1


class EngineStateError(FlagcxMcError, RuntimeError):
    """The engine is not initialized, or already closed."""

    code = -1


class TooManyRequestsError(FlagcxMcError):
    """Too many outstanding requests."""

    code = -2


class AddressNotRegisteredError(FlagcxMcError, ValueError):
    """An address range is not wholly inside one registered region."""

    code = -3


class BatchBusyError(FlagcxMcError):
    """The batch still has transfers in flight."""

    code = -4


class DeviceNotFoundError(FlagcxMcError):
    """The requested device does not exist."""

    code = -6


class AddressOverlappedError(FlagcxMcError, ValueError):
    """The region overlaps a region that is already registered."""

    code = -7


class DnsError(FlagcxMcError, OSError):
    """A host name could not be resolved."""

    code = -101


class PeerConnectionError(FlagcxMcError, ConnectionError):
    """A connection to the peer failed or was lost."""

    code = -102


class MalformedJsonError(FlagcxMcError):
    """The peer sent JSON that could not be decoded or validated."""

    code = -103


class HandshakeRejectedError(FlagcxMcError):
    """The peer rejected the handshake."""

    code = -104


class TransferTimeoutError(FlagcxMcError, TimeoutError):
    """The transfer did not complete within its timeout; its buffers are no longer touched."""

    code = -105


class RemoteRefusedError(FlagcxMcError):
    """The target refused the request (address outside its regions, wrong key); nothing was written."""

    code = -106


class HandshakeTimeoutError(FlagcxMcError, TimeoutError):
    """The handshake with the peer did not finish in time."""

    code = -107


class LocalProtocolError(FlagcxMcError):
    """We tried to send something the protocol does not allow (our misuse)."""

    code = -1


class RemoteProtocolError(FlagcxMcError):
    """The peer sent bytes that break the protocol (bad frame, bad type, oversized)."""

    code = -103


class MetadataError(FlagcxMcError):
    """Segment metadata is missing or invalid."""

    code = -200


class EndpointError(FlagcxMcError):
    """An endpoint could not be set up."""

    code = -201


class ContextError(FlagcxMcError):
    """A transport context could not be set up."""

    code = -202


class NumaError(FlagcxMcError):
    """NUMA placement failed."""

    code = -300


class ClockError(FlagcxMcError):
    """Reading a clock failed."""

    code = -301


class OutOfMemoryError(FlagcxMcError, MemoryError):
    """The engine could not allocate memory."""

    code = -302


class NotSupportedError(FlagcxMcError, NotImplementedError):
    """The operation is not supported by this build or transport."""

    code = -303


# One canonical class per code (subclasses that share a code, such as EngineStateError or
# RemoteProtocolError, are raised explicitly where they apply).
CODE_TO_ERROR: dict[int, type[FlagcxMcError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        TooManyRequestsError,
        AddressNotRegisteredError,
        BatchBusyError,
        DeviceNotFoundError,
        AddressOverlappedError,
        DnsError,
        PeerConnectionError,
        MalformedJsonError,
        HandshakeRejectedError,
        TransferTimeoutError,
        RemoteRefusedError,
        HandshakeTimeoutError,
        MetadataError,
        EndpointError,
        ContextError,
        NumaError,
        ClockError,
        OutOfMemoryError,
        NotSupportedError,
    )
}


def error_for_code(rc: int, message: str = "") -> FlagcxMcError:
    """Build the exception for a negative return code (``UnknownCoreError`` if unknown)."""
    cls = CODE_TO_ERROR.get(rc)
    if cls is None:
        return UnknownCoreError(message or f"unknown core error code {rc}", code=rc)
    return cls(message) if message else cls()


def check_rc(rc: int, message: str = "") -> int:
    """Return ``rc`` if it is >= 0, else raise the exception mapped to it."""
    if rc >= 0:
        return rc
    raise error_for_code(rc, message)
