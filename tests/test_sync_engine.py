"""The Mooncake drop-in: exact signatures, int returns, logged reasons, many threads at once."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.servers import free_port

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.config import EngineConfig, mooncake_transfer_timeout


def _started_engine(protocol, **config):
    """An initialized sync engine with 16 MiB registered; closed after the test."""
    eng = TransferEngine(transfer_timeout=10.0, **config)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    buf = HostBuffer(16 << 20)
    assert eng.register_memory(buf.addr, buf.size) == 0
    yield eng, buf
    eng.close()
    buf.close()


@pytest.fixture
def sync_engine():
    yield from _started_engine("rdma")


def test_signatures_match_mooncake():
    def params(name):
        return list(inspect.signature(getattr(TransferEngine, name)).parameters.values())[1:]

    init = params("initialize")
    assert [p.name for p in init] == ["local_hostname", "metadata_server", "protocol", "device_name"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in init)
    bw = params("batch_transfer_sync_write")
    assert [p.name for p in bw] == ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint"]
    assert bw[-1].default == ""
    assert [p.name for p in params("register_memory")] == ["buffer_addr", "capacity", "location"]
    assert [p.name for p in params("transfer_sync_read")] == [
        "target_hostname", "buffer", "peer_buffer_address", "length", "transport_hint"]
    assert params("unregister_memory")[0].kind is inspect.Parameter.POSITIONAL_ONLY
    assert params("batch_unregister_memory")[0].kind is inspect.Parameter.POSITIONAL_ONLY


def test_calls_before_initialize_return_minus_one():
    eng = TransferEngine()
    assert eng.register_memory(0x1000, 16) == -1
    assert eng.batch_transfer_sync_write("127.0.0.1:1", [1], [1], [1]) == -1
    assert eng.get_rpc_port() == -1


def test_initialize_rules(caplog):
    eng = TransferEngine()
    nobody = free_port()
    with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
        assert eng.initialize("127.0.0.1", f"etcd://127.0.0.1:{nobody}", "tcp", "") == -1
    assert f"cannot connect to metadata server etcd://127.0.0.1:{nobody}" in caplog.text
    assert eng.initialize("127.0.0.1:9999", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        port = eng.get_rpc_port()
        assert 15000 <= port <= 17000 and port != 9999  # Mooncake: the given port is ignored
        assert eng.session_name == f"127.0.0.1:{port}"
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    finally:
        eng.close()


def test_rpc_port_range_env(monkeypatch):
    monkeypatch.setenv("MC_MIN_RPC_PORT", "16100")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "16120")
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert 16100 <= eng.get_rpc_port() <= 16120
    finally:
        eng.close()


def test_registration_codes(sync_engine, caplog):
    eng, buf = sync_engine
    with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
        assert eng.register_memory(buf.addr, 4096) == -7  # overlaps the fixture's region
        assert eng.register_memory(buf.addr + buf.size, 0) == -1
        assert eng.unregister_memory(buf.addr + 64) == -3
        assert eng.register_memory(8, 4096) == -1  # not mapped: an error, not a crash
    assert "overlaps" in caplog.text and "not mapped" in caplog.text
    other = HostBuffer(3 * 4096)
    try:
        # All or none: the second region overlaps the first, so neither stays registered.
        assert eng.batch_register_memory([other.addr, other.addr + 4096], [8192, 4096]) == -7
        assert eng.register_memory(other.addr, 4096) == 0
        assert eng.batch_unregister_memory([other.addr]) == 0
        assert eng.batch_unregister_memory([other.addr]) == -3
    finally:
        other.close()


def test_ten_threads_write_concurrently(sync_engine, node):
    eng, buf = sync_engine
    threads, blocks, block = 10, 32, 16 << 10
    buf.fill_random(0, threads * blocks * block)

    def worker(t):
        base = t * blocks * block
        local = [buf.addr + base + i * block for i in range(blocks)]
        remote = [node.addr(0, base + i * block) for i in range(blocks)]
        return [eng.batch_transfer_sync_write(node.session, local, remote, [block] * blocks) for _ in range(5)]

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(worker, range(threads)))
    assert results == [[0] * 5] * threads
    total = threads * blocks * block
    assert node.call("digest", region=0, offset=0, length=total)["digest"] == buf.digest(0, total)


def test_sync_read_and_empty_and_mismatched(sync_engine, node, caplog):
    eng, buf = sync_engine
    digest = node.call("fill", region=1)["digest"]
    size = node.regions[1][1]
    assert eng.transfer_sync_read(node.session, buf.addr, node.addr(1), size) == 0
    assert buf.digest(0, size) == digest
    assert eng.batch_transfer_sync_write(node.session, [], [], []) == 0
    with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
        assert eng.batch_transfer_sync_write(node.session, [buf.addr], [node.addr(1)], [4, 4]) == -1
        assert eng.batch_transfer_sync_write(node.session, [buf.addr], [node.addr(1) - 8], [16]) == -3
    assert "differ in length" in caplog.text and "not inside one region" in caplog.text


def test_gil_is_released_while_transferring(sync_engine, node):
    eng, buf = sync_engine
    counts = {"n": 0}
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counts["n"] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        start = time.perf_counter()
        rounds = 0
        while time.perf_counter() - start < 0.5:
            assert eng.transfer_sync_write(node.session, buf.addr, node.addr(0), 16 << 20) == 0
            rounds += 1
        before = counts["n"]
        time.sleep(0)
        assert eng.transfer_sync_write(node.session, buf.addr, node.addr(0), 16 << 20) == 0
        progressed = counts["n"] - before
    finally:
        stop.set()
        t.join()
    # A transfer that held the GIL for its whole duration would freeze the counter.
    assert progressed > 1000, progressed


def test_mooncake_transfer_timeout_env(monkeypatch):
    monkeypatch.delenv("FLAGCX_MC_TRANSFER_TIMEOUT", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2")
    assert mooncake_transfer_timeout() == 5.0  # Mooncake's floor
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "45")
    config = EngineConfig.from_env()
    assert config.transfer_timeout == 45.0
    assert config.timeout_for(2 * 10**9) == pytest.approx(47.0)  # plus 1 s per GB, as Mooncake
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT")
    assert EngineConfig.from_env().transfer_timeout == 30.0
    monkeypatch.setenv("FLAGCX_MC_TRANSFER_TIMEOUT", "0.5")
    assert EngineConfig.from_env().transfer_timeout == 0.5


def test_self_transfer_uses_own_session(sync_engine):
    eng, buf = sync_engine
    digest = buf.fill_random(0, 1 << 20)
    assert eng.transfer_sync_write(eng.session_name, buf.addr, buf.addr + (4 << 20), 1 << 20) == 0
    assert hashlib.sha256(buf.read(4 << 20, 1 << 20)).hexdigest() == digest


@pytest.fixture
def tcp_engine():
    yield from _started_engine("tcp", transport="tcp")


def test_small_sync_writes_from_many_threads_beside_big_reads(tcp_engine, node):
    """Small sync writes read their own answers off the socket; other callers' batches share the
    streams meanwhile (their answers arrive behind ours), and every byte must still land."""
    eng, buf = tcp_engine
    threads, calls, block = 6, 150, 4096
    buf.fill_random(0, threads * calls * block)
    read_base, read_len = 8 << 20, 4 << 20
    digest = node.call("fill", region=0, offset=64 << 20, length=read_len)["digest"]
    stop = threading.Event()

    def writer(t):
        rcs = []
        for i in range(calls):
            off = (t * calls + i) * block
            rcs.append(eng.transfer_sync_write(node.session, buf.addr + off, node.addr(0, off), block))
        return rcs

    def reader():
        rounds = 0
        while not stop.is_set() or rounds == 0:
            blocks = [(i * 64 << 10) for i in range(read_len // (64 << 10))]
            rc = eng.batch_transfer_sync_read(node.session, [buf.addr + read_base + o for o in blocks],
                                              [node.addr(0, (64 << 20) + o) for o in blocks], [64 << 10] * len(blocks))
            assert rc == 0
            assert buf.digest(read_base, read_len) == digest
            buf.fill(0, read_base, read_len)
            rounds += 1
        return rounds

    with ThreadPoolExecutor(threads + 1) as pool:
        reads = pool.submit(reader)
        results = list(pool.map(writer, range(threads)))
        stop.set()
        assert reads.result(timeout=60) >= 1
    assert results == [[0] * calls] * threads
    total = threads * calls * block
    assert node.call("digest", region=0, offset=0, length=total)["digest"] == buf.digest(0, total)


def test_bulk_sync_reads_from_many_threads_each_get_their_own_bytes(tcp_engine, node):
    """A bulk read's caller receives one stream's share itself; callers reading at once share
    the streams (one may find another's answers ahead of its own), and each must get exactly
    the bytes it asked for."""
    eng, buf = tcp_engine
    threads, rounds, span, block = 4, 12, 2 << 20, 64 << 10
    digests = [node.call("fill", region=0, offset=t * span, length=span)["digest"] for t in range(threads)]

    def reader(t):
        local_base = (8 << 20) + t * span
        blocks = list(range(0, span, block))
        random.Random(t).shuffle(blocks)  # the blocks land at other offsets than they came from
        for _ in range(rounds):
            buf.fill(0, local_base, span)
            local = [buf.addr + local_base + i * block for i in range(len(blocks))]
            remote = [node.addr(0, t * span + o) for o in blocks]
            rc = eng.batch_transfer_sync_read(node.session, local, remote, [block] * len(blocks))
            assert rc == 0
            got = b"".join(buf.read(local_base + blocks.index(o) * block, block) for o in range(0, span, block))
            assert hashlib.sha256(got).hexdigest() == digests[t]
        return t

    with ThreadPoolExecutor(threads) as pool:
        assert sorted(pool.map(reader, range(threads))) == list(range(threads))


def test_small_sync_write_whose_answer_comes_late(tcp_engine, node):
    """An answer later than the caller's polling window is taken by the stream's receiver thread."""
    eng, buf = tcp_engine
    buf.fill_random(0, 1 << 20)
    assert eng.transfer_sync_write(node.session, buf.addr, node.addr(0), 4096) == 0  # connected
    for i in range(3):
        node.freeze()
        threading.Timer(0.05, os.kill, (node.pid, signal.SIGCONT)).start()
        start = time.monotonic()
        off = (i + 1) * 4096
        assert eng.transfer_sync_write(node.session, buf.addr + off, node.addr(0, off), 4096) == 0
        assert time.monotonic() - start >= 0.04
    assert node.call("digest", region=0, offset=0, length=4 * 4096)["digest"] == buf.digest(0, 4 * 4096)
    # And the next calls (the receive side handed back and forth) still run and land.
    for i in range(50):
        off = (i + 4) * 4096
        assert eng.transfer_sync_write(node.session, buf.addr + off, node.addr(0, off), 4096) == 0
    assert node.call("digest", region=0, offset=0, length=54 * 4096)["digest"] == buf.digest(0, 54 * 4096)


def test_stale_region_table_is_refreshed_behind_the_fast_path(tcp_engine):
    """The first try of a call goes straight to the core with the cached region table; memory the
    peer registered later is found after one refresh, and memory it unregistered fails with -3
    once the refreshed table says so.  Each call counts once."""
    eng, buf = tcp_engine
    target = NodeProcess(regions=[1 << 20])
    try:
        digest = buf.fill_random(0, 1 << 20)
        assert eng.transfer_sync_write(target.session, buf.addr, target.addr(0), 4096) == 0  # table cached
        later = target.call("add_region", size=1 << 20)
        assert eng.batch_transfer_sync_write(target.session, [buf.addr], [later["addr"]], [1 << 20]) == 0
        assert target.call("digest", region=later["index"], offset=0, length=1 << 20)["digest"] == digest
        assert target.call("unregister", region=later["index"])["rc"] == 0
        assert eng.transfer_sync_read(target.session, buf.addr, later["addr"], 4096) == -3
        peer = eng.stats()["peers"][target.session]
        counts = (peer["transfers"], peer["failures"], peer["bytes_written"], peer["bytes_read"])
        assert counts == (3, 1, 4096 + (1 << 20), 0)
    finally:
        target.close()


@pytest.mark.parametrize("cpus,streams", [(1, 4), (2, 4), (9, 4), (10, 5), (16, 8), (96, 8)])
def test_default_streams_follow_the_cpus_this_process_may_use(monkeypatch, cpus, streams):
    from flagcx_mc import config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.delenv("FLAGCX_MC_STREAMS", raising=False)
    assert config.default_streams() == streams
    assert config.EngineConfig.from_env().streams_per_peer == streams
    monkeypatch.setenv("FLAGCX_MC_STREAMS", "3")
    assert config.EngineConfig.from_env().streams_per_peer == 3
