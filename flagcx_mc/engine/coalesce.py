"""``Coalescer``: transfer calls that coroutines start in one turn of the event loop, to one
peer over TCP with one opcode, leave together as core batches (one, or two once they are large).

Over TCP most of a small call's cost is fixed (a send, the target's wake-up, an answer, the
wake-ups that bring it back to the loop), whatever its size up to a few hundred KiB.  Sixteen
coroutines each awaiting its own 64 KiB write pay that sixteen times one after another; gathered
into one batch they pay it once and their bytes stream back to back.  A call joins the open
group of its peer and opcode and awaits its future; the group leaves from a callback that the
first call scheduled with ``call_soon``, which runs once every coroutine already ready on the
loop has had its turn (and so its chance to join), or as soon as it is full.

A group also leaves as soon as it holds half of what its peer had in flight when the last group
left (its coroutines' level), but not below ``GROUP_SPLIT_BYTES``; the calls after it form the
next group.  Its bytes are then on the wire while the other coroutines take their turn, and two
groups stay in flight, one returning while the other crosses (the core keeps a group of up to
512 KiB on one stream, so the next finds another).  On 2 CPUs, 16 coroutines of 64 KiB writes
made 17 % more calls per second in two 512 KiB groups than in one 1 MiB group; 64 coroutines,
in groups of about 2 MiB, as many as in one of 4 MiB.

A lone coroutine gains nothing from waiting a turn: after ``LONE_GROUPS`` groups in a row of
one call each, calls go straight to the core (``join`` returns None) except one in
``PROBE_EVERY``, which opens a group again: if other coroutines are calling, they join it and
grouping resumes.

Each call's outcome is its own: the core keeps a status per task, so a group's failed task
fails only the call it came from.  If the group cannot be started at all (one call's range is
not registered on the peer, say), every call is started on its own instead, each meeting its
own error.  A group's successes are counted together, the group's duration standing for each
call's latency (the core counts calls, not groups).  A cancelled call cancels its own tasks of
the group's batch and returns once nothing touches its buffers any more; the other calls of the
group go on (the core sends their slices again if they shared a connection it had to cut).  One
cancelled before its group left is simply left out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .. import errors
from .._argpack import pack3
from .._core import CoreBatch
from .requests import SingleTransfer, TransferRequest
from .sessions import Session

__all__ = ["Coalescer", "cancel_in_group", "merge"]

# A group holds at most this much: a larger one gains nothing from more company, and the calls
# of a group end together, so a small call should not wait behind megabytes.
GROUP_MAX_BYTES = 4 << 20
GROUP_MAX_TASKS = 4096
GROUP_SPLIT_BYTES = 512 << 10  # the least a group leaves with before the turn is over
_LEVELS_KEPT = 1024  # (peer, opcode) levels remembered
LONE_GROUPS = 8
PROBE_EVERY = 64

_TIMEOUT_CODE = errors.TransferTimeoutError.code

Call = TransferRequest | SingleTransfer
Outcome = tuple[int, str]  # (rc, why)
Started = tuple[int, str, CoreBatch | None]
# Counts successful calls: (target, opcode, calls, bytes, seconds each).
Record = Callable[[str, int, int, int, float], None]


class _Group:
    __slots__ = ("session", "target", "opcode", "started", "calls", "bytes", "tasks", "sent", "ended", "batch",
                 "sent_calls", "alone")

    def __init__(self, session: Session, target: str, opcode: int) -> None:
        self.session, self.target, self.opcode = session, target, opcode
        self.started = time.perf_counter()
        self.calls: list[tuple[Call, asyncio.Future]] = []
        self.bytes = self.tasks = 0
        self.sent = False
        self.ended: asyncio.Future | None = None  # once sent: resolved when its batch has ended
        self.batch: CoreBatch | None = None  # the batch of sent_calls, in their order, while in flight
        self.sent_calls: list[tuple[Call, asyncio.Future]] = []
        self.alone: dict[asyncio.Future, CoreBatch] = {}  # calls started one by one (a refused group)

    def batch_of(self, future: asyncio.Future) -> tuple[CoreBatch, int, int] | None:
        """The batch and task range ``(first, count)`` of the call awaiting ``future``; None when
        it never reached the core or has ended there."""
        alone = self.alone.get(future)
        if alone is not None:
            return alone, 0, alone.ntasks
        if self.batch is None:
            return None
        first = 0
        for req, waiting in self.sent_calls:
            if waiting is future:
                return self.batch, first, req.count
            first += req.count
        return None


def merge(reqs: list[Call]) -> TransferRequest:
    """One request of every range of ``reqs``, in order (one opcode)."""
    singles = [r for r in reqs if type(r) is SingleTransfer]
    if len(singles) == len(reqs):
        packed, n, total = pack3([r.buffer for r in singles], [r.peer_address for r in singles],
                                 [r.length for r in singles])
        return TransferRequest(reqs[0].opcode, n, total, packed)
    parts = [_arrays(r) for r in reqs]
    packed = b"".join(p[0] for p in parts) + b"".join(p[1] for p in parts) + b"".join(p[2] for p in parts)
    return TransferRequest(reqs[0].opcode, sum(r.count for r in reqs), sum(r.total_bytes for r in reqs), packed)


def _arrays(req: Call) -> tuple[bytes, bytes, bytes]:
    """The local, remote and length arrays of ``req`` as packed u64s (pack3's layout)."""
    if type(req) is SingleTransfer:
        packed = pack3([req.buffer], [req.peer_address], [req.length])[0]
        return packed[:8], packed[8:16], packed[16:24]
    assert isinstance(req, TransferRequest)
    n, slots, p = req.count, max(req.count, 1), req.packed
    return p[:8 * n], p[8 * slots:8 * (slots + n)], p[16 * slots:8 * (2 * slots + n)]


class Coalescer:
    """The open groups of one engine's loop, by (peer, opcode)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, start_alone: Callable[[Session, Call], Started],
                 start_group: Callable[[Session, TransferRequest], Started],
                 wait: Callable[[CoreBatch, float], asyncio.Future], deadline: Callable[[int], float],
                 record: Record) -> None:
        self._loop = loop
        self._start_alone = start_alone  # a call as the engine starts one on its own; counted by the core
        self._start_group = start_group  # a merged request; never counted by the core
        self._wait = wait  # (batch, deadline) -> future of (rc, why): the poller's
        self._deadline = deadline  # bytes -> time.monotonic() deadline
        self._record = record
        self._open: dict[tuple[int, int], _Group] = {}
        self._flying: dict[tuple[int, int], int] = {}  # bytes of groups sent and not yet ended, by key
        self._level: dict[tuple[int, int], int] = {}  # bytes in flight when the key's last group left
        self.groups = 0  # groups of two or more calls sent as one batch
        self.grouped_calls = 0  # the calls in them
        self._lone = 0  # groups of one call in a row
        self._skipped = 0  # calls sent straight since the last probe

    def join(self, target: str, session: Session, req: Call) -> tuple[asyncio.Future, _Group] | None:
        """The call's future of its ``(rc, why)`` and its group; None: start it straight away
        (``target``: the name the call was made to, for its count)."""
        key = (id(session.peer), req.opcode)
        group = self._open.get(key)
        if group is None or group.session is not session:
            if self._lone >= LONE_GROUPS and group is None:
                self._skipped += 1
                if self._skipped < PROBE_EVERY:
                    return None
                self._skipped = 0
            if group is not None:
                self._send(key, group)
            group = self._open[key] = _Group(session, target, req.opcode)
            self._loop.call_soon(self._send, key, group)
        future = self._loop.create_future()
        group.calls.append((req, future))
        group.bytes += req.total_bytes
        group.tasks += req.count
        if (group.bytes >= GROUP_MAX_BYTES or group.tasks >= GROUP_MAX_TASKS
                or (group.bytes >= GROUP_SPLIT_BYTES and group.bytes * 2 >= self._level.get(key, 0))):
            self._send(key, group)
        return future, group

    def _send(self, key: tuple[int, int], group: _Group) -> None:
        if group.sent:
            return
        group.sent = True
        if self._open.get(key) is group:
            del self._open[key]
        calls = [(req, future) for req, future in group.calls if not future.done()]  # cancelled: left out
        self._lone = self._lone + 1 if len(calls) == 1 else 0
        group.ended = self._loop.create_future()
        if len(self._level) > _LEVELS_KEPT and key not in self._level:
            self._level.clear()  # peers come and go: only a hint, so forget the old ones
        self._flying[key] = self._level[key] = self._flying.get(key, 0) + group.bytes

        def landed() -> None:
            self._landed(key, group)

        try:
            if not calls:
                landed()
            elif len(calls) == 1:
                self._send_alone(group, *calls[0], landed)
            else:
                self._send_together(group, calls, landed)
        except Exception as exc:  # the engine closed under the group, say: its callers see why
            for _, future in calls:
                if not future.done():
                    future.set_exception(exc)
            landed()

    def _landed(self, key: tuple[int, int], group: _Group) -> None:
        """The group's batch has ended: it is no longer in flight (counted at once, so that the
        calls it resolves find the count right when they call again) and its cancelled callers
        may return.  Once only: a group that failed while it was being sent lands here at once,
        and its calls already started may still end."""
        assert group.ended is not None
        if group.ended.done():
            return
        left = self._flying[key] - group.bytes
        if left:
            self._flying[key] = left
        else:
            del self._flying[key]
        group.ended.set_result(None)

    def _send_alone(self, group: _Group, req: Call, future: asyncio.Future, on_end: Callable[[], None]) -> None:
        rc, why, batch = self._start_alone(group.session, req)
        if batch is None:  # ended here: the core counted a success
            _resolve(future, (rc, why))
            on_end()
            return
        group.alone[future] = batch

        def done(waited: asyncio.Future) -> None:
            group.alone.pop(future, None)
            outcome = waited.result()
            if outcome[0] == 0:
                self._record(group.target, group.opcode, 1, req.total_bytes, time.perf_counter() - group.started)
            on_end()
            _resolve(future, outcome)

        self._wait(batch, self._deadline(req.total_bytes)).add_done_callback(done)

    def _send_together(self, group: _Group, calls: list[tuple[Call, asyncio.Future]],
                       on_end: Callable[[], None]) -> None:
        self.groups += 1
        self.grouped_calls += len(calls)
        merged = merge([req for req, _ in calls])
        rc, why, batch = self._start_group(group.session, merged)
        if rc != 0:  # refused as a whole, or failed at once: each call on its own finds its outcome
            left = [len(calls)]

            def one_ended() -> None:
                left[0] -= 1
                if not left[0]:
                    on_end()

            for req, future in calls:
                self._send_alone(group, req, future, one_ended)
            return
        if batch is None:  # ended within the poll: all succeeded
            seconds = time.perf_counter() - group.started
            self._record(group.target, group.opcode, len(calls), merged.total_bytes, seconds)
            on_end()
            for _, future in calls:
                _resolve(future, (0, ""))
            return

        group.batch, group.sent_calls = batch, calls

        def done(waited: asyncio.Future) -> None:
            seconds = time.perf_counter() - group.started
            group.batch = None
            on_end()
            ok_calls, ok_bytes = _resolve_each(calls, batch, waited.result(), merged.total_bytes)
            if ok_calls:
                self._record(group.target, group.opcode, ok_calls, ok_bytes, seconds)

        self._wait(batch, self._deadline(merged.total_bytes)).add_done_callback(done)


def cancel_in_group(group: _Group, future: asyncio.Future) -> Callable[[], None] | None:
    """What stops the call of ``group`` awaiting ``future`` (its task was cancelled): a blocking
    cancel of its tasks in the core, returning once nothing touches its buffers; None when there
    is nothing to stop (it was left out of the group, or has ended)."""
    found = group.batch_of(future) if group.ended is not None and not group.ended.done() else None
    if found is None:
        return None
    batch, first, count = found
    return lambda: batch.cancel_tasks(first, count)


def _resolve(future: asyncio.Future, outcome: Outcome) -> None:
    if not future.done():  # a cancelled waiter has gone already
        future.set_result(outcome)


def _resolve_each(calls: list[tuple[Call, asyncio.Future]], batch: CoreBatch,
                  outcome: tuple[int, str], total_bytes: int) -> tuple[int, int]:
    """Every call's share of its group's outcome (when the group failed, its own tasks'
    statuses); returns the calls that succeeded and their bytes (``total_bytes``: all of them)."""
    rc, why = outcome
    if rc == 0:  # the common case, kept short: it runs once per call on the loop
        ok: Outcome = (0, "")
        for _, future in calls:
            if not future.done():  # a cancelled waiter has gone already
                future.set_result(ok)
        return len(calls), total_bytes
    first = ok_calls = ok_bytes = 0
    for req, future in calls:
        own: Outcome = (0, "")
        for i in range(first, first + req.count):
            status = batch.task_status(i)
            if status != 0:  # its own failure; but cut at the group's deadline, a timeout
                own = (status if status < 0 and rc != _TIMEOUT_CODE else rc, why)
                break
        first += req.count
        if own[0] == 0:
            ok_calls += 1
            ok_bytes += req.total_bytes
        _resolve(future, own)
    return ok_calls, ok_bytes
