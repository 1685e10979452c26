"""Physical limits for ``flagcx-mc bench``, measured in C without any engine in the way (the
module ``_limits_cffi``, built beside the core from ``_cffi_build/limits/fmc_limits.c``).

Each baseline moves ``total`` bytes in ``block``-sized pieces through buffers of ``span`` bytes
(the working set of one batch of the benchmarked workload) and returns GB/s (1e9 bytes/s):

- ``memcpy``: one thread copies each block;
- ``raw socket``: loopback TCP with the engine's number of streams, one sender and one receiver
  thread per stream, senders gathering blocks into ~1 MiB ``sendmsg`` calls;
- ``socket calls``: the same sockets used as synchronous calls: each batch's bytes split evenly
  over 1, 2, 4 ... up to that many connections, each share answered by its receiver, the next
  batch only after every answer, the best split kept (shares sent by client threads that poll
  for the call, so no wake-up on the calling side).  Shown beside ``raw socket``: what any engine
  that answers each call could reach, where the raw socket streams without answers;
- ``raw pvm``: ``process_vm_writev`` from this process into a forked child, 1024 blocks per call;
- ``cuda d2d``: device-to-device copies of each block (CUDA driver API, loaded at run time), each
  batch's copies queued on a stream and waited for before the next batch: the least time a
  synchronous call can take, which is what GPU transfers are held against;
- ``cuda d2d b2b``: the same copies back to back with one wait at the end (shown beside it: at
  one 64 MiB block per call even a bare C loop of copy-and-wait reaches only ~0.83 of it on an
  H200, the launch and completion latency not hidden behind the next copy);
- ``cuda d2h``, ``cuda h2d``: one copy of the whole span between the GPU and pinned host memory
  per batch, waited for: the PCIe link's rate, which every GPU byte moved over TCP crosses;
- ``staged socket``: the raw socket in pinned buffers while two more threads copy as many bytes
  between those buffers and the GPU (device to host and host to device, 512 KiB at a time,
  keeping pace with the receivers): the three legs of GPU memory over TCP running at once, as
  they do in a staged transfer on one host, where they share its memory.  Shown beside ``gpu
  tcp limit``, which measures each leg alone;
- ``gpu tcp limit``: not measured but derived, the smallest of ``raw socket`` (host memory over
  the same streams, same shape), ``cuda d2h`` and ``cuda h2d`` measured beside it: GPU memory
  over TCP can go no faster than the slowest leg it crosses.

The ratios of measured rows against these limits are made by ``report``.
"""

from __future__ import annotations

from ... import errors
from ...config import EngineConfig, usable_cpus
from ._limits_cffi import ffi, lib  # type: ignore[import-not-found]

__all__ = [
    "BASELINES",
    "LINK_BASELINES",
    "BaselineUnavailable",
    "also_against",
    "cuda_d2d_gbps",
    "cuda_host_gbps",
    "derived_from",
    "measure",
    "memcpy_gbps",
    "pvm_gbps",
    "tcp_calls_gbps",
    "tcp_gbps",
    "tcp_staged_gbps",
]

# Baseline names as they appear in tables and JSON ("vs <name>").
BASELINES = ("mooncake", "raw socket", "socket calls", "raw pvm", "memcpy", "cuda d2d", "cuda d2d b2b", "cuda d2h",
             "cuda h2d", "gpu tcp limit", "staged socket", "plain streams")

# Measured by the runner over a shaped link (plain_streams.py), not by this module.
LINK_BASELINES = ("plain streams",)

# Baselines computed from others measured in the same rounds: the smallest of them.
_DERIVED = {"gpu tcp limit": ("raw socket", "cuda d2h", "cuda h2d")}


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


def _tune_like_an_engine() -> None:
    """The raw socket's connections get the congestion control an engine made now would use."""
    lib.fmc_limits_set_local_cc(EngineConfig.from_env().local_cc.encode())


def tcp_gbps(streams: int, block: int, span: int, total: int) -> float:
    """Loopback TCP throughput over ``streams`` connections."""
    _tune_like_an_engine()
    gbps = ffi.new("double *")
    return _out(lib.fmc_baseline_tcp(streams, block, span, total, gbps), gbps, "raw socket baseline")


def tcp_calls_gbps(streams: int, block: int, span: int, total: int, cpus: int | None = None) -> float:
    """Loopback TCP used call by call: ``span`` bytes a call, answered, over the best split of up
    to ``streams`` connections (``socket calls``); splits sent by polling client threads only
    where they and the receivers fit ``cpus`` (default: the CPUs this process may run on)."""
    _tune_like_an_engine()
    gbps = ffi.new("double *")
    rc = lib.fmc_baseline_tcp_calls(streams, usable_cpus() if cpus is None else cpus, block, span, total, gbps)
    return _out(rc, gbps, "socket calls baseline")


def tcp_staged_gbps(streams: int, block: int, span: int, total: int, device: int = 0) -> float:
    """Loopback TCP throughput over ``streams`` connections with as many bytes copied between
    their pinned buffers and ``device`` beside them (``staged socket``)."""
    _tune_like_an_engine()
    gbps = ffi.new("double *")
    rc = lib.fmc_baseline_tcp_staged(streams, device, block, span, total, gbps)
    return _out(rc, gbps, "staged socket baseline")


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


def cuda_host_gbps(block: int, span: int, total: int, to_device: bool, device: int = 0) -> float:
    """Pinned host memory to the device (``to_device``) or back, one copy per ``span``."""
    gbps = ffi.new("double *")
    rc = lib.fmc_baseline_cuda_host(device, int(to_device), block, span, total, gbps)
    return _out(rc, gbps, "CUDA pinned copy baseline")


def derived_from(name: str) -> tuple[str, ...]:
    """The baselines ``name`` is the smallest of, or () for one that is measured itself."""
    return _DERIVED.get(name, ())


def measure(name: str, block: int, span: int, total: int, streams: int = 4, cuda_devices: tuple[int, int] = (0, 0)
            ) -> float:
    """Measure the baseline called ``name`` (one of ``BASELINES`` except ``mooncake``).

    Raises:
        BaselineUnavailable: not measurable here.  FlagcxMcError: the measurement failed.
    """
    if name == "memcpy":
        return memcpy_gbps(block, span, total)
    if name == "raw socket":
        return tcp_gbps(streams, block, span, total)
    if name == "socket calls":
        return tcp_calls_gbps(streams, block, span, total)
    if name == "staged socket":
        return tcp_staged_gbps(streams, block, span, total, cuda_devices[0])
    if name == "raw pvm":
        return pvm_gbps(block, span, total)
    if name == "cuda d2d":
        return cuda_d2d_gbps(block, span, total, *cuda_devices)
    if name == "cuda d2d b2b":
        return cuda_d2d_gbps(block, span, total, *cuda_devices, wait_each_batch=False)
    if name in ("cuda d2h", "cuda h2d"):
        return cuda_host_gbps(block, span, total, to_device=name == "cuda h2d", device=cuda_devices[0])
    raise ValueError(f"no C baseline called {name!r}")


# Limits measured and shown beside a transport's own.
_ALSO_AGAINST = {"raw socket": ("socket calls",), "raw pvm": ("memcpy",), "cuda d2d": ("cuda d2d b2b",),
                 "gpu tcp limit": (*_DERIVED["gpu tcp limit"], "staged socket")}


def also_against(limit: str) -> tuple[str, ...]:
    """The baselines measured and shown beside ``limit``."""
    return _ALSO_AGAINST.get(limit, ())
