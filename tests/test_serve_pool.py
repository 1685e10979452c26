"""The target side's shared serve pool: many inbound connections, few threads.

A target process serves every inbound data connection from one pool of threads
(``fmc_server.c`` on ``fmc_worker_pool.c``): a connection takes a thread only while it has a request to serve, and
the pool grows to at most ``FLAGCX_MC_SERVE_THREADS`` (default twice the CPUs, at least 4). These
tests count the target process's threads in /proc while dozens of initiators' connections write
into it, verify every byte, and check that initiators stalled in the middle of a write's payload
hold no thread (their writes are parked) and finish once they go on.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._core import CoreEngine
from flagcx_mc._testing.node import NodeProcess

MIB = 1 << 20
INITIATORS = 16  # engines in this process, 4 streams each: 64 connections into one target
STREAMS = 4


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def write_from_many(target: NodeProcess, block: int = MIB) -> None:
    """INITIATORS engines each write ``block`` random bytes to their own range of the target,
    verified by digest; every engine stays open until all have written (their connections with
    it)."""
    engines: list[TransferEngine] = []
    bufs: list[HostBuffer] = []
    try:
        for _ in range(INITIATORS):
            eng = TransferEngine(transport="tcp", streams_per_peer=STREAMS)
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            buf = HostBuffer(block)
            assert eng.register_memory(buf.addr, block) == 0
            engines.append(eng)
            bufs.append(buf)
        for k, (eng, buf) in enumerate(zip(engines, bufs, strict=True)):
            digest = buf.fill_random()
            # 4 slices of a quarter each: every stream of the engine carries one
            lengths = [block // STREAMS] * STREAMS
            assert eng.batch_transfer_sync_write(target.session, [buf.addr + i * lengths[0] for i in range(STREAMS)],
                                                 [target.addr(0, k * block + i * lengths[0]) for i in range(STREAMS)],
                                                 lengths) == 0
            assert target.call("digest", region=0, offset=k * block, length=block)["digest"] == digest
        assert target.call("stats")["server_connections"] >= INITIATORS * 2
    finally:
        for eng in engines:
            eng.close()
        for buf in bufs:
            buf.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", [None, 3])
def test_dozens_of_inbound_connections_take_a_bounded_pool_of_threads(cap):
    """64 connections of 16 initiators write into one target process: every byte lands, and the
    target's threads grow by at most the pool's cap (default, or FLAGCX_MC_SERVE_THREADS=3)."""
    env = {} if cap is None else {"FLAGCX_MC_SERVE_THREADS": str(cap)}
    target = NodeProcess(regions=[INITIATORS * MIB], env=env)
    try:
        time.sleep(0.5)
        base = threads_of(target.pid)
        allowed = cap if cap is not None else max(4, 2 * len(os.sched_getaffinity(target.pid)))
        write_from_many(target)
        grown = threads_of(target.pid) - base
        assert grown <= allowed, f"the target grew by {grown} threads for {INITIATORS * STREAMS} connections"
    finally:
        target.close()


STALLED = 8


def _answer(sock: socket.socket) -> tuple[int, int, int, int]:
    data = b""
    while len(data) < 24:
        more = sock.recv(24 - len(data))
        assert more, "the connection closed instead of answering"
        data += more
    return struct.unpack("<QiIQ", data)


@pytest.mark.timeout(60)
def test_initiators_stalled_mid_payload_hold_no_thread_and_finish_when_they_go_on():
    """Eight initiators each send half of a 256 KiB write's payload and stop.  Their writes are
    parked, not waited for by a thread: a ninth initiator's write is answered meanwhile, the
    pool holds no more threads than its cap, and when the eight send the rest, each write is
    answered and every byte is where it belongs."""
    core = CoreEngine("127.0.0.1")
    size = 256 * 1024
    buf = HostBuffer((STALLED + 1) * size)
    socks: list[socket.socket] = []
    try:
        buf.fill(0)
        key = core.register(buf.addr, buf.size)
        hello = b"FMCNATV1" + struct.pack("<II", 1, 0)
        payloads = [os.urandom(size) for _ in range(STALLED + 1)]
        for k in range(STALLED):
            s = socket.create_connection(("127.0.0.1", core.data_port), timeout=10)
            s.sendall(hello + struct.pack("<BBHIQQQ", 1, 0, 0, key, 100 + k, buf.addr + k * size, size)
                      + payloads[k][:size // 2])
            assert s.recv(16)[:8] == b"FMCNATOK"
            socks.append(s)
        time.sleep(0.3)  # every worker that took one has parked it by now
        with socket.create_connection(("127.0.0.1", core.data_port), timeout=10) as s:
            start = time.monotonic()
            s.sendall(hello + struct.pack("<BBHIQQQ", 1, 0, 0, key, 7, buf.addr + STALLED * size, size)
                      + payloads[STALLED])
            assert s.recv(16)[:8] == b"FMCNATOK"
            assert _answer(s) == (7, 0, 0, 0)
            assert time.monotonic() - start < 2.0
        assert buf.read(STALLED * size, size) == payloads[STALLED]
        stats = core.stats()
        assert 1 <= stats["serve_threads"] <= stats["serve_threads_cap"], stats
        for k, s in enumerate(socks):
            s.sendall(payloads[k][size // 2:])
        for k, s in enumerate(socks):
            assert _answer(s) == (100 + k, 0, 0, 0)
            assert buf.read(k * size, size) == payloads[k], f"write {k} landed wrong bytes"
    finally:
        for s in socks:
            s.close()
        core.close()
        buf.close()


# What every child script below starts with: the native framing's preamble and requests
# (fmc_wire.h), and one answer read off a socket (None if the connection ended first).
_CHILD_WIRE = r"""
import os, socket, struct, time
import orjson
def hello(flags=0):
    return b"FMCNATV1" + struct.pack("<II", 1, flags)
def request(opcode, key, req_id, addr, length):
    return struct.pack("<BBHIQQQ", opcode, 0, 0, key, req_id, addr, length)
def answer(s):
    data = b""
    while len(data) < 24 and (more := s.recv(24 - len(data))):
        data += more
    return list(struct.unpack("<QiIQ", data)) if len(data) == 24 else None
"""


_STOPS_READING = r"""
from flagcx_mc import HostBuffer
from flagcx_mc._core import CoreEngine
stalled, big, small = 8, 64 << 20, 4096
core = CoreEngine("127.0.0.1")
buf = HostBuffer(stalled * big + small)
buf.fill(0)
key = core.register(buf.addr, buf.size)
socks = []
for k in range(stalled):  # each asks for 64 MiB and never reads a byte of the answer
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    s.settimeout(20)
    s.connect(("127.0.0.1", core.data_port))
    s.sendall(hello() + request(2, key, 100 + k, buf.addr + k * big, big))
    socks.append(s)
time.sleep(0.5)  # every answer's send has filled its socket by now
payload = os.urandom(small)
out = {}
with socket.create_connection(("127.0.0.1", core.data_port), timeout=20) as s:
    start = time.monotonic()
    s.sendall(hello() + request(1, key, 7, buf.addr + stalled * big, small) + payload)
    out["preamble"] = s.recv(16)[:8].decode(errors="replace")
    out["answer"] = answer(s)
    out["seconds"] = time.monotonic() - start
out["landed"] = buf.read(stalled * big, small) == payload
stats = core.stats()
out["served"], out["cap"] = stats["requests_served"], stats["serve_threads_cap"]
print(orjson.dumps(out).decode(), flush=True)
os._exit(0)  # the stalled sockets and the engine go with the process
"""


def _child_result(script: str, tmp_path, threads: int, **env_extra: str) -> dict:
    """Run ``script`` (after _CHILD_WIRE) in a process whose serve pool is capped at ``threads`` (the cap is a
    process setting, read at import), with ``env_extra`` in its environment, and return the JSON
    it prints."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, FLAGCX_MC_SERVE_THREADS=str(threads), **env_extra)
    # Run outside the source tree: the installed package (with its compiled core) is imported.
    out = subprocess.run([sys.executable, "-c", _CHILD_WIRE + script], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.timeout(90)
def test_initiators_that_stop_reading_their_answers_hold_no_turn_of_the_others(tmp_path):
    """In a target whose pool is capped at 2 threads (FLAGCX_MC_SERVE_THREADS=2), eight
    connections each ask to read 64 MiB and never read the answer, so every answer's send blocks
    in a worker.  A ninth connection's write is answered within a second all the same and its
    bytes land: a blocked send costs its connection a thread, not the others their turn."""
    result = _child_result(_STOPS_READING, tmp_path, threads=2)
    assert result["cap"] == 2, result
    assert result["preamble"] == "FMCNATOK" and result["answer"] == [7, 0, 0, 0], result
    assert result["seconds"] < 1.0, result
    assert result["landed"], result
    assert result["served"] >= 9, result  # every stalled read was taken up


_FENCES = r"""
from flagcx_mc._core import CoreEngine
core = CoreEngine("127.0.0.1")
def connect():
    s = socket.create_connection(("127.0.0.1", core.data_port), timeout=20)
    s.sendall(hello())
    assert s.recv(16)[:8] == b"FMCNATOK"
    return s
old = connect()
old.sendall(request(6, 0, 0, 0xABCDEF, 0))  # NAME: this connection's token
time.sleep(0.3)  # the named connection is idle, back in the pool's set
new = connect()
start = time.monotonic()
new.sendall(request(7, 0, 5, 0xABCDEF, 0))  # FENCE: cut the named one
out = {"answer": answer(new), "seconds": time.monotonic() - start, "old_closed": old.recv(1) == b""}
print(orjson.dumps(out).decode(), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(90)
def test_a_fence_is_answered_at_once_by_a_pool_of_one_thread(tmp_path):
    """A reconnecting initiator's fence (cut the connection it named before, answer once that
    connection has stopped touching memory) waits for a worker to take the old connection's
    shutdown.  In a pool of one thread (FLAGCX_MC_SERVE_THREADS=1) the fencing worker is that
    thread: its wait must not count against the cap, or the fence times out after 10 s."""
    result = _child_result(_FENCES, tmp_path, threads=1)
    assert result["answer"] == [5, 0, 0, 0], result
    assert result["seconds"] < 1.0, result
    assert result["old_closed"], result


_VECTORS_STALL = r"""
from flagcx_mc import HostBuffer
from flagcx_mc._core import CoreEngine
stalled, n, entry = 8, 4, 64 << 10
size = n * entry
core = CoreEngine("127.0.0.1")
buf = HostBuffer((stalled + 1) * size)
buf.fill(0)
key = core.register(buf.addr, buf.size)
payloads = [os.urandom(size) for _ in range(stalled + 1)]
socks = []
for k in range(stalled):  # a vector write of 4 x 64 KiB, half of its payloads, then nothing
    s = socket.create_connection(("127.0.0.1", core.data_port), timeout=20)
    s.sendall(hello(2))  # 2: this initiator sends vectors
    assert s.recv(16)[:8] == b"FMCNATOK"
    table = b"".join(struct.pack("<IIQQ", key, 0, buf.addr + k * size + i * entry, entry) for i in range(n))
    s.sendall(request(3, n, 100 + k, 0, size) + table + payloads[k][:size // 2])
    socks.append(s)
time.sleep(0.5)  # every worker that took one is waiting for the rest by now
out = {}
with socket.create_connection(("127.0.0.1", core.data_port), timeout=20) as s:
    start = time.monotonic()
    s.sendall(hello() + request(1, key, 7, buf.addr + stalled * size, size) + payloads[stalled])
    out["preamble"] = s.recv(16)[:8].decode(errors="replace")
    out["answer"] = answer(s)
    out["seconds"] = time.monotonic() - start
out["landed"] = buf.read(stalled * size, size) == payloads[stalled]
for k, s in enumerate(socks):
    s.sendall(payloads[k][size // 2:])
out["stalled_answers"] = [answer(s) for s in socks]
out["stalled_landed"] = [buf.read(k * size, size) == payloads[k] for k in range(stalled)]
print(orjson.dumps(out).decode(), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(90)
def test_initiators_stalled_mid_vector_hold_no_turn_and_finish_when_they_go_on(tmp_path):
    """Eight connections of a target whose pool is capped at 2 threads each send half of a vector
    write's payloads (4 x 64 KiB) and stop; a vector is not parked, so its worker waits for the
    rest.  A ninth connection's write is answered within a second all the same, and when the
    eight send the rest, each vector is answered and every byte is where it belongs."""
    result = _child_result(_VECTORS_STALL, tmp_path, threads=2)
    assert result["preamble"] == "FMCNATOK" and result["answer"] == [7, 0, 0, 0], result
    assert result["seconds"] < 1.0, result
    assert result["landed"], result
    assert result["stalled_answers"] == [[100 + k, 0, 0, 0] for k in range(8)], result
    assert all(result["stalled_landed"]), result


_GPU_CHUNKS_HELD = r"""
from flagcx_mc import HostBuffer
from flagcx_mc._core import CoreEngine
from flagcx_mc.buffers import DeviceBuffer
from flagcx_mc.config import EngineConfig
stalled, big, small = 4, 4 << 20, 4096
core = CoreEngine("127.0.0.1", config=EngineConfig(gpu_staging=4 << 20))  # 4 receive chunks of 512 KiB
gpu = DeviceBuffer((stalled + 1) * big, 0)
gpu.fill(0)
host = HostBuffer(small)
host.fill(0)
gkey, hkey = core.register(gpu.addr, gpu.size), core.register(host.addr, host.size)
payloads = [os.urandom(big) for _ in range(stalled)]
socks = []
for k in range(stalled):  # 4 MiB writes into GPU memory, 256 KiB of each, then nothing: each holds a chunk
    s = socket.create_connection(("127.0.0.1", core.data_port), timeout=20)
    s.sendall(hello() + request(1, gkey, 100 + k, gpu.addr + k * big, big) + payloads[k][:256 << 10])
    assert s.recv(16)[:8] == b"FMCNATOK"
    socks.append(s)
time.sleep(0.3)
waiting = socket.create_connection(("127.0.0.1", core.data_port), timeout=20)  # finds no chunk free
gpu_small = os.urandom(small)
waiting.sendall(hello() + request(1, gkey, 50, gpu.addr + stalled * big, small) + gpu_small)
assert waiting.recv(16)[:8] == b"FMCNATOK"
time.sleep(0.3)
payload, out = os.urandom(small), {}
with socket.create_connection(("127.0.0.1", core.data_port), timeout=20) as s:
    start = time.monotonic()
    s.sendall(hello() + request(1, hkey, 7, host.addr, small) + payload)
    out["preamble"] = s.recv(16)[:8].decode(errors="replace")
    out["answer"] = answer(s)
    out["seconds"] = time.monotonic() - start
out["landed"] = host.read(0, small) == payload
for k, s in enumerate(socks):
    s.sendall(payloads[k][256 << 10:])
out["stalled_answers"] = [answer(s) for s in socks]
out["waiting_answer"] = answer(waiting)
out["gpu_landed"] = [gpu.read(k * big, big) == payloads[k] for k in range(stalled)]
out["gpu_landed"].append(gpu.read(stalled * big, small) == gpu_small)
print(orjson.dumps(out).decode(), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(90)
def test_a_write_waiting_for_a_staging_chunk_holds_no_turn(tmp_path, fake_driver):
    """On the fake CUDA driver: four writes into GPU memory stopped mid-payload hold all four of
    a target's receive staging chunks, and a fifth GPU write waits for one.  In a pool of one
    thread a host write is answered within a second all the same; once the four send the rest,
    every write is answered and every byte is in GPU memory."""
    result = _child_result(_GPU_CHUNKS_HELD, tmp_path, threads=1, FLAGCX_MC_LIBCUDA=fake_driver,
                           FAKE_CUDA_UUIDS="00112233445566778899aabbccddeef0")
    assert result["preamble"] == "FMCNATOK" and result["answer"] == [7, 0, 0, 0], result
    assert result["seconds"] < 1.0, result
    assert result["landed"], result
    assert result["stalled_answers"] == [[100 + k, 0, 0, 0] for k in range(4)], result
    assert result["waiting_answer"] == [50, 0, 0, 0], result
    assert all(result["gpu_landed"]), result
