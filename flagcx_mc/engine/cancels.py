"""``Cancels``: the core's blocking cancels of an async engine, run in turn by one thread of the
wait executor.

Cancelling a transfer in the core returns once nothing touches its buffers, which takes
milliseconds (the first cancel cuts the connections carrying it; later ones mostly find their
slices already taken back).  One ``asyncio.timeout`` around hundreds of coroutines cancels them
all at once; run one executor job each, they would grow the executor by as many threads, which
it keeps.  Queued here, one thread runs them back to back and each cancelled coroutine resumes
as soon as its own cancel is done.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import Executor

__all__ = ["Cancels"]


class Cancels:
    """Blocking cancels queued from one loop, run by at most one executor thread at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: Callable[[], Executor | None]) -> None:
        self._loop = loop
        self._executor = executor
        self._queue: collections.deque[tuple[Callable[[], object], asyncio.Future]] = collections.deque()
        self._lock = threading.Lock()
        self._running = False

    def run(self, stop: Callable[[], object]) -> asyncio.Future:
        """Queue ``stop``; the future resolves (or fails with its exception) once it returned."""
        future = self._loop.create_future()
        executor = self._executor()
        if executor is None:  # closed: closing cancelled everything in the core already
            future.set_result(None)
            return future
        with self._lock:
            self._queue.append((stop, future))
            start, self._running = not self._running, True
        if start:
            try:
                self._loop.run_in_executor(executor, self._drain)
            except RuntimeError:  # the executor shut down: the engine is closing, which cancels it all
                self._abandon()
        return future

    def _abandon(self) -> None:
        with self._lock:
            queued, self._running = list(self._queue), False
            self._queue.clear()
        for _, future in queued:
            _settle(future, None)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                stop, future = self._queue.popleft()
            error: BaseException | None = None
            try:
                stop()
            except BaseException as exc:  # handed to the cancelled call, which reports it
                error = exc
            try:
                self._loop.call_soon_threadsafe(_settle, future, error)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
