"""Pool workers that linger with a busy connection (``fmc_pool_linger_begin``).

Once a connection runs dry, the target's serve worker polls its socket alone, and a stream's
send side (on the stream's condition variable) and receive side (on its socket) wait for that
stream's next work, for up to 10 ms, instead of going back to the shared epoll set. Whatever
comes next must wake the lingering worker itself: a lost wake-up would not fail a call, it would
make each call wait out the linger. These tests run back-to-back calls of every shape that
meets a lingering side (bulk writes and reads over several streams, small calls after bulk ones,
a second initiator beside the first), verify every byte, and hold each shape's median call well
under a linger (a median, so that a noisy machine's odd slow call does not decide); and close
engines while their workers linger.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess

KIB = 1 << 10
MIB = 1 << 20
ROUNDS = 60
LINGER_S = 0.010
# a call that waits for a lingering worker's time-out takes up to LINGER_S; back-to-back calls
# on loopback take well under a millisecond
MEDIAN_BOUND_S = LINGER_S / 4


def _engine(streams: int = 4) -> TransferEngine:
    eng = TransferEngine(transport="tcp", streams_per_peer=streams)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return eng


def _blocks(base: int, block: int, count: int) -> list[int]:
    return [base + i * block for i in range(count)]


def _timed(times: list[float], call: Callable[..., int], *args: object) -> int:
    started = time.monotonic()
    rc = call(*args)
    times.append(time.monotonic() - started)
    return rc


def _assert_medians_under_a_linger(times: dict[str, list[float]], bound: float = MEDIAN_BOUND_S) -> None:
    medians = {shape: statistics.median(t) for shape, t in times.items()}
    assert all(m < bound for m in medians.values()), {k: f"{v * 1e3:.2f} ms" for k, v in medians.items()}


def _close_all(engines: list[TransferEngine], bufs: list[HostBuffer], target: NodeProcess) -> None:
    for eng in engines:
        eng.close()
    for buf in bufs:
        buf.close()
    target.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("streams", [1, 4])
def test_back_to_back_calls_wake_lingering_workers_and_move_every_byte(streams):
    """Rounds of a 1 MiB write over four streams, a 1 MiB read back into a second buffer, a
    4 KiB write and a 4 KiB read: the read-back equals what was written, the target holds every
    write, and no shape's median call comes near a linger.  On one stream the target's serve
    worker lingers on its one connection while another watches the set, even on 2 CPUs."""
    size = 2 * MIB
    target = NodeProcess(regions=[size], config={"transport": "tcp"})
    eng = _engine(streams)
    src, back = HostBuffer(size), HostBuffer(size)
    try:
        for buf in (src, back):
            assert eng.register_memory(buf.addr, size) == 0
        block, count = 256 * KIB, 4
        lens = [block] * count
        halves = (0, MIB)
        times: dict[str, list[float]] = {"bulk write": [], "bulk read": [], "small write": [], "small read": []}
        for r in range(ROUNDS + 1):  # round 0 warms up: streams connected, workers started
            src.fill_random()  # fresh bytes every round
            # back to back: each call meets the workers the one before left lingering
            for half in halves:
                srcs, dsts = _blocks(src.addr + half, block, count), _blocks(target.addr(0, half), block, count)
                assert _timed(times["bulk write"], eng.batch_transfer_sync_write, target.session, srcs, dsts, lens) == 0
            for half in halves:
                backs, dsts = _blocks(back.addr + half, block, count), _blocks(target.addr(0, half), block, count)
                assert _timed(times["bulk read"], eng.batch_transfer_sync_read, target.session, backs, dsts, lens) == 0
            small = (r % 16) * 4 * KIB
            at = target.addr(0, small)
            assert (
                _timed(times["small write"], eng.transfer_sync_write, target.session, src.addr + small, at, 4 * KIB)
                == 0
            )
            assert (
                _timed(times["small read"], eng.transfer_sync_read, target.session, back.addr + small, at, 4 * KIB) == 0
            )
            assert back.digest() == src.digest()  # the small read brought back what its write sent
            if r == 0:
                times = {shape: [] for shape in times}
        assert target.call("digest", region=0)["digest"] == src.digest()
        _assert_medians_under_a_linger(times)
    finally:
        eng.close()
        src.close()
        back.close()
        target.close()


@pytest.mark.timeout(120)
def test_two_initiators_take_turns_with_one_target_while_its_workers_linger():
    """Two engines write 1 MiB each into their own half of one target, in turns: the serve
    worker left lingering on one initiator's connection must not keep the other's requests
    waiting, and both halves end as written."""
    size = 2 * MIB
    target = NodeProcess(regions=[size], config={"transport": "tcp"})
    engines = [_engine(), _engine()]
    bufs = [HostBuffer(MIB), HostBuffer(MIB)]
    try:
        for eng, buf in zip(engines, bufs, strict=True):
            assert eng.register_memory(buf.addr, MIB) == 0
        block, count = 256 * KIB, 4
        lens = [block] * count
        times: dict[str, list[float]] = {"first initiator": [], "second initiator": []}
        for r in range(ROUNDS):
            k = r % 2
            bufs[k].fill_random()
            srcs, dsts = _blocks(bufs[k].addr, block, count), _blocks(target.addr(0, k * MIB), block, count)
            shape = ("first initiator", "second initiator")[k]
            assert _timed(times[shape], engines[k].batch_transfer_sync_write, target.session, srcs, dsts, lens) == 0
        for k in range(2):
            assert target.call("digest", region=0, offset=k * MIB, length=MIB)["digest"] == bufs[k].digest()
        _assert_medians_under_a_linger(times)
    finally:
        _close_all(engines, bufs, target)


@pytest.mark.timeout(60)
def test_an_engine_closes_at_once_while_its_streams_workers_linger():
    """Right after bulk writes and reads, when the streams' send and receive sides linger, close()
    returns promptly and a new engine in the same process moves verified bytes to the target."""
    size = MIB
    target = NodeProcess(regions=[size], config={"transport": "tcp"})
    buf = HostBuffer(size)
    try:
        for _ in range(5):
            eng = _engine()
            assert eng.register_memory(buf.addr, size) == 0
            digest = buf.fill_random()
            lens = [256 * KIB] * 4
            assert (
                eng.batch_transfer_sync_write(
                    target.session, _blocks(buf.addr, 256 * KIB, 4), _blocks(target.addr(0), 256 * KIB, 4), lens
                )
                == 0
            )
            assert (
                eng.batch_transfer_sync_read(
                    target.session, _blocks(buf.addr, 256 * KIB, 4), _blocks(target.addr(0), 256 * KIB, 4), lens
                )
                == 0
            )
            assert buf.digest() == digest
            started = time.monotonic()
            eng.close()
            assert time.monotonic() - started < 2.0
            assert target.call("digest", region=0)["digest"] == digest
    finally:
        buf.close()
        target.close()


@pytest.mark.timeout(120)
def test_a_lingering_serve_worker_is_called_back_when_connections_wait_at_the_cap():
    """A target whose serve pool may hold 2 threads takes writes from three initiators of 4
    streams each, all at once: while one worker lingers on a connection that ran dry and the
    other takes a request, the connections still waiting in the set call the lingering one back
    (the pool counts each recall), every range ends as written, and the median call stays under
    a linger (three initiators share the target's two threads, so not the quarter of one that
    calls of one initiator keep)."""
    initiators, block, count = 3, 256 * KIB, 4
    target = NodeProcess(regions=[initiators * MIB], config={"transport": "tcp"},
                         env={"FLAGCX_MC_SERVE_THREADS": "2"})
    engines = [_engine() for _ in range(initiators)]
    bufs = [HostBuffer(MIB) for _ in range(initiators)]
    times: dict[str, list[float]] = {f"initiator {k}": [] for k in range(initiators)}
    failures: list[str] = []

    def writer(k: int) -> None:
        srcs, dsts = _blocks(bufs[k].addr, block, count), _blocks(target.addr(0, k * MIB), block, count)
        for _ in range(ROUNDS):
            bufs[k].fill_random()
            rc = _timed(times[f"initiator {k}"], engines[k].batch_transfer_sync_write, target.session, srcs, dsts,
                        [block] * count)
            if rc != 0:
                failures.append(f"initiator {k}: {rc}")
                return

    try:
        for eng, buf in zip(engines, bufs, strict=True):
            assert eng.register_memory(buf.addr, MIB) == 0
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(initiators)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        for k in range(initiators):
            assert target.call("digest", region=0, offset=k * MIB, length=MIB)["digest"] == bufs[k].digest()
        stats = target.call("stats")
        assert stats["serve_threads"] <= 2, stats
        assert stats["serve_recalls"] > 0, stats
        _assert_medians_under_a_linger(times, bound=LINGER_S)
    finally:
        _close_all(engines, bufs, target)
