"""The initiator side's shared I/O pool: many peers, few threads.

Every engine of a process runs the send and receive sides of its outbound connections on one
pool of threads (``fmc_stream.c`` on ``fmc_worker_pool.c``): a connection takes a thread only
while it has bytes to send or answers to read.  These tests count the initiating process's
threads and fds in /proc while it writes to dozens or hundreds of peers (engines in other
processes, real sockets), verify every byte, run 256 peers inside a cgroup whose ``pids.max``
is the budget, and check that a peer stalled in the middle of an answer holds one thread, not
the other peers' turn.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.tools.bench.peers import measure_peers

MIB = 1 << 20


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def thread_budget(idle: int) -> int:
    """What the issue allows a process with N peers: its idle threads + 2 x CPUs + 8."""
    return idle + 2 * cpus() + 8


@pytest.mark.timeout(240)
def test_writing_to_64_peers_takes_a_bounded_pool_of_threads_and_fds():
    """One engine writes 256 KiB to each of 64 engines (two helper processes), all in flight at
    once: every range is verified, and the writer's threads and fds stay within the budget."""
    row = measure_peers("flagcx_mc", "out", 64, 256 << 10, trials=1)
    assert row["error"] is None, row["error"]
    assert row["verified"], row
    assert row["threads"] <= thread_budget(row["idle_threads"]), row
    assert row["fds"] <= row["idle_fds"] + 4 * 64, row


def _pids_cgroup_root() -> Path | None:
    """Where a pids cgroup can be made: the v2 root with the pids controller, or v1's pids
    hierarchy."""
    unified = Path("/sys/fs/cgroup")
    if "pids" in (unified / "cgroup.controllers").read_text().split() if (unified / "cgroup.controllers").exists() \
            else False:
        return unified
    v1 = unified / "pids"
    return v1 if (v1 / "cgroup.procs").exists() else None


class PidsCgroup:
    """A cgroup of its own with ``pids.max`` set, into which a process is moved."""

    def __init__(self) -> None:
        root = _pids_cgroup_root()
        if root is None:
            pytest.skip("no pids cgroup controller on this machine")
        self.path = root / f"flagcx-mc-test-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot make a cgroup here: {exc}")

    def confine(self, pid: int, limit: int) -> None:
        (self.path / "pids.max").write_text(str(limit))
        (self.path / "cgroup.procs").write_text(str(pid))

    def events_max(self) -> int:
        """How many forks (threads) the limit refused (0 where the kernel does not count them)."""
        events = self.path / "pids.events"
        if not events.exists():
            return 0
        fields = dict(line.split() for line in events.read_text().splitlines() if line.strip())
        return int(fields.get("max", 0))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its process is still exiting


@pytest.mark.timeout(600)
@pytest.mark.parametrize("direction", ["out", "in"])
def test_256_peers_inside_a_pids_cgroup_of_the_budget(direction):
    """The measured process, moved into a cgroup whose pids.max is its idle threads + 2 x CPUs + 8,
    exchanges 64 KiB with each of 256 peers: every range verified, no thread refused."""
    if os.geteuid() != 0:
        pytest.skip("moving a process into a cgroup needs root")
    group = PidsCgroup()
    limits: list[int] = []

    def confine(pid: int, idle: dict) -> None:
        limits.append(thread_budget(idle["threads"]))
        group.confine(pid, limits[-1])

    try:
        row = measure_peers("flagcx_mc", direction, 256, 64 << 10, trials=1, on_idle=confine)
        assert limits, "the measured process was never confined"
        assert row["error"] is None, row["error"]
        assert row["verified"], row
        assert row["threads"] <= limits[0], row
        assert group.events_max() == 0, f"the cgroup refused {group.events_max()} threads"
    finally:
        group.remove()


@pytest.mark.timeout(120)
def test_a_peer_stalled_mid_answer_does_not_hold_up_the_others(tmp_path):
    """With FLAGCX_MC_IO_THREADS=1, a read from a peer that is stopped (SIGSTOP) while its
    answer is on the way holds the one thread in the middle of the payload; reads and writes
    to another peer still complete, verified, and the stalled read finishes once the peer goes
    on."""
    script = r"""
STALLED_BYTES = 512 << 20
import os, sys, threading, time
from flagcx_mc import HostBuffer, TransferEngine
import orjson
stalled, other = orjson.loads(sys.argv[1])
eng = TransferEngine(transport="tcp", streams_per_peer=1)
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
big, small = HostBuffer(STALLED_BYTES), HostBuffer(4 << 20)
assert eng.register_memory(big.addr, big.size) == 0 and eng.register_memory(small.addr, small.size) == 0
result = {}
def stalled_read():
    result["read"] = eng.transfer_sync_read(stalled["session"], big.addr, stalled["addr"], big.size)
t = threading.Thread(target=stalled_read); t.start()
print("started", flush=True)
sys.stdin.readline()  # the peer is stopped now, its answer half sent
t0 = time.monotonic()
digest = small.fill_random()
ok = eng.transfer_sync_write(other["session"], small.addr, other["addr"], small.size) == 0
small.fill(0)
ok = ok and eng.transfer_sync_read(other["session"], small.addr, other["addr"], small.size) == 0
print(orjson.dumps({"other_ok": ok, "other_digest": small.digest(0, small.size) == digest,
                    "other_s": time.monotonic() - t0, "stalled_done": "read" in result}).decode(), flush=True)
sys.stdin.readline()  # the peer goes on
t.join(60)
print(orjson.dumps({"read": result.get("read"), "digest": big.digest(0, big.size)}).decode(), flush=True)
os._exit(0)  # skip the interpreter's teardown: under tests/asan, CPython's own leaks set the exit code
"""
    import json
    import subprocess
    import sys

    stalled = NodeProcess(regions=[512 * MIB])
    other = NodeProcess(regions=[4 * MIB])
    proc = None
    try:
        want = stalled.call("fill", region=0)["digest"]
        args = json.dumps([{"session": stalled.session, "addr": stalled.addr(0)},
                           {"session": other.session, "addr": other.addr(0)}])
        env = dict(os.environ, FLAGCX_MC_IO_THREADS="1")
        # Run outside the source tree: the installed package (with its compiled core) is imported.
        proc = subprocess.Popen([sys.executable, "-c", script, args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env, cwd=tmp_path)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.02)  # the read's answer is flowing (512 MiB take 0.1 s or more on loopback)
        os.kill(stalled.pid, signal.SIGSTOP)
        proc.stdin.write("\n")
        proc.stdin.flush()
        first = json.loads(proc.stdout.readline())
        assert first["other_ok"] and first["other_digest"], first
        assert first["other_s"] < 5.0, first
        assert not first["stalled_done"], "the read finished although its peer was stopped"
        os.kill(stalled.pid, signal.SIGCONT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        last = json.loads(proc.stdout.readline())
        assert last["read"] == 0 and last["digest"] == want, last
        assert proc.wait(30) == 0
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        os.kill(stalled.pid, signal.SIGCONT)
        stalled.close()
        other.close()


@pytest.mark.timeout(120)
def test_the_pool_shrinks_back_to_its_core_after_a_burst_of_peers():
    """Writes to 16 peers at once, verified, grow the I/O pool within its cap (plus the threads
    waiting on a peer); 2 s after the burst its extra workers have ended and it is back to its
    2 core threads."""
    peers = [NodeProcess(regions=[MIB]) for _ in range(16)]
    eng = TransferEngine(transport="tcp", streams_per_peer=2)
    buf = HostBuffer(MIB)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        digest = buf.fill_random()
        batches = [eng.batch_transfer_async_write(p.session, [buf.addr], [p.addr(0)], [MIB]) for p in peers]
        assert all(batches)
        assert all(eng.get_batch_transfer_status([b]) == 0 for b in batches)
        for p in peers:
            assert p.call("digest", region=0, offset=0, length=MIB)["digest"] == digest
        stats = eng.stats()
        # Threads inside a blocking send or read (fmc_pool_blocking_begin) do not count against
        # the cap, and one more may start meanwhile: at most one per stream (2 per peer here).
        assert 1 <= stats["io_threads"] <= stats["io_threads_cap"] + 2 * len(peers), stats
        deadline = time.monotonic() + 5.0
        while eng.stats()["io_threads"] > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.stats()["io_threads"] <= 2, eng.stats()
    finally:
        eng.close()
        buf.close()
        for p in peers:
            p.close()


def _two_cpus() -> list[str]:
    """A taskset prefix that gives a child process two of our CPUs: a small host's pool caps."""
    return ["taskset", "-c", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])]


@pytest.mark.timeout(120)
def test_a_small_hosts_pools_hold_a_worker_per_side_of_one_peer_and_shrink_for_more():
    """On 2 CPUs (children pinned to two) the I/O pool's cap is 8 while the process has one
    peer's four streams, and so is the serve pool's while it serves one initiator's four
    connections, so each side of each stream can keep a worker between calls (with 2 x CPUs, 4,
    they handed the streams on through the set on every call).  Once a process has more than that
    its cap is 2 x CPUs again, and the workers over it leave at once, not after the 2 s that idle
    ones take.  Every write is verified."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    small = _two_cpus()
    targets = [NodeProcess(regions=[4 * MIB], config={"transport": "tcp"}, argv_prefix=small) for _ in range(3)]
    writers = [NodeProcess(regions=[4 * MIB], config={"transport": "tcp", "streams_per_peer": 4}, argv_prefix=small)
               for _ in range(2)]
    try:
        def write(w: NodeProcess, t: NodeProcess) -> None:
            digest = w.call("fill", region=0)["digest"]
            items = [[0, off, t.addr(0, off), 64 << 10] for off in range(0, 4 * MIB, 64 << 10)]
            for _ in range(20):
                assert w.call("transfer", op="write", target=t.session, items=items)["rc"] == 0
            assert t.call("digest", region=0)["digest"] == digest

        def shrinks_to_cap(p: NodeProcess, key: str) -> dict:
            deadline = time.monotonic() + 1.2
            while p.call("stats")[key] > 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            return p.call("stats")

        write(writers[0], targets[0])
        one_peer, one_initiator = writers[0].call("stats"), targets[0].call("stats")
        assert one_peer["io_threads_cap"] == 8, one_peer
        assert one_initiator["serve_threads_cap"] == 8, one_initiator
        write(writers[0], targets[1])
        write(writers[0], targets[2])
        write(writers[1], targets[0])
        assert writers[0].call("stats")["io_threads_cap"] == 4
        assert targets[0].call("stats")["serve_threads_cap"] == 4
        stats = shrinks_to_cap(writers[0], "io_threads")
        assert stats["io_threads"] <= 4, stats
        stats = shrinks_to_cap(targets[0], "serve_threads")
        assert stats["serve_threads"] <= 4, stats
    finally:
        for p in writers + targets:
            p.close()


@pytest.mark.timeout(180)
def test_sends_waiting_on_stopped_peers_hold_at_most_eight_threads_beyond_the_cap():
    """64 MiB writes to 12 peers, four streams each, and the peers stopped (SIGSTOP) while the
    payloads are on the way: each stream's send side waits in its splice outside the pool's cap,
    but the pool starts at most 8 threads beyond the cap for them, not one per stream.  Once the
    peers go on, every write completes and every byte lands."""
    size = 64 * MIB
    peers = [NodeProcess(regions=[size]) for _ in range(12)]
    eng = TransferEngine(transport="tcp", streams_per_peer=4)
    buf = HostBuffer(size)
    stopped = False
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        digest = buf.fill_random()
        quarter = size // 4
        srcs = [buf.addr + i * quarter for i in range(4)]
        for p in peers:  # sessions open, and their four streams connected
            assert eng.batch_transfer_sync_write(p.session, srcs[:1], [p.addr(0)], [4 * MIB]) == 0
        for p in peers:
            os.kill(p.pid, signal.SIGSTOP)
        stopped = True
        batches = [eng.batch_transfer_async_write(p.session, srcs, [p.addr(0, i * quarter) for i in range(4)],
                                                  [quarter] * 4) for p in peers]
        assert all(batches)
        time.sleep(1.0)  # every send side has filled its sockets and waits
        stats = eng.stats()
        assert stats["io_threads"] <= stats["io_threads_cap"] + 8, stats
        for p in peers:
            os.kill(p.pid, signal.SIGCONT)
        stopped = False
        assert all(eng.get_batch_transfer_status([b]) == 0 for b in batches)
        for p in peers:
            assert p.call("digest", region=0)["digest"] == digest
    finally:
        if stopped:
            for p in peers:
                os.kill(p.pid, signal.SIGCONT)
        eng.close()
        buf.close()
        for p in peers:
            p.close()


@pytest.mark.timeout(180)
def test_payloads_that_keep_moving_count_against_the_cap(tmp_path):
    """With FLAGCX_MC_IO_THREADS=2, 64 MiB writes (spliced by the send sides) and reads (payloads
    received by the receive sides) to 4 running peers, four streams each, all in flight at once:
    only a send or receive that waits out its socket's 50 ms tick with no byte moved leaves the
    cap, so the pool holds about its cap of threads while the bytes move (not one per busy stream
    side up to the cap + 8), and every byte lands."""
    script = r"""
import os, sys, threading, time
import orjson
from flagcx_mc import HostBuffer, TransferEngine
peers = orjson.loads(sys.argv[1])
size = 64 << 20
eng = TransferEngine(transport="tcp", streams_per_peer=4)
buf = HostBuffer(size)
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert eng.register_memory(buf.addr, buf.size) == 0
digest = buf.fill_random()
quarter = size // 4
srcs = [buf.addr + i * quarter for i in range(4)]
for p in peers:  # sessions open, and their four streams connected
    assert eng.batch_transfer_sync_write(p["session"], srcs[:1], [p["addr"]], [4 << 20]) == 0
peak = {}
stop = threading.Event()
def watch(op):
    while not stop.is_set():
        peak[op] = max(peak.get(op, 0), eng.stats()["io_threads"])
        time.sleep(0.001)
ok = True
for op in ("write", "read"):
    stop.clear()
    t = threading.Thread(target=watch, args=(op,))
    t.start()
    start = eng.batch_transfer_async_write if op == "write" else eng.batch_transfer_async_read
    for _ in range(3):
        batches = [start(p["session"], srcs, [p["addr"] + i * quarter for i in range(4)], [quarter] * 4) for p in peers]
        ok = ok and all(b and eng.get_batch_transfer_status([b]) == 0 for b in batches)
    stop.set()
    t.join()
print(orjson.dumps({"ok": ok, "peak": peak, "cap": eng.stats()["io_threads_cap"], "digest": digest,
                    "read_back": buf.digest(0, size) == digest}).decode(), flush=True)
os._exit(0)  # skip the interpreter's teardown: under tests/asan, CPython's own leaks set the exit code
"""
    import json
    import subprocess
    import sys

    peers = [NodeProcess(regions=[64 * MIB]) for _ in range(4)]
    try:
        args = json.dumps([{"session": p.session, "addr": p.addr(0)} for p in peers])
        env = dict(os.environ, FLAGCX_MC_IO_THREADS="2")
        # Run outside the source tree: the installed package (with its compiled core) is imported.
        out = subprocess.run([sys.executable, "-c", script, args], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=150)
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["ok"] and result["read_back"], result
        assert result["cap"] == 2, result
        # Before, every spliced send and every answer's payload left the cap: 9-10 threads here.
        for op, threads in result["peak"].items():
            assert threads <= result["cap"] + 3, (op, result)
        for p in peers:
            assert p.call("digest", region=0)["digest"] == result["digest"]
    finally:
        for p in peers:
            p.close()
