"""Per-engine counters and per-peer latency histograms, and their Prometheus export."""

from __future__ import annotations

import logging

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc.engine.metrics import LATENCY_BUCKETS, export_prometheus


def test_counters_histograms_and_failure_logs(node, caplog):
    eng = TransferEngine(transfer_timeout=5.0)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = HostBuffer(1 << 20)
    try:
        assert eng.register_memory(buf.addr, buf.size) == 0
        for _ in range(3):
            assert eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 1 << 20) == 0
        assert eng.transfer_sync_read(node.session, buf.addr, node.addr(1), 4096) == 0
        with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
            assert eng.transfer_sync_write(node.session, buf.addr, node.addr(1) - 8, 64) == -3
        assert node.session in caplog.text  # every transfer failure names the session
        stats = eng.stats()
        peer = stats["peers"][node.session]
        assert (peer["bytes_written"], peer["bytes_read"], peer["transfers"], peer["failures"]) == (3 << 20, 4096, 5, 1)
        assert sum(peer["latency_buckets"].values()) == 5 and len(peer["latency_buckets"]) == len(LATENCY_BUCKETS) + 1
        assert stats["totals"]["transfers"] == 5 and stats["bytes_written_out"] >= 3 << 20  # core counter
        assert stats["session"] == eng.session_name

        prometheus_client = pytest.importorskip("prometheus_client")
        registry = prometheus_client.CollectorRegistry()
        export_prometheus(eng, registry)
        text = prometheus_client.generate_latest(registry).decode()
        labels = f'engine="{eng.session_name}",peer="{node.session}"'
        assert f"flagcx_mc_bytes_written_total{{{labels}}} 3.145728e+06" in text
        assert f'flagcx_mc_transfer_seconds_count{{engine="{eng.session_name}",peer="{node.session}"}} 5.0' in text
    finally:
        eng.close()
        buf.close()


async def test_async_engine_counts_too(engine, node, local_buf):
    await engine.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 4096)
    assert engine.stats()["peers"][node.session]["bytes_written"] == 4096


def test_core_latency_buckets_match_the_python_ones():
    from flagcx_mc._core import lib

    bounds = [lib.fmc_latency_bucket_bound_us(i) for i in range(lib.FMC_LATENCY_BUCKETS - 1)]
    assert lib.FMC_LATENCY_BUCKETS == len(LATENCY_BUCKETS) + 1
    assert bounds == [round(b * 1e6) for b in LATENCY_BUCKETS]
    assert lib.fmc_latency_bucket_bound_us(len(LATENCY_BUCKETS)) == 2**64 - 1  # +Inf


def test_counts_survive_a_reconnect_and_many_threads(node):
    """The core counts successful calls per peer name: a new session to the same name adds to the
    same totals, and concurrent callers lose no count."""
    import threading

    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = HostBuffer(1 << 16)
    try:
        assert eng.register_memory(buf.addr, buf.size) == 0
        assert eng.transfer_sync_write(node.session, buf.addr, node.addr(0), 100) == 0
        eng.get_conn(node.session).peer.close()  # the next call finds it unhealthy and reconnects

        def writer():
            for _ in range(200):
                assert eng.batch_transfer_sync_write(node.session, [buf.addr], [node.addr(0)], [10]) == 0

        threads = [threading.Thread(target=writer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        peer = eng.stats()["peers"][node.session]
        assert (peer["transfers"], peer["bytes_written"], peer["failures"]) == (801, 100 + 800 * 10, 0)
        assert sum(peer["latency_buckets"].values()) == 801 and peer["latency_sum_seconds"] > 0
    finally:
        eng.close()
        buf.close()
