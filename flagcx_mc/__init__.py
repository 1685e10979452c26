"""flagcx_mc: one-sided KV-cache transfers with Mooncake's TransferEngine API.

Swap ``from mooncake.engine import TransferEngine`` for ``from flagcx_mc import TransferEngine``
(sync, int returns), or use ``AsyncTransferEngine`` from asyncio code.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from . import errors
from ._core import core_version as _core_version
from .buffers import HostBuffer
from .engine.async_engine import AsyncTransferEngine
from .engine.sync_engine import TransferEngine
from .errors import FlagcxMcError
from .names import (
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    Read,
    TransferNotify,
    TransferOpcode,
    Write,
)

try:
    __version__ = _dist_version("flagcx_mc")
except PackageNotFoundError:  # running from a source tree without metadata
    __version__ = _core_version()

if _core_version() != __version__:
    raise ImportError(
        f"flagcx_mc's compiled core is version {_core_version()} but the package is {__version__}: "
        "reinstall with `pip install .` to rebuild it"
    )

__all__ = [
    "AsyncTransferEngine",
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "HostBuffer",
    "FlagcxMcError",
    "errors",
    "__version__",
]
