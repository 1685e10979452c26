"""Per-engine counters and per-peer latency histograms, readable from Python and exportable to
Prometheus (``prometheus_client``, imported only when asked for).

A synchronous transfer call that succeeds is counted by the C core as it returns (per peer
name, in an ``fmc_call_stats`` struct this module owns), so the facades' fast path takes no
lock, clock or dictionary; calls that fail are counted here, by the facades, with a lock.
A call retried after a region-table refresh counts once.  The C core also keeps engine-wide
byte counters (the flat keys of ``stats()``), which see the traffic that peers drive into this
engine as well.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._core import ffi
from .._extras import install_hint

__all__ = ["EngineMetrics", "LATENCY_BUCKETS", "PeerStats", "export_prometheus"]

# Upper bounds in seconds, Prometheus style (the last bucket is +Inf).
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)


@dataclass
class PeerStats:
    """What one engine sent to / read from one peer session."""

    bytes_written: int = 0
    bytes_read: int = 0
    transfers: int = 0
    failures: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def as_dict(self) -> dict:
        return {
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "transfers": self.transfers,
            "failures": self.failures,
            "latency_sum_seconds": self.latency_sum,
            "latency_buckets": dict(zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.latency_buckets, strict=True)),
        }


class EngineMetrics:
    """Thread-safe counters of one engine (the sync facade calls in from many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, PeerStats] = {}
        self._core_counts: dict[str, Any] = {}  # peer name -> fmc_call_stats * (lives as long as this)

    def core_counts(self, peer: str) -> Any:
        """The struct the core counts ``peer``'s successful calls in; every session opened to that
        name gets the same one, so reconnects keep adding up."""
        with self._lock:
            counts = self._core_counts.get(peer)
            if counts is None:
                counts = self._core_counts[peer] = ffi.new("fmc_call_stats *")
            return counts

    def record(self, peer: str, is_write: bool, nbytes: int, seconds: float, ok: bool, calls: int = 1) -> None:
        """``calls`` transfer calls to ``peer`` of ``nbytes`` in all, each taking ``seconds``
        (several: the calls of one coalesced group, which end together)."""
        bucket = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            stats = self._peers.get(peer)
            if stats is None:
                stats = self._peers[peer] = PeerStats()
            stats.transfers += calls
            stats.latency_sum += seconds * calls
            stats.latency_buckets[bucket] += calls
            if not ok:
                stats.failures += calls
            elif is_write:
                stats.bytes_written += nbytes
            else:
                stats.bytes_read += nbytes

    @contextlib.contextmanager
    def failure_counted(self, peer: str, is_write: bool, nbytes: int) -> Iterator[None]:
        """Record a transfer call that raises (successful calls the core counts itself)."""
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.record(peer, is_write, nbytes, time.perf_counter() - started, False)
            raise

    def snapshot(self) -> dict:
        """Totals and per-peer figures as plain data."""
        with self._lock:
            merged = {name: _plus_core(s, self._core_counts.get(name)) for name, s in self._peers.items()}
            for name, counts in self._core_counts.items():
                if name not in merged and counts.calls:
                    merged[name] = _plus_core(PeerStats(), counts)
            peers = {name: s.as_dict() for name, s in merged.items()}
        totals = {key: sum(p[key] for p in peers.values())
                  for key in ("bytes_written", "bytes_read", "transfers", "failures")}
        return {"totals": totals, "peers": peers}


def _plus_core(stats: PeerStats, counts: Any) -> PeerStats:
    """``stats`` (failures, counted in Python) plus the core's successful calls, as a new object."""
    total = PeerStats(stats.bytes_written, stats.bytes_read, stats.transfers, stats.failures, stats.latency_sum,
                      list(stats.latency_buckets))
    if counts is not None:
        total.transfers += counts.calls
        total.bytes_written += counts.bytes_written
        total.bytes_read += counts.bytes_read
        total.latency_sum += counts.latency_us * 1e-6
        for i in range(len(total.latency_buckets)):
            total.latency_buckets[i] += counts.buckets[i]
    return total


def export_prometheus(engine, registry=None, prefix: str = "flagcx_mc"):
    """Register a collector for ``engine`` (either facade) with ``prometheus_client``.

    Raises ImportError naming the ``prometheus`` extra when prometheus_client is missing.
    """
    try:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.registry import REGISTRY
    except ImportError as exc:
        raise ImportError(f"export_prometheus {install_hint('prometheus', 'prometheus_client')}") from exc

    class _Collector:
        def collect(self):
            stats = engine.stats()
            name = stats.get("session", "")
            labels = ["engine", "peer"]
            counters = {key: CounterMetricFamily(f"{prefix}_{key}", f"flagcx_mc {key.replace('_', ' ')}", labels=labels)
                        for key in ("bytes_written", "bytes_read", "transfers", "failures")}
            hist = HistogramMetricFamily(f"{prefix}_transfer_seconds", "transfer call latency", labels=labels)
            for peer, p in stats["peers"].items():
                for key, family in counters.items():
                    family.add_metric([name, peer], p[key])
                cumulative, buckets = 0, []
                for bound, count in p["latency_buckets"].items():
                    cumulative += count
                    buckets.append((bound, cumulative))
                hist.add_metric([name, peer], buckets, p["latency_sum_seconds"])
            yield from counters.values()
            yield hist
            core = GaugeMetricFamily(f"{prefix}_core", "C core counters", labels=["engine", "counter"])
            for key, value in stats.items():
                if isinstance(value, int):
                    core.add_metric([name, key], value)
            yield core

    collector = _Collector()
    (registry or REGISTRY).register(collector)
    return collector
