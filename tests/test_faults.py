"""Faults with real processes: a target killed or frozen mid-batch, an initiator killed mid-batch,
unregister under read and write traffic.  After every failure the caller's buffers are rewritten
and the test checks that none of the new bytes ever move (the engine no longer touches them).

The initiator here is the Mooncake drop-in (``TransferEngine``) driven from several threads at
once, as vLLM drives it; tests/test_timeouts.py covers the async facade.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from support.nodes import free_rpc_port, pinned_node, wait_all_streams

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess

TIMEOUT = 2.0            # transfer_timeout of the initiators in this module
SLACK = 1.0              # scheduling slack on a busy 2-core machine
MIB = 1 << 20
BIG = 64 * MIB           # far more than socket buffers hold: a frozen peer stalls the sender
BLOCK = 4 * MIB
NBLOCKS = BIG // BLOCK
ECONN, ETIMEOUT = -102, -105
# What each kind of call may return when its peer dies or stalls (Mooncake's conventions:
# get_batch_transfer_status gives -1, transfer_check_status -1 failed or -2 timed out).
FAILURE_CODES = {
    "batch write": {ECONN, ETIMEOUT},
    "batch read": {ECONN, ETIMEOUT},
    "async batch": {-1},
    "submit": {-1, -2},
    "small write": {ECONN, ETIMEOUT},
    "small read": {ECONN, ETIMEOUT},
}

def post(node: NodeProcess, cmd: str, **kwargs) -> None:
    """Send a command to a node without waiting for its answer."""
    node.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
    node.proc.stdin.flush()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took, fails the test after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


class Calls:
    """Run several transfer calls in threads at once; record each one's result and timing."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self._threads: list[threading.Thread] = []

    def start(self, name: str, fn: Callable[[], int]) -> None:
        def main() -> None:
            start = time.monotonic()
            try:
                rc = fn()
            except BaseException as exc:  # the assertion below reports it
                rc = repr(exc)
            self.results[name] = {"rc": rc, "start": start, "end": time.monotonic()}

        thread = threading.Thread(target=main, name=f"call-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self, timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"calls still waiting after {timeout} s: {stuck}"
        return self.results


def async_write(eng: TransferEngine, target: str, local: list[int], remote: list[int], lens: list[int]) -> int:
    """Mooncake's async batch API: submit, then wait for it."""
    batch = eng.batch_transfer_async_write(target, local, remote, lens)
    if batch == 0:
        return -1
    return eng.get_batch_transfer_status([batch])


def submit_and_poll(eng: TransferEngine, target: str, local: int, remote: int, length: int) -> int:
    """``transfer_submit_write`` + ``transfer_check_status`` until it is not in progress."""
    batch = eng.transfer_submit_write(target, local, remote, length)
    if batch == 0:
        return -1
    while True:
        state = eng.transfer_check_status(batch)
        if state != 0:
            return 0 if state == 1 else state
        time.sleep(0.02)


def blocks(base: int, count: int = NBLOCKS, size: int = BLOCK) -> list[int]:
    return [base + i * size for i in range(count)]


@pytest.fixture
def initiator():
    """A Mooncake drop-in engine on 127.0.0.1 with 2 * BIG registered bytes."""
    buf = HostBuffer(2 * BIG)
    eng = TransferEngine(transfer_timeout=TIMEOUT, handshake_timeout=2.0)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng.register_memory(buf.addr, buf.size) == 0
    yield eng, buf
    eng.close()
    buf.close()


def write_verified(eng: TransferEngine, buf: HostBuffer, node: NodeProcess, region: int = 0,
                   offset: int = 0, length: int = MIB, local_offset: int = 0) -> None:
    digest = buf.fill_random(local_offset, length)
    assert eng.transfer_sync_write(node.session, buf.addr + local_offset, node.addr(region, offset), length) == 0
    assert node.call("digest", region=region, offset=offset, length=length)["digest"] == digest


def read_verified(eng: TransferEngine, buf: HostBuffer, node: NodeProcess, region: int = 0,
                  offset: int = 0, length: int = MIB, local_offset: int = 0) -> None:
    digest = node.call("fill", region=region, offset=offset, length=length)["digest"]
    assert eng.transfer_sync_read(node.session, buf.addr + local_offset, node.addr(region, offset), length) == 0
    assert buf.digest(local_offset, length) == digest


def server_connections(node: NodeProcess) -> int:
    return node.call("stats")["server_connections"]


# ---------------------------------------------------------------------------------------------


def test_killed_target_fails_every_waiting_call_then_comes_back_on_same_and_new_port(initiator, caplog):
    eng, buf = initiator
    caplog.set_level(logging.WARNING, logger="flagcx_mc.engine.sessions")
    port = free_rpc_port()
    target = pinned_node(port, [BIG, BIG])
    replacement = None
    try:
        name = target.session
        assert name == f"127.0.0.1:{port}"
        write_verified(eng, buf, target)
        # Freeze it first so that every call below is certainly in flight when it dies.
        target.freeze()
        buf.fill(0x11, 0, BIG)
        buf.fill(0x00, BIG, BIG)
        calls = Calls()
        calls.start("batch write", lambda: eng.batch_transfer_sync_write(
            name, blocks(buf.addr), blocks(target.addr(0)), [BLOCK] * NBLOCKS))
        calls.start("batch read", lambda: eng.batch_transfer_sync_read(
            name, blocks(buf.addr + BIG), blocks(target.addr(1)), [BLOCK] * NBLOCKS))
        calls.start("async batch", lambda: async_write(
            eng, name, blocks(buf.addr, 4), blocks(target.addr(0, BIG // 2), 4), [BLOCK] * 4))
        calls.start("submit", lambda: submit_and_poll(eng, name, buf.addr, target.addr(0), 16 * MIB))
        calls.start("small write", lambda: eng.transfer_sync_write(  # small: sent by the calling thread
            name, buf.addr + BIG // 2, target.addr(0, BIG // 4), 64 << 10))
        calls.start("small read", lambda: eng.batch_transfer_sync_read(  # its caller reads the answer
            name, blocks(buf.addr + BIG + BIG // 2, 64, 4096), blocks(target.addr(1, BIG // 2), 64, 4096),
            [4096] * 64))
        time.sleep(0.3)
        assert not calls.results, f"calls finished against a frozen target: {calls.results}"
        target.kill()
        for what, r in calls.join(TIMEOUT + SLACK + 1).items():
            assert r["rc"] in FAILURE_CODES[what], (what, r)
            assert r["end"] - r["start"] <= TIMEOUT + SLACK, (what, r)  # within the transfer timeout
        # The calls are over: the engine must not touch their buffers again.  Rewrite them all.
        buf.fill(0x22, 0, BIG)
        buf.fill(0x44, BIG, BIG)

        # Later calls to the dead session fail fast (the rpc port refuses), and it is evicted.
        for _ in range(3):
            start = time.monotonic()
            assert eng.transfer_sync_write(name, buf.addr, target.addr(0), 4096) < 0
            assert time.monotonic() - start < 1.0
        assert any("evicted" in r.getMessage() and name in r.getMessage() for r in caplog.records)

        # Back on the same port: the same name reaches the new process, no initiator restart.
        replacement = pinned_node(port, [BIG, BIG])
        assert replacement.session == name and replacement.pid != target.pid
        write_verified(eng, buf, replacement, region=0, offset=5, length=2 * MIB)
        read_verified(eng, buf, replacement, region=1, offset=7, length=2 * MIB)
        assert replacement.call("guards")["intact"]

        # Killed while idle and back on the same port before the initiator calls again: its very
        # first call reaches the new process (the dead session is replaced, not reported).
        replacement.kill()
        replacement = pinned_node(port, [BIG])
        write_verified(eng, buf, replacement, offset=9, length=MIB)

        # Killed again and replaced on a new port: the new name works, the old one fails fast.
        replacement.kill()
        replacement = NodeProcess(regions=[BIG])
        assert replacement.session != name
        start = time.monotonic()
        assert eng.transfer_sync_write(name, buf.addr, target.addr(0), 4096) < 0
        assert time.monotonic() - start < 1.0
        write_verified(eng, buf, replacement, offset=3, length=3 * MIB)
        assert buf.read(BIG, BIG).count(0x44) == BIG  # no late byte ever reached the read buffer
    finally:
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGCONT)
        target.close()
        if replacement is not None:
            replacement.close()


def test_frozen_target_mid_batch_times_out_on_time_then_recovers(initiator):
    eng, buf = initiator
    target = NodeProcess(regions=[BIG, BIG])
    try:
        name = target.session
        write_verified(eng, buf, target)
        target.call("set", region=0, byte=0x00)
        target.call("set", region=1, byte=0x33)
        buf.fill(0x11, 0, BIG)
        buf.fill(0x00, BIG, BIG)
        target.freeze()
        calls = Calls()
        calls.start("batch write", lambda: eng.batch_transfer_sync_write(
            name, blocks(buf.addr), blocks(target.addr(0)), [BLOCK] * NBLOCKS))
        calls.start("batch read", lambda: eng.batch_transfer_sync_read(
            name, blocks(buf.addr + BIG), blocks(target.addr(1)), [BLOCK] * NBLOCKS))
        calls.start("async batch", lambda: async_write(
            eng, name, blocks(buf.addr, 4), blocks(target.addr(0, BIG // 2), 4), [BLOCK] * 4))
        calls.start("submit", lambda: submit_and_poll(eng, name, buf.addr, target.addr(0), 16 * MIB))
        calls.start("small write", lambda: eng.transfer_sync_write(  # small: sent by the calling thread
            name, buf.addr + BIG // 2, target.addr(0, BIG // 4), 64 << 10))
        calls.start("small read", lambda: eng.batch_transfer_sync_read(  # its caller reads the answer
            name, blocks(buf.addr + BIG + BIG // 2, 64, 4096), blocks(target.addr(1, BIG // 2), 64, 4096),
            [4096] * 64))
        results = calls.join(TIMEOUT + SLACK + 1)
        first_start = min(r["start"] for r in results.values())
        for what, r in results.items():
            assert r["rc"] in FAILURE_CODES[what], (what, r)
            # At the timeout, not later.  Not earlier either: the first deadline to pass cuts the
            # streams the calls share, which may fail the others (-102) a little before their own.
            assert r["end"] - r["start"] <= TIMEOUT + SLACK, (what, r)
            assert r["end"] >= first_start + TIMEOUT, (what, r)
        # Rewrite every buffer the calls used, then let the target run again.
        buf.fill(0x22, 0, BIG)
        buf.fill(0x44, BIG, BIG)
        os.kill(target.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert target.call("count_byte", region=0, byte=0x22)["count"] == 0  # no late source byte sent
        assert buf.read(BIG, BIG).count(0x44) == BIG                        # no late read byte landed
        # The engine recovers by itself: the broken session is replaced on next use.
        write_verified(eng, buf, target, region=0, offset=11, length=8 * MIB)
        read_verified(eng, buf, target, region=1, offset=13, length=8 * MIB, local_offset=BIG)
        assert target.call("guards")["intact"]
    finally:
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGCONT)
        target.close()


def test_small_read_from_a_frozen_target_times_out_on_time_and_nothing_lands_late(initiator):
    """A small synchronous read's caller reads its own answer (no receive-side wake-up); against
    a frozen target it still fails at the timeout, and the answer that comes after never lands."""
    eng, buf = initiator
    small = 64 * 4096
    target = NodeProcess(regions=[MIB])
    try:
        read_verified(eng, buf, target, length=small)
        target.call("set", region=0, byte=0x33)
        target.freeze()
        start = time.monotonic()
        rc = eng.batch_transfer_sync_read(target.session, blocks(buf.addr, 64, 4096), blocks(target.addr(0), 64, 4096),
                                          [4096] * 64)
        took = time.monotonic() - start
        assert rc in (ECONN, ETIMEOUT)
        assert TIMEOUT - 0.1 <= took <= TIMEOUT + SLACK, took
        buf.fill(0x44, 0, small)
        os.kill(target.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert buf.read(0, small).count(0x44) == small  # no late answer landed
        read_verified(eng, buf, target, offset=4096, length=small)
    finally:
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGCONT)
        target.close()


def test_refused_entry_fails_the_batch_and_nothing_moves_afterwards(initiator):
    eng, buf = initiator
    target = NodeProcess(regions=[BIG, MIB])
    try:
        name = target.session
        write_verified(eng, buf, target, region=1, length=4096)  # the session now knows region 1
        assert target.call("unregister", region=1)["rc"] == 0     # ...which is gone on the target
        target.call("set", region=0, byte=0x00)
        buf.fill(0x11, 0, BIG)
        local = blocks(buf.addr) + [buf.addr]
        remote = blocks(target.addr(0)) + [target.addr(1)]
        assert eng.batch_transfer_sync_write(name, local, remote, [BLOCK] * NBLOCKS + [4096]) < 0
        buf.fill(0x22, 0, BIG)
        time.sleep(0.3)
        assert target.call("count_byte", region=0, byte=0x22)["count"] == 0
        write_verified(eng, buf, target, region=0, length=4 * MIB)  # the session still serves
    finally:
        target.close()


def test_killed_initiator_frees_the_targets_connections_and_others_keep_going(initiator):
    eng, buf = initiator
    target = NodeProcess(regions=[BIG, BIG])
    victims: list[NodeProcess] = []
    try:
        baseline = server_connections(target)
        write_verified(eng, buf, target)  # a bystander with open streams
        wait_all_streams(eng, target.session)
        with_bystander = server_connections(target)
        assert with_bystander > baseline

        # Killed mid-write: the target is frozen so the victim's 64 MiB are certainly in flight.
        victim = NodeProcess(regions=[BIG])
        victims.append(victim)
        warm = [[0, 0, target.addr(0), 4096]]
        assert victim.call("transfer", op="write", target=target.session, items=warm)["rc"] == 0
        assert server_connections(target) > with_bystander
        target.freeze()
        post(victim, "transfer", op="write", target=target.session, items=[[0, 0, target.addr(0), BIG]])
        time.sleep(0.3)
        victim.kill()
        os.kill(target.pid, signal.SIGCONT)
        wait_for(lambda: server_connections(target) == with_bystander, 5.0, "connections of a killed writer freed")
        write_verified(eng, buf, target, offset=MIB, length=4 * MIB)

        # Killed mid-read: the victim stops reading while the target sends it 64 MiB.
        victim = NodeProcess(regions=[BIG])
        victims.append(victim)
        warm = [[0, 0, target.addr(1), 4096]]
        assert victim.call("transfer", op="read", target=target.session, items=warm)["rc"] == 0
        target.freeze()
        post(victim, "transfer", op="read", target=target.session, items=[[0, 0, target.addr(1), BIG]])
        time.sleep(0.3)  # the read requests now wait in the target's socket buffers
        victim.freeze()
        os.kill(target.pid, signal.SIGCONT)
        time.sleep(0.3)  # the target is now blocked sending to a reader that does not read
        assert server_connections(target) > with_bystander
        victim.kill()
        wait_for(lambda: server_connections(target) == with_bystander, 5.0, "connections of a killed reader freed")
        # The target still manages the region the dead reader was reading, and serves on.
        assert target.call("unregister", region=1)["rc"] == 0
        read_verified(eng, buf, target, offset=2 * MIB, length=4 * MIB)
        write_verified(eng, buf, target, offset=7, length=MIB)
        assert target.call("guards")["intact"]
    finally:
        for victim in victims:
            victim.kill()
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGCONT)
        target.close()


def test_unregister_under_read_and_write_traffic(initiator):
    """Writers fill the first half of a region with 0x77, readers read its random second half;
    the owner unregisters it mid-traffic.  Afterwards: every operation started later is refused,
    no byte lands, every read that succeeded returned the right bytes, the target lives on."""
    eng, buf = initiator
    size = 32 * MIB
    half, chunk = size // 2, 4 * MIB
    target = NodeProcess(regions=[size])
    try:
        name = target.session
        target.call("set", region=0, byte=0x00, offset=0, length=half)
        expected = target.call("fill", region=0, offset=half, length=half)["digest"]
        buf.fill(0x77, 0, half)
        ops: list[dict] = []
        lock = threading.Lock()
        stop = threading.Event()

        def record(kind: str, start: float, rc: int, good: bool = True) -> None:
            with lock:
                ops.append({"kind": kind, "start": start, "end": time.monotonic(), "rc": rc, "good": good})
            if rc != 0:
                time.sleep(0.01)  # refused at once from now on: do not spin

        def writer(i: int) -> None:
            while not stop.is_set():
                start = time.monotonic()
                local = [buf.addr + k * chunk for k in range(half // chunk)]
                remote = [target.addr(0, k * chunk) for k in range(half // chunk)]
                record("write", start, eng.batch_transfer_sync_write(name, local, remote, [chunk] * len(local)))

        def reader(i: int) -> None:
            dest = BIG + i * half
            while not stop.is_set():
                buf.fill(0x00, dest, half)
                start = time.monotonic()
                rc = eng.transfer_sync_read(name, buf.addr + dest, target.addr(0, half), half)
                record("read", start, rc, rc != 0 or buf.digest(dest, half) == expected)

        threads = [threading.Thread(target=fn, args=(i,), daemon=True)
                   for i, fn in enumerate([writer, writer, reader, reader])]
        for t in threads:
            t.start()
        wait_for(lambda: sum(1 for o in ops if o["rc"] == 0 and o["kind"] == "write") >= 2
                 and sum(1 for o in ops if o["rc"] == 0 and o["kind"] == "read") >= 2, 20.0, "traffic running")
        start = time.monotonic()
        assert target.call("unregister", region=0)["rc"] == 0
        unregistered = time.monotonic()
        assert unregistered - start < 1.0  # 200 ms grace, then it cuts the connections
        target.call("set", region=0, byte=0x00)  # the owner reuses its memory at once
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(TIMEOUT + SLACK + 5)
        assert not any(t.is_alive() for t in threads)

        later = [o for o in ops if o["start"] > unregistered]
        assert later and all(o["rc"] < 0 for o in later), [o for o in later if o["rc"] >= 0]
        assert all(o["good"] for o in ops), "a successful read returned wrong bytes"
        assert {o["kind"] for o in ops if o["rc"] == 0 and o["end"] < start} == {"read", "write"}
        assert target.call("count_byte", region=0, byte=0x77)["count"] == 0  # nothing landed after
        assert target.call("guards")["intact"]
        # The target keeps serving: a new region works for both directions.
        new = target.call("add_region", size=4 * MIB)
        digest = buf.fill_random(0, 4 * MIB)
        assert eng.transfer_sync_write(name, buf.addr, new["addr"], 4 * MIB) == 0
        assert target.call("digest", region=new["index"])["digest"] == digest
        buf.fill(0x00, 0, 4 * MIB)
        assert eng.transfer_sync_read(name, buf.addr, new["addr"], 4 * MIB) == 0
        assert buf.digest(0, 4 * MIB) == digest
    finally:
        target.close()
