"""Physical limits for ``flagcx-mc bench``, measured in C without any engine in the way (the
module ``_limits_cffi``, built beside the core from ``_cffi_build/limits/fmc_limits.c``).

Each baseline moves ``total`` bytes in ``block``-sized pieces through buffers of ``span`` bytes
(the working set of one batch of the benchmarked workload) and returns GB/s (1e9 bytes/s):

- ``memcpy``: one thread copies each block;
- ``raw socket``: loopback TCP with the engine's number of streams, one sender and one receiver
  thread per stream, senders gathering blocks into ~1 MiB ``sendmsg`` calls;
- ``raw pvm``: ``process_vm_writev`` from this process into a forked child, 1024 blocks per call;
- ``cuda d2d``: device-to-device copies of each block (CUDA driver API, loaded at run time), each
  batch's copies queued on a stream and waited for before the next batch: the least time a
  synchronous call can take, which is what GPU transfers are held against;
- ``cuda d2d b2b``: the same copies back to back with one wait at the end (shown beside it: at
  one 64 MiB block per call even a bare C loop of copy-and-wait reaches only ~0.83 of it on an
  H200, the launch and completion latency no longer hidden behind the next copy).

At the end: the ratios of measured rows against these limits and against Mooncake, and the
issue's targets.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Tuple

from ... import errors
from ..._units import fmt_size
from ._limits_cffi import ffi, lib

__all__ = [
    "BASELINES",
    "BaselineUnavailable",
    "measure",
    "memcpy_gbps",
    "tcp_gbps",
    "pvm_gbps",
    "cuda_d2d_gbps",
    "add_ratios",
    "throughput_rows",
    "evaluate_targets",
]

# Baseline names as they appear in tables and JSON ("vs <name>").
BASELINES = ("mooncake", "raw socket", "raw pvm", "memcpy", "cuda d2d", "cuda d2d b2b")


class BaselineUnavailable(RuntimeError):
    """This machine or build cannot measure that baseline (no CUDA driver, no permission)."""


def last_error() -> str:
    """The message of the last failing measurement in this thread."""
    return ffi.string(lib.fmc_last_error()).decode(errors="replace")


def _out(rc: int, value, what: str) -> float:
    if rc == errors.NotSupportedError.code:
        raise BaselineUnavailable(f"{what}: {last_error()}")
    if rc < 0:
        raise errors.error_for_code(rc, f"{what}: {last_error()}")
    return float(value[0])


def memcpy_gbps(block: int, span: int, total: int) -> float:
    """memcpy throughput of ``block``-sized copies through ``span`` bytes."""
    gbps = ffi.new("double *")
    return _out(lib.fmc_baseline_memcpy(block, span, total, gbps), gbps, "memcpy baseline")


def tcp_gbps(streams: int, block: int, span: int, total: int) -> float:
    """Loopback TCP throughput over ``streams`` connections."""
    gbps = ffi.new("double *")
    return _out(lib.fmc_baseline_tcp(streams, block, span, total, gbps), gbps, "raw socket baseline")


def pvm_gbps(block: int, span: int, total: int) -> float:
    """``process_vm_writev`` throughput into a child process."""
    gbps = ffi.new("double *")
    return _out(lib.fmc_baseline_pvm(block, span, total, gbps), gbps, "process_vm_writev baseline")


def cuda_d2d_gbps(block: int, span: int, total: int, src_device: int = 0, dst_device: int = 0,
                  wait_each_batch: bool = True) -> float:
    """Device-to-device copy throughput (peer copy when the devices differ), waiting for each
    ``span`` (batch) of copies, or only at the end."""
    gbps = ffi.new("double *")
    rc = lib.fmc_baseline_cuda_d2d(src_device, dst_device, block, span, total, int(wait_each_batch), gbps)
    return _out(rc, gbps, "CUDA device-to-device baseline")


def measure(name: str, block: int, span: int, total: int, streams: int = 4, cuda_devices: Tuple[int, int] = (0, 0)
            ) -> float:
    """Measure the baseline called ``name`` (one of ``BASELINES`` except ``mooncake``).

    Raises:
        BaselineUnavailable: not measurable here.  FlagcxMcError: the measurement failed.
    """
    if name == "memcpy":
        return memcpy_gbps(block, span, total)
    if name == "raw socket":
        return tcp_gbps(streams, block, span, total)
    if name == "raw pvm":
        return pvm_gbps(block, span, total)
    if name == "cuda d2d":
        return cuda_d2d_gbps(block, span, total, *cuda_devices)
    if name == "cuda d2d b2b":
        return cuda_d2d_gbps(block, span, total, *cuda_devices, wait_each_batch=False)
    raise ValueError(f"no C baseline called {name!r}")


# ---------------------------------------------------------------------------------- ratios and targets


# Limits shown beside a transport's own (ratios only; the targets use the transport's limit).
_ALSO_AGAINST = {"raw pvm": ("memcpy",), "cuda d2d": ("cuda d2d b2b",)}


def also_against(limit: str) -> Tuple[str, ...]:
    """The baselines measured and shown beside ``limit``."""
    return _ALSO_AGAINST.get(limit, ())


def add_ratios(rows: list, baselines: list, limit_of: Dict[str, str]) -> None:
    """Fill each row's ``ratios`` (throughput / baseline) and ``cpu_vs_mooncake``.

    ``limit_of`` maps a transport name to the physical limit it is held against.  A row is held
    against the limit measured beside it (same op pass), else against any measurement of that
    shape (results written before limits were measured per op).
    """
    base, trials = {}, {}
    for b in baselines:
        base.setdefault((b["name"], b["block"], b["count"]), b["gbps"])
        base[(b["name"], b["block"], b["count"], b.get("op"))] = b["gbps"]
        trials[(b["name"], b["block"], b["count"], b.get("op"))] = b.get("trials_gbps")

    def limit_for(name: str, r: dict) -> Optional[float]:
        return base.get((name, r["block"], r["count"], r["op"]), base.get((name, r["block"], r["count"])))

    def median_ratio(mine: Optional[list], theirs: Optional[list]) -> Optional[float]:
        """The same ratio between median trials: shows whether one fast or slow trial decided it."""
        if not mine or not theirs or not statistics.median(theirs):
            return None
        return statistics.median(mine) / statistics.median(theirs)

    mooncake = {(r["op"], r["block"], r["count"]): r for r in rows if r["engine"] == "mooncake" and r["verified"]}
    for r in rows:
        if not r["verified"]:
            continue
        own = limit_of[r["transport"]]
        medians = r.setdefault("median_ratios", {})
        for name in (own, *also_against(own)):
            limit = limit_for(name, r)
            if limit:
                r["ratios"][name] = r["gbps"] / limit
                medians[name] = median_ratio(r.get("trials_gbps"), trials.get((name, r["block"], r["count"], r["op"])))
        mc = mooncake.get((r["op"], r["block"], r["count"]))
        if mc is not None and r["engine"] != "mooncake":
            r["ratios"]["mooncake"] = r["gbps"] / mc["gbps"] if mc["gbps"] else None
            medians["mooncake"] = median_ratio(r.get("trials_gbps"), mc.get("trials_gbps"))
            if r["cpu_s_per_gib"] is not None and mc["cpu_s_per_gib"]:
                r["cpu_vs_mooncake"] = r["cpu_s_per_gib"] / mc["cpu_s_per_gib"]


def throughput_rows(rows: list, transport: str) -> list:
    """Verified rows of one transport at the largest batch of each block size (the throughput workload)."""
    mine = [r for r in rows if r["transport"] == transport and r["verified"]]
    largest = {}
    for r in mine:
        largest[r["block"]] = max(largest.get(r["block"], 0), r["count"])
    return [r for r in mine if r["count"] == largest[r["block"]]]


# Steal share of CPU time at which a shape's ratios say more about the host than the engine.
STEAL_WORTH_NAMING = 0.05


def _target(name: str, rows: list, value_of, threshold: float, better: str, na: str, ratio: str = "") -> dict:
    """Worst value over ``rows`` against ``threshold`` (``better``: 'higher' or 'lower').  For a
    throughput ``ratio``, the worst row's ratio between median trials comes along (information
    only: the verdict compares each side's fastest trial)."""
    values = [(value_of(r), r) for r in rows if value_of(r) is not None]
    if not values:
        return {"name": name, "status": "N/A", "measured": None, "threshold": threshold, "detail": na}
    worst, row = (min if better == "higher" else max)(values, key=lambda v: v[0])
    ok = worst >= threshold if better == "higher" else worst <= threshold
    detail = f"worst: {row['op']} {fmt_size(row['block'])} x{row['count']}" if "op" in row else ""
    median = row.get("median_ratios", {}).get(ratio) if ratio else None
    if median is not None:
        detail += f"; median trials {median:.2f}"
    if (row.get("steal") or 0) >= STEAL_WORTH_NAMING:
        detail += f"; hypervisor steal {row['steal']:.0%} during that shape"
    return {"name": name, "status": "PASS" if ok else "MISS", "measured": worst, "threshold": threshold,
            "detail": detail, "measured_median": median}


def evaluate_targets(rows: list, latencies: list, transports: Dict[str, dict]) -> List[dict]:
    """The issue's targets, each PASS, MISS or N/A with the measured (worst) ratio."""
    def why(name: str, baseline: str) -> str:
        info = transports.get(name, {})
        if not info.get("available"):
            return f"{name}: {info.get('reason', 'not run')}"
        return f"no {baseline} measurement"

    tcp = throughput_rows(rows, "tcp")
    lat = {x["transport"]: x for x in latencies if x["verified"]}
    lat_ratio = []
    if "tcp" in lat and "mooncake-tcp" in lat:
        lat_ratio = [{"value": lat["tcp"]["p50_us"] / lat["mooncake-tcp"]["p50_us"]}]
    def throughput(name: str, rows: list, key: str, threshold: float, na: str) -> dict:
        return _target(name, rows, lambda r: r["ratios"].get(key), threshold, "higher", na, ratio=key)

    return [
        throughput("native TCP >= 2x Mooncake at every block size", tcp, "mooncake", 2.0,
                   why("mooncake-tcp", "Mooncake")),
        throughput("native TCP >= 85% of the raw socket (same streams)", tcp, "raw socket", 0.85,
                   why("tcp", "raw socket")),
        _target("one 4 KiB sync write: p50 <= 0.7x Mooncake", lat_ratio, lambda r: r["value"], 0.7, "lower",
                why("mooncake-tcp", "latency")),
        _target("initiator CPU s/GiB <= 0.5x Mooncake", tcp, lambda r: r.get("cpu_vs_mooncake"), 0.5, "lower",
                why("mooncake-tcp", "Mooncake")),
        throughput("same host, shared buffers >= 80% of memcpy", throughput_rows(rows, "same-host-shm"), "memcpy",
                   0.8, why("same-host-shm", "memcpy")),
        throughput("same host, registered memory >= 90% of raw process_vm_writev", throughput_rows(rows, "same-host"),
                   "raw pvm", 0.9, why("same-host", "raw pvm")),
        throughput("GPU -> GPU on one host >= 90% of a device-to-device copy", throughput_rows(rows, "gpu"),
                   "cuda d2d", 0.9, why("gpu", "cuda d2d")),
    ]
