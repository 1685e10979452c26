"""Module-level names of ``mooncake.engine`` that callers import besides the engine class.

``SUPPORT_*`` report honestly what this build can do: flagcx_mc has no EFA, HIP, MUSA or
multi-node NVLink transport; GPU memory (staged through host memory) works where libcuda loads.
"""

from __future__ import annotations

import enum

__all__ = [
    "TransferOpcode",
    "Read",
    "Write",
    "TransferNotify",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_CUDA",
]


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode enum (arithmetic: compares equal to its int value)."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent to the target once a transfer's data has landed there."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    def __hash__(self) -> int:
        return hash((self.name, self.msg))


SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False
def _libcuda_present() -> bool:
    """GPU memory works wherever the driver library loads (the core dlopens it on first use)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


SUPPORT_CUDA = _libcuda_present()
