"""Buffers with a stable address, for examples, tests and the benchmark: host memory, and GPU
memory allocated by the core's own CUDA code (no torch or cupy needed).

Transfers take raw addresses (as Mooncake's API does); this gives Python code memory whose
address it can hand out, fill with random bytes and checksum without copying through Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DeviceBuffer", "HostBuffer", "cuda_device_count"]


def cuda_device_count() -> tuple[int, str]:
    """(number of CUDA devices, why there are none): 0 and the reason where there is no driver."""
    from ._core import ffi, last_error, lib

    count = ffi.new("int *")
    if lib.fmc_cuda_device_count(count) < 0:
        return 0, last_error() or "no CUDA driver"
    return int(count[0]), "" if count[0] else "no CUDA device"


class HostBuffer:
    """Anonymous private memory, touched once so that its pages exist (`populate`)."""

    def __init__(self, size: int, *, populate: bool = True) -> None:
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._cview = (ctypes.c_char * size).from_buffer(self._map)
        self.addr = ctypes.addressof(self._cview)
        if populate:
            ctypes.memset(self.addr, 0, size)

    @property
    def view(self) -> memoryview:
        """A writable view (no copy)."""
        return memoryview(self._map)

    def fill_random(self, offset: int = 0, length: int | None = None) -> str:
        """Fill a range with random bytes; returns its sha256 hex digest."""
        length = self.size - offset if length is None else length
        self._check(offset, length)
        chunk = 1 << 22
        for pos in range(offset, offset + length, chunk):
            n = min(chunk, offset + length - pos)
            self._map[pos : pos + n] = os.urandom(n)
        return self.digest(offset, length)

    def fill(self, byte: int, offset: int = 0, length: int | None = None) -> None:
        length = self.size - offset if length is None else length
        self._check(offset, length)
        ctypes.memset(self.addr + offset, byte, length)

    def digest(self, offset: int = 0, length: int | None = None) -> str:
        """sha256 of a range, hashed from the memory in place."""
        length = self.size - offset if length is None else length
        self._check(offset, length)
        return hashlib.sha256(self.view[offset : offset + length]).hexdigest()

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        return bytes(self._map[offset : offset + length])

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data))
        self._map[offset : offset + len(data)] = data

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, +{length}) outside buffer of {self.size} bytes")

    def close(self) -> None:
        """Unmap (only once no transfer uses the buffer)."""
        if self._map is not None:
            del self._cview
            self._map.close()
            self._map = None  # type: ignore[assignment]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DeviceBuffer:
    """GPU memory (cuMemAlloc through the core's dlopen'ed libcuda) with a host mirror, so tests
    and the benchmark can fill, clear and checksum it without torch or cupy.  Copies to and from
    the mirror run on the core's copy stream of ``device`` and return once landed.

    ``vmm_chunk`` > 0: VMM memory instead, as torch's expandable segments make it (one cuMemCreate
    allocation per chunk of that many bytes, side by side; ``size`` is rounded up to whole chunks),
    whose chunks allow POSIX file descriptor handles if ``shareable``."""

    def __init__(self, size: int, device: int = 0, vmm_chunk: int = 0, shareable: bool = True) -> None:
        from ._core import _raise_for, ffi, lib

        self._lib, self._raise = lib, _raise_for
        ptr = ffi.new("uint64_t *")
        self._vmm_chunk = vmm_chunk
        self._mapped = -(-size // vmm_chunk) * vmm_chunk if vmm_chunk else size
        if vmm_chunk:
            _raise_for(lib.fmc_cuda_buffer_alloc_vmm(device, self._mapped, vmm_chunk, int(shareable), ptr),
                       "cannot allocate VMM GPU memory")
        else:
            _raise_for(lib.fmc_cuda_buffer_alloc(device, size, ptr), "cannot allocate GPU memory")
        self.addr = int(ptr[0])
        self.size = size
        self.device = device
        self._staging = HostBuffer(size)
        self._open = True

    def _copy(self, dst: int, src: int, length: int) -> None:
        if length:
            self._raise(self._lib.fmc_cuda_buffer_copy(self.device, dst, src, length), "GPU copy failed")

    def fill_random(self, offset: int = 0, length: int | None = None) -> str:
        length = self.size - offset if length is None else length
        digest = self._staging.fill_random(offset, length)
        self._copy(self.addr + offset, self._staging.addr + offset, length)
        return digest

    def fill(self, byte: int, offset: int = 0, length: int | None = None) -> None:
        length = self.size - offset if length is None else length
        self._staging.fill(byte, offset, length)
        self._copy(self.addr + offset, self._staging.addr + offset, length)

    def read(self, offset: int, length: int) -> bytes:
        self._copy(self._staging.addr + offset, self.addr + offset, length)
        return self._staging.read(offset, length)

    def digest(self, offset: int = 0, length: int | None = None) -> str:
        length = self.size - offset if length is None else length
        self._copy(self._staging.addr + offset, self.addr + offset, length)
        return self._staging.digest(offset, length)

    def close(self) -> None:
        """Free the GPU memory and its mirror (only once no transfer uses the buffer)."""
        if self._open:
            self._open = False
            if self._vmm_chunk:
                self._lib.fmc_cuda_buffer_free_vmm(self.device, self.addr, self._mapped, self._vmm_chunk)
            else:
                self._lib.fmc_cuda_buffer_free(self.device, self.addr)
            self._staging.close()
