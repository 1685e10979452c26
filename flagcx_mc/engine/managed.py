"""Engine-owned registered memory: Mooncake's ``allocate_managed_buffer`` / ``free_managed_buffer``.

Blocks are power-of-two size classes (8 KiB up) carved from large chunks that are registered
once; bigger requests get a mapping of their own.  The memory is a memfd mapped shared, so a
process on the same host can map the very same pages (the same-host fast path builds on it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import errors
from .._core import as_u64

__all__ = ["ManagedPool", "MIN_BLOCK"]

MIN_BLOCK = 8 << 10
DEFAULT_CHUNK = 256 << 20


@dataclass
class _Mapping:
    fd: int
    map: mmap.mmap
    addr: int
    size: int
    cview: object  # the ctypes export that gave us the address; dropped before unmapping


def _map_shared(size: int, name: str) -> _Mapping:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError, ValueError) as exc:
        os.close(fd)
        raise errors.OutOfMemoryError(f"cannot map {size} bytes of managed memory: {exc}") from None
    cview = ctypes.c_char.from_buffer(m)
    return _Mapping(fd, m, ctypes.addressof(cview), size, cview)


def _class_of(length: int) -> int:
    size = MIN_BLOCK
    while size < length:
        size <<= 1
    return size


class ManagedPool:
    """Allocator over registered shared memory; thread-safe."""

    def __init__(self, register: Callable[[int, int], object], unregister: Callable[[int], object],
                 chunk_size: int = DEFAULT_CHUNK) -> None:
        self._register = register
        self._unregister = unregister
        self._chunk_size = chunk_size
        self._lock = threading.Lock()
        self._chunks: list[_Mapping] = []
        self._bump = 0                        # next free byte in the newest chunk
        self._free: dict[int, list[int]] = {}  # size class -> free block addresses
        self._live: dict[int, int] = {}        # block address -> size class (0: dedicated)
        self._dedicated: dict[int, _Mapping] = {}

    def allocate(self, length: int) -> int:
        """Return the address of a registered block of at least ``length`` bytes."""
        length = as_u64(length, "managed buffer length")
        if length == 0:
            raise errors.InvalidArgumentError("managed buffer length must be positive")
        size = _class_of(length)
        with self._lock:
            if size > self._chunk_size:
                mapping = _map_shared(length, "flagcx-mc-managed")
                self._register_or_release(mapping)
                self._dedicated[mapping.addr] = mapping
                self._live[mapping.addr] = 0
                return mapping.addr
            free = self._free.get(size)
            if free:
                addr = free.pop()
            else:
                if not self._chunks or self._bump + size > self._chunk_size:
                    mapping = _map_shared(self._chunk_size, "flagcx-mc-managed")
                    self._register_or_release(mapping)
                    self._chunks.append(mapping)
                    self._bump = 0
                addr = self._chunks[-1].addr + self._bump
                self._bump += size
            self._live[addr] = size
            return addr

    def free(self, addr: int, length: int) -> None:
        """Give a block back (``length`` as allocated, for Mooncake's signature; not trusted)."""
        addr = as_u64(addr, "address")
        with self._lock:
            size = self._live.pop(addr, None)
            if size is None:
                raise errors.InvalidArgumentError(f"{addr:#x} is not a live managed buffer")
            if size == 0:
                mapping = self._dedicated.pop(addr)
                self._unregister(mapping.addr)
                self._unmap(mapping)
            else:
                self._free.setdefault(size, []).append(addr)

    def shared_mappings(self) -> dict[int, tuple]:
        """Region start -> (memfd number, size) of every mapping: same-host peers map these."""
        with self._lock:
            return {m.addr: (m.fd, m.size) for m in list(self._dedicated.values()) + self._chunks}

    def block_size(self, addr: int) -> int:
        """Usable size of a live block (0 if ``addr`` is not one)."""
        with self._lock:
            size = self._live.get(addr)
            if size == 0:
                return self._dedicated[addr].size
            return size or 0

    def close(self) -> None:
        with self._lock:
            for mapping in list(self._dedicated.values()) + self._chunks:
                try:
                    self._unregister(mapping.addr)
                except errors.FlagcxMcError:
                    pass
                self._unmap(mapping)
            self._chunks.clear()
            self._dedicated.clear()
            self._live.clear()
            self._free.clear()

    def _register_or_release(self, mapping: _Mapping) -> None:
        try:
            self._register(mapping.addr, mapping.size)
        except BaseException:
            self._unmap(mapping)
            raise

    @staticmethod
    def _unmap(mapping: _Mapping) -> None:
        mapping.cview = None
        mapping.map.close()
        os.close(mapping.fd)
