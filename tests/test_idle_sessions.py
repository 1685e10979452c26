"""Sessions that go unused, and peers that go away, leave no threads or sockets behind.

``idle_session_timeout``: a session unused that long closes its data connections (the sweep runs
once a second on the engine's loop); the next call opens it again without an error. A session
whose connections broke (the peer died or restarted) is closed by the same sweep, without
waiting for a call. Every transfer is verified by digest.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from support.nodes import free_rpc_port, pinned_node, wait_all_streams
from support.resources import pipes_follow_threads, threads_and_fds

from flagcx_mc import AsyncTransferEngine, HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess

MIB = 1 << 20
IDLE = 0.5  # idle_session_timeout of these tests' engines
RELEASED_WITHIN = IDLE + 3.0  # the sweep runs once a second; the I/O pool's extra threads end after 2 s idle


def wait_until_back_to(base: tuple[int, int, int], timeout: float) -> tuple[int, int, int]:
    """Poll until threads and (non-pipe) fds are no more than ``base``; the last count either way."""
    deadline = time.monotonic() + timeout
    now = threads_and_fds()
    while (now[0] > base[0] or now[1] > base[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = threads_and_fds()
    return now


def write_verified(eng: TransferEngine, buf: HostBuffer, target: NodeProcess, length: int = MIB) -> None:
    digest = buf.fill_random(0, length)
    assert eng.transfer_sync_write(target.session, buf.addr, target.addr(0), length) == 0
    assert target.call("digest", region=0, offset=0, length=length)["digest"] == digest


def open_engine(**settings) -> tuple[TransferEngine, HostBuffer]:
    eng = TransferEngine(transport="tcp", streams_per_peer=4, **settings)
    buf = HostBuffer(4 * MIB)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng.register_memory(buf.addr, buf.size) == 0
    return eng, buf


@pytest.mark.timeout(60)
def test_an_idle_session_closes_its_connections_and_opens_again_on_next_use():
    """After a verified write the session holds streams (sockets) here and connections
    at the target; unused for IDLE seconds it lets all of them go; the next write opens it again
    and lands, with no error, and that, three times over.  The count to return to is taken after
    a first session came and went: executor threads that opening and closing sessions start once
    stay for the engine's life."""
    target = NodeProcess(regions=[4 * MIB])
    eng, buf = open_engine(idle_session_timeout=IDLE)
    try:
        write_verified(eng, buf, target)
        session = eng._state.require_sessions().peek(target.session)
        deadline = time.monotonic() + RELEASED_WITHIN
        while not session.released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session.released
        time.sleep(0.5)
        base = threads_and_fds()
        for round_ in range(3):
            write_verified(eng, buf, target)
            wait_all_streams(eng, target.session)
            busy = threads_and_fds()
            # Its streams run on the process's I/O pool: a session shows as sockets, not threads.
            assert busy[1] > base[1], f"round {round_}: no session seen: {base} -> {busy}"
            assert target.call("stats")["server_connections"] >= 4
            now = wait_until_back_to(base, RELEASED_WITHIN)
            assert now[0] <= base[0] and now[1] <= base[1], f"round {round_}: not released: {base} -> {busy} -> {now}"
            assert pipes_follow_threads(base, now), f"round {round_}: pipes beyond the threads': {base} -> {now}"
            deadline = time.monotonic() + 3
            while target.call("stats")["server_connections"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert target.call("stats")["server_connections"] == 0
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.timeout(60)
def test_a_session_in_use_is_never_released():
    """Writes every 0.1 s for 3 s, longer than IDLE in all: the session is the same object all
    along (never closed under its calls), and every write lands."""
    target = NodeProcess(regions=[4 * MIB])
    eng, buf = open_engine(idle_session_timeout=IDLE)
    try:
        write_verified(eng, buf, target)
        first = eng._state.require_sessions().peek(target.session)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            write_verified(eng, buf, target, 64 * 1024)
            time.sleep(0.1)
        assert eng._state.require_sessions().peek(target.session) is first
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.timeout(60)
def test_a_call_that_raced_the_release_is_sent_again():
    """A call that took the session just before the sweep closed it (simulated: the sweep runs
    with a zero idle time while the session is held aside) is sent again on a new session and
    lands; the caller sees no error."""
    target = NodeProcess(regions=[4 * MIB])
    eng, buf = open_engine(idle_session_timeout=0)
    try:
        write_verified(eng, buf, target)
        sessions = eng._state.require_sessions()
        held = sessions.peek(target.session)
        assert held is not None

        async def release():
            for session in sessions.sweep(1e-9):  # what the loop's sweep does when time is up
                session.close()
        eng._run(release())
        assert held.released and not held.peer.healthy
        real_peek = sessions.peek
        sessions.peek = lambda name: held  # the racing call's view: the session it had looked up
        try:
            write_verified(eng, buf, target)
        finally:
            sessions.peek = real_peek
        assert sessions.peek(target.session) is not held
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.timeout(60)
def test_a_pinned_connection_stays_open():
    """A session the application holds (``get_conn``) is never released for idleness."""
    target = NodeProcess(regions=[4 * MIB])
    eng, buf = open_engine(idle_session_timeout=IDLE)
    try:
        conn = eng.get_conn(target.session)
        time.sleep(RELEASED_WITHIN)
        assert conn.peer.healthy and not conn.released
        desc = eng.make_desc(conn, target.addr(0), MIB)
        digest = buf.fill_random(0, MIB)
        assert eng.write_vector_sync(conn, [buf.addr], [desc], [MIB]) == 0
        assert target.call("digest", region=0, offset=0, length=MIB)["digest"] == digest
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.timeout(90)
def test_a_peer_that_dies_or_restarts_while_idle_leaves_nothing_behind():
    """Sessions are kept open for ever (``idle_session_timeout=0``), yet a peer killed while
    idle has its session's threads and sockets closed within seconds, without a call (three
    times, back to the count after the first); the peer restarted under the same name is reached
    by the next call."""
    port = free_rpc_port()
    target = pinned_node(port, [4 * MIB])
    eng, buf = open_engine(idle_session_timeout=0)
    try:
        base = None
        for round_ in range(3):  # the first round sets the count to return to (see above)
            write_verified(eng, buf, target)  # the first call after a restart reaches the new process
            busy = threads_and_fds()
            target.kill()
            if base is None:
                time.sleep(2.5)
                base = threads_and_fds()
            now = wait_until_back_to(base, 5.0)
            assert busy[1] > now[1], f"round {round_}: no session seen: {busy} -> {now}"
            assert now[0] <= base[0] and now[1] <= base[1], f"a dead peer's session left {base} -> {now}"
            assert pipes_follow_threads(base, now), f"round {round_}: pipes beyond the threads': {base} -> {now}"
            target = pinned_node(port, [4 * MIB])
        write_verified(eng, buf, target)
        target.kill()  # killed again, and restarted before the sweep sees it: the next call still lands
        target = pinned_node(port, [4 * MIB])
        write_verified(eng, buf, target)
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_the_async_facade_releases_and_reopens_too():
    """The same release and reopening from coroutines: 16 concurrent verified writes, an idle
    spell, 16 more, on the loop under test (asyncio's and uvloop)."""
    target = NodeProcess(regions=[4 * MIB])
    buf = HostBuffer(4 * MIB)
    eng = AsyncTransferEngine(transport="tcp", streams_per_peer=4, idle_session_timeout=IDLE)
    try:
        await eng.initialize("127.0.0.1")
        await eng.register_memory(buf.addr, buf.size)
        block = 256 * 1024
        for _ in range(2):
            digest = buf.fill_random(0, 16 * block)
            await asyncio.gather(*(eng.transfer_sync_write(target.session, buf.addr + i * block,
                                                           target.addr(0, i * block), block) for i in range(16)))
            assert target.call("digest", region=0, offset=0, length=16 * block)["digest"] == digest
            session = eng._state.require_sessions().peek(target.session)
            deadline = time.monotonic() + RELEASED_WITHIN
            while not (session.released and not session.peer.healthy) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # released on the loop, then closed in an executor thread
            assert session.released and not session.peer.healthy
        assert threading.active_count() < 20
    finally:
        await eng.close()
        buf.close()
        target.close()


@pytest.mark.timeout(60)
def test_sessions_share_a_budget_of_streams():
    """With ``stream_budget=6`` the first session gets 3 streams (half the budget, under
    ``streams_per_peer=4``), the next one half of the 3 left, the last one (the floor); every
    write lands, and each target counts as many inbound connections as its session has
    streams."""
    targets = [NodeProcess(regions=[4 * MIB]) for _ in range(3)]
    eng, buf = open_engine(stream_budget=6)
    try:
        for target in targets:
            write_verified(eng, buf, target)
            wait_all_streams(eng, target.session)
        sessions = eng._state.require_sessions()
        streams = [sessions.peek(t.session).peer.streams for t in targets]
        assert streams == [3, 1, 1], streams
        assert [t.call("stats")["server_connections"] for t in targets] == streams
    finally:
        eng.close()
        buf.close()
        for target in targets:
            target.close()
