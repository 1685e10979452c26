"""``Completions``: one thread of the wait executor waits for every submitted batch of an async
engine and hands finished ones to the event loop in groups.

A coroutine submits its batch from the loop (the core only enqueues it, or on one host copies a
small one on the spot) and, unless it is already done, awaits a future here.  The poller waits
in the core for the oldest batch (GIL released; the core polls briefly before sleeping after a
small transfer; at most 5 ms), then polls the others, cancels those past their deadline (it keeps
deadlines itself: the core's own timeout would cancel one batch at a time), and resolves every
finished future with one ``call_soon_threadsafe``: many completions cost the loop one wake-up,
not one executor round trip each.

Between batches the poller lingers in the core for up to ``_LINGER_S``, woken by the end of any
batch the engine started for it (``CoreEngine.wait_batch_end``): a batch handed over meanwhile
costs the loop no executor hand-off and wakes no thread, since its own end wakes the poller.  A
batch that ended before the poller looked is resolved by ``wait`` itself.  The poller ends once it
has lingered that long with nothing to wait for, so an idle engine holds no thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from .. import errors
from .._core import CoreBatch

__all__ = ["Completions"]

_TIMEOUT_CODE = errors.TransferTimeoutError.code


_WAIT_SLICE = 0.005  # seconds the poller waits for the oldest batch before looking at the others
_DEADLINE_SLACK = 0.01  # batches this close to their deadline when another expires time out with it
_LINGER_S = 0.005  # seconds the poller waits for the next batch before it ends

# The core's count of the engine's ended batches (None once the engine is closed), and a wait
# until it passes a count or ``seconds`` run out (False then, or once closed).
Ended = Callable[[], int | None]
WaitEnd = Callable[[int, float], bool]


class _Entry:
    __slots__ = ("batch", "deadline", "future")

    def __init__(self, batch: CoreBatch, deadline: float, future: asyncio.Future) -> None:
        self.batch, self.deadline, self.future = batch, deadline, future


class Completions:
    """Batches in flight on one loop and the one poller that waits for them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: Callable[[], Executor | None], ended: Ended,
                 wait_end: WaitEnd) -> None:
        self._loop = loop
        self._executor = executor
        self._ended = ended
        self._wait_end = wait_end
        self._inbox: collections.deque[_Entry] = collections.deque()
        self._lock = threading.Lock()  # orders "poller running" against "batch added"
        self._running = False
        self._closed = False

    def wait(self, batch: CoreBatch, deadline: float) -> asyncio.Future:
        """A future of ``(rc, why)`` for ``batch`` (``time.monotonic()`` ``deadline``; a batch
        past it is cancelled and ends with the timeout code).  On the loop thread."""
        future = self._loop.create_future()
        with self._lock:
            self._inbox.append(_Entry(batch, deadline, future))
            if self._running:
                # A lingering poller wakes only when a batch ends: if this one ended before the
                # poller looked at the inbox, nothing would wake it for it.
                state = batch.poll()
                if state != 0:
                    future.set_result(_outcome(state))
                return future
            executor = self._executor()
            if executor is None:
                self._inbox.pop()
                raise errors.EngineStateError("engine closed")
            self._running = True
        try:
            self._loop.run_in_executor(executor, self._run)
        except RuntimeError:  # the executor shut down meanwhile
            with self._lock:
                self._running = False
            raise errors.EngineStateError("engine closed") from None
        return future

    def outcome(self, batch: CoreBatch, deadline: float) -> asyncio.Future:
        """``wait``, or a future already resolved if ``batch`` has ended (no poller needed)."""
        state = batch.poll()
        if state == 0:
            return self.wait(batch, deadline)
        future = self._loop.create_future()
        future.set_result(_outcome(state))
        return future

    def close(self) -> None:
        """No more lingering: the poller ends once nothing is pending (the engine then wakes it
        with ``CoreEngine.wake_end_waiters``)."""
        self._closed = True

    def _run(self) -> None:
        pending: list[_Entry] = []
        inbox = self._inbox
        while True:
            seen = self._ended()  # before the inbox is read: a batch that ends later ends the linger
            while inbox:
                pending.append(inbox.popleft())
            if not pending:
                if seen is not None and not self._closed and self._wait_end(seen, _LINGER_S):
                    continue
                with self._lock:
                    if not inbox:
                        self._running = False
                        return
                continue
            head = pending[0]
            # Waits in the core (GIL released) for the oldest batch, at most _WAIT_SLICE so that
            # a long batch at the head delays the completion of later ones only that much.
            remaining = head.deadline - time.monotonic()
            head.batch.wait_done(int(min(max(remaining, 0.0), _WAIT_SLICE) * 1000))
            done: list[tuple[asyncio.Future, int]] = []
            keep: list[_Entry] = []
            expired: list[_Entry] = []
            due = time.monotonic() + _DEADLINE_SLACK
            for entry in pending:
                state = entry.batch.poll()
                if state != 0:
                    done.append((entry.future, state))
                elif entry.deadline <= due:
                    expired.append(entry)
                else:
                    keep.append(entry)
            # All batches due are chosen before any is cancelled: a cancel cuts streams, which
            # fails the other batches on them, and those timed out too rather than failed.
            for entry in expired:
                entry.batch.cancel()  # returns once nothing touches the buffers any more
                done.append((entry.future, _TIMEOUT_CODE))
            pending = keep
            if done:
                try:
                    self._loop.call_soon_threadsafe(_deliver, done)
                except RuntimeError:  # the loop closed: nobody is waiting any more
                    pass


def _deliver(done: list[tuple[asyncio.Future, int]]) -> None:
    for future, state in done:
        if not future.done():  # a cancelled waiter has gone already
            future.set_result(_outcome(state))


def _outcome(state: int) -> tuple[int, str]:
    """``(rc, why)`` of a batch's final ``poll()`` state (1 done, negative a code)."""
    return (0, "") if state == 1 else (state, _reason(state))


def _reason(code: int) -> str:
    if code == _TIMEOUT_CODE:
        return "timed out (the batch was cancelled at its deadline)"
    return errors.error_for_code(code, "").__class__.__name__
