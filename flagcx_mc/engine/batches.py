"""Asynchronous batches by id, as Mooncake's ``batch_transfer_async_*`` API hands them out.

Ids are small positive ints (never 0, which means failure in Mooncake's API).  The table is
shared by the async engine and the sync facade's threads, hence the lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from .. import errors
from .._core import CoreBatch

__all__ = ["BatchTable", "PendingBatch"]


@dataclass
class PendingBatch:
    batch: CoreBatch
    target: str
    deadline: float  # time.monotonic() value

    def remaining_ms(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


def _ints(values: object) -> list:
    try:
        return [v for v in values if type(v) is int]  # type: ignore[attr-defined]
    except TypeError:
        return []


class BatchTable:
    """Live batches keyed by id; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._items: dict[int, PendingBatch] = {}

    def add(self, pending: PendingBatch) -> int:
        with self._lock:
            batch_id = next(self._ids)
            self._items[batch_id] = pending
            return batch_id

    def get(self, batch_id: int) -> PendingBatch:
        if type(batch_id) is not int:
            raise errors.InvalidArgumentError(f"a batch id is an int, not {type(batch_id).__name__}")
        with self._lock:
            pending = self._items.get(batch_id)
        if pending is None:
            raise errors.InvalidArgumentError(f"unknown batch id {batch_id!r}")
        return pending

    def latest_remaining(self, batch_ids: object) -> float:
        """Seconds until the latest deadline among these batches (0 for none known)."""
        with self._lock:
            deadlines = [p.deadline for i, p in self._items.items() if i in set(_ints(batch_ids))]
        return max((d - time.monotonic() for d in deadlines), default=0.0)

    def discard(self, batch_id: int) -> None:
        """Forget a batch; freeing it cancels whatever is still in flight."""
        with self._lock:
            self._items.pop(batch_id, None)

    def cancel_all(self) -> None:
        with self._lock:
            items, self._items = list(self._items.values()), {}
        for pending in items:
            pending.batch.cancel()
