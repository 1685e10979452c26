"""``flagcx-mc bench``: throughput, latency and CPU cost of every transport against physical limits.

For each transport (a row of ``TRANSPORTS``) a target and an initiator run in processes of their
own; the initiator runs timed loops of sync batch transfers for each (block size, batch size)
shape and each op, and reports wall time and its own CPU time.  Mooncake's engine (PyPI wheel,
``MC_FORCE_TCP=1``) is measured the same way on the same workload.  The limits module measures the
physical limits (memcpy, raw loopback socket, raw ``process_vm_writev``, CUDA device-to-device
copy) on the same shapes, in rounds with the engines' timed loops of that shape and op (limits,
then each engine, once per trial; each side reports its best), so that a ratio compares
measurements taken in the same seconds (on a shared machine the raw socket alone varied by 1.5x
over one run).  Every row is verified by sha256 of the whole range after its timed loop; an
unverified row makes the exit code 1.

Output (made by ``report``): one progress line per measurement on stderr; on stdout the tables
(ratios as ``vs <baseline>`` columns) and, given a targets file (``targets``), one PASS/MISS/N/A
line per target, a missed one making the exit code 1; a JSON file (schema ``flagcx_mc.bench/1``)
and, where matplotlib is installed, a PNG of throughput vs block size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from ..._extras import install_hint
from ..._process import EngineProcessError
from ..._units import fmt_size
from ...config import EngineConfig, host_congestion_control, local_congestion_control
from . import limits as bl
from . import link as shaped
from .incast import measure_incast
from .layouts import cache_bytes
from .plain_streams import PlainStreams
from .report import add_ratios, draw_png, print_report, verdict, write_json
from .targets import TargetSet, evaluate_targets
from .worker import WorkerProcess

__all__ = ["TRANSPORTS", "BenchOptions", "Transport", "run_bench"]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_BLOCKS = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
DEFAULT_BATCHES = [1, 32, 1024]
QUICK_BLOCKS = [4 * KiB, 64 * KiB, 1 * MiB]
QUICK_BATCHES = [64]
PAGED_BLOCKS = [16 * KiB, 32 * KiB, 64 * KiB]
PAGED_COUNT = 1024   # blocks per call in the paged layout: 16 from each of 32 layers' K and V
MAX_BATCH_BYTES = 64 * MiB   # a batch is capped to this many bytes (64 MiB x 1, 1 MiB x 64, ...)
SCHEMA = "flagcx_mc.bench/1"

# The engine setting that picks a transport.  A build whose EngineConfig has no such field has
# native TCP only; the other transports are then reported as not available in this build.
TRANSPORT_SETTING = "transport"


@dataclasses.dataclass(frozen=True)
class Transport:
    name: str
    engine: str          # "flagcx_mc" or "mooncake"
    memory: str          # worker.MEMORY_KINDS: host, managed (shared), cuda
    selector: str        # value of TRANSPORT_SETTING; "" for Mooncake
    limit: str           # the physical limit it is held against (limits.BASELINES)
    summary: str
    layout: str = "contiguous"   # layouts.LAYOUTS: where a batch's blocks sit on each side
    callers: int = 1             # initiator threads calling at once, each with its share of the blocks
    target_memory: str = ""      # the target's memory when it differs from the initiator's


TRANSPORTS: tuple[Transport, ...] = (
    Transport("tcp", "flagcx_mc", "host", "tcp", "raw socket", "native TCP, host memory"),
    Transport("same-host", "flagcx_mc", "host", "same-host", "raw pvm", "same host, any registered memory"),
    Transport("same-host-shm", "flagcx_mc", "managed", "same-host", "memcpy", "same host, shared buffers"),
    Transport("gpu", "flagcx_mc", "cuda", "same-host", "cuda d2d", "GPU to GPU on one host"),
    Transport("gpu-tcp", "flagcx_mc", "cuda", "tcp", "gpu tcp limit", "GPU to GPU over native TCP"),
    Transport("gpu-tcp-paged", "flagcx_mc", "cuda", "tcp", "gpu tcp limit",
              "GPU to GPU over native TCP, paged KV cache (random block ids, K and V per layer)", layout="paged"),
    Transport("gpu-tcp-paged-10", "flagcx_mc", "cuda", "tcp", "gpu tcp limit",
              "the same from 10 calling threads at once", layout="paged", callers=10),
    Transport("gpu-host-tcp-paged", "flagcx_mc", "cuda", "tcp", "gpu tcp limit",
              "GPU to host memory (write) and host to GPU (read) over native TCP, paged KV cache",
              layout="paged", target_memory="host"),
    Transport("mooncake-tcp", "mooncake", "host", "", "raw socket", "Mooncake TCP transport (PyPI wheel)"),
    Transport("mooncake-gpu-tcp", "mooncake", "cuda", "", "gpu tcp limit",
              "Mooncake TCP transport, GPU memory (its CUDA wheel)"),
    Transport("mooncake-gpu-tcp-paged", "mooncake", "cuda", "", "gpu tcp limit",
              "Mooncake TCP transport, GPU memory, paged KV cache (its CUDA wheel)", layout="paged"),
)

# Transports whose engines come from another build (``--compare-build PATH``), named after the
# one they repeat with a ``-build`` suffix: the same workload in the same run, so a change is
# measured against what it changed.  ``tcp-build`` is the one added when no transport is named.
COMPARED_BUILD = "tcp-build"
_REBUILT = ("tcp", "gpu-tcp", "gpu-tcp-paged", "gpu-tcp-paged-10", "gpu-host-tcp-paged")
TRANSPORTS += tuple(dataclasses.replace(t, name=f"{t.name}-build", summary=f"{t.summary}, from another build of "
                                        "flagcx_mc (--compare-build)") for t in TRANSPORTS if t.name in _REBUILT)
COMPARED_BUILDS = frozenset(f"{name}-build" for name in _REBUILT)


@dataclasses.dataclass
class BenchOptions:
    blocks: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_BLOCKS))
    batches: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_BATCHES))
    paged_blocks: list[int] = dataclasses.field(default_factory=lambda: list(PAGED_BLOCKS))
    paged_count: int = PAGED_COUNT
    ops: list[str] = dataclasses.field(default_factory=lambda: ["write", "read"])
    transports: list[str] = dataclasses.field(default_factory=lambda: [t.name for t in TRANSPORTS
                                                                       if t.name not in COMPARED_BUILDS])
    streams: int = dataclasses.field(default_factory=lambda: EngineConfig.from_env().streams_per_peer)
    repeat: int | None = None        # timed batches per trial; None: enough for target_bytes
    target_bytes: int = 256 * MiB       # bytes per trial when repeat is None
    trials: int = 5                     # timed loops per row; the row reports the fastest
    steal_retries: int = 2              # passes more for a shape that ran with steal_retry_at or more
    steal_retry_at: float = 0.10        # hypervisor steal share of CPU time
    max_repeat: int = 1000
    latency_n: int = 2000
    mooncake: bool = True
    json_path: str | None = "bench-results/bench.json"
    png_path: str | None = "bench-results/bench.png"
    verbose: bool = False
    quick: bool = False
    targets: TargetSet | None = None  # checked against the result (targets.load_targets)
    targets_path: str | None = None   # where they came from, for the JSON
    compare_build: str | None = None    # a flagcx_mc tree built in place: its rows run beside (COMPARED_BUILDS)
    link: shaped.LinkSpec | None = None  # run the TCP rows across two namespaces over this link
    plain_streams: int = 4              # connections of the plain streams limit over a link
    incast: int = 0                     # over a link: this many initiators writing to one target at once

    @classmethod
    def quick_options(cls, **overrides) -> BenchOptions:
        values: dict = {"blocks": list(QUICK_BLOCKS), "batches": list(QUICK_BATCHES), "target_bytes": 32 * MiB,
                        "latency_n": 1000, "quick": True}
        values.update(overrides)
        return cls(**values)


# Over a shaped link: the TCP rows only, 64 KiB and 1 MiB blocks in 64 MiB calls by default (512
# MiB a trial, so that a trial's figure takes in the stalls a lossy link brings, not one lucky
# call), held against plain TCP streams on the same link.
LINK_TRANSPORTS = ("tcp", COMPARED_BUILD, "mooncake-tcp")
LINK_BLOCKS = [64 * KiB, 1 * MiB]
LINK_BATCHES = [1024]


def link_options(spec: shaped.LinkSpec, **overrides) -> BenchOptions:
    """Options of a run over a shaped link (``flagcx-mc bench --link SPEC``)."""
    values: dict = {"blocks": list(LINK_BLOCKS), "batches": list(LINK_BATCHES), "trials": 3, "latency_n": 0,
                    "target_bytes": 512 * MiB, "transports": [t for t in LINK_TRANSPORTS if t != COMPARED_BUILD],
                    "link": spec}
    values.update(overrides)
    return BenchOptions(**values)


class _Net:
    """A run's shaped link: both namespaces, the plain streams limit's server, the counters."""

    def __init__(self, spec: shaped.LinkSpec, plain_streams: int) -> None:
        self.link = shaped.ShapedLink()
        try:
            self.link.shape(spec)
            initiator_prefix, target_prefix = self.link.prefixes
            self.plain = PlainStreams(target_prefix, initiator_prefix, self.link.target_addr, plain_streams)
        except BaseException:
            self.link.close()
            raise

    def close(self) -> None:
        self.plain.close()
        self.link.close()


def _run_incast(running: list[Transport], opts: BenchOptions, net: _Net, progress: _Progress,
                log: IO[str] | None) -> list[dict]:
    """``opts.incast`` initiators of each engine that ran (flagcx_mc's tcp, Mooncake's) writing at
    once to one target over the link, in calls of the sweep's largest block (``incast.py``)."""
    block = max(opts.blocks)
    count = max(1, min(max(opts.batches), MAX_BATCH_BYTES // block))
    span = block * count
    reps = opts.repeat or max(2, opts.target_bytes // (opts.incast * span))
    rows = []
    for t in (t for t in running if t.name in LINK_TRANSPORTS):
        config = _engine_config(t, opts.streams) if t.engine == "flagcx_mc" else None
        env, launcher = _launch(t, opts)
        with stderr_to(log):
            row = measure_incast(t.engine, opts.incast, block, count, reps, opts.trials, net.link, config, env,
                                 launcher)
        row["transport"] = t.name
        rows.append(row)
        status = "verified" if row["verified"] else f"NOT VERIFIED: {row['error']}"
        progress.note(f"incast {t.name:<12} {opts.incast} initiators x {fmt_size(block)} x{count}: "
                      f"{row['gbps']:.2f} GB/s together, {row['single_gbps']:.2f} alone  {status}")
    return rows


def shapes_of(opts: BenchOptions) -> list[tuple[int, int]]:
    """(block, count) pairs of the sweep: every block with every batch size, capped at MAX_BATCH_BYTES."""
    shapes = {(b, min(n, max(1, MAX_BATCH_BYTES // b))) for b in opts.blocks for n in opts.batches}
    return sorted(shapes)


def shapes_for(t: Transport, opts: BenchOptions) -> list[tuple[int, int]]:
    """The shapes a transport runs: the sweep's, or the paged ones (``paged_blocks`` x ``paged_count``)."""
    if t.layout == "paged":
        return sorted({(b, opts.paged_count) for b in opts.paged_blocks})
    return shapes_of(opts)


def reps_of(opts: BenchOptions, span: int) -> int:
    if opts.repeat is not None:
        return opts.repeat
    return max(2, min(opts.max_repeat, opts.target_bytes // span))


# ---------------------------------------------------------------------------------- availability


def _engine_config(t: Transport, streams: int) -> dict:
    from ...config import EngineConfig

    config: dict = {"streams_per_peer": streams}
    if TRANSPORT_SETTING in {f.name for f in dataclasses.fields(EngineConfig)}:
        config[TRANSPORT_SETTING] = t.selector
    elif t.selector != "tcp":
        raise LookupError(f"not available in this build (the engine has no {TRANSPORT_SETTING!r} setting)")
    return config


def mooncake_has_cuda() -> bool:
    """Whether the importable ``mooncake.engine`` is a CUDA build: only those move GPU memory over
    TCP (a host-only build fails on GPU addresses).  Read from its linked libraries, without
    importing it here."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in Path(folder).glob("engine*.so"):
            with contextlib.suppress(OSError):
                if b"libcudart.so" in lib.read_bytes():
                    return True
    return False


def compared_build_problem(path: str | None) -> str | None:
    """Why ``path`` cannot serve the ``-build`` transports' engines, or None."""
    if not path:
        return "needs --compare-build PATH (a flagcx_mc source tree built in place)"
    package = Path(path) / "flagcx_mc"
    if not (package / "tools" / "bench" / "worker.py").is_file():
        return f"{path} holds no flagcx_mc source tree with the bench's worker"
    if not list(package.glob("_fmc_cffi*.so")):
        return f"{path} is not built in place (cd {path} && python setup.py build_ext --inplace)"
    return None


def availability(t: Transport, opts: BenchOptions) -> tuple[bool, str]:
    """Whether this build and machine can run the transport, and why not."""
    if t.name in COMPARED_BUILDS:
        problem = compared_build_problem(opts.compare_build)
        if problem:
            return False, f"not available ({problem})"
    if t.engine == "mooncake":
        if not opts.mooncake:
            return False, "skipped (--no-mooncake)"
        if importlib.util.find_spec("mooncake") is None:
            hint = install_hint("bench", "mooncake")
            return False, f"mooncake.engine cannot be imported (Mooncake's engine, x86_64 only, {hint})"
        if t.memory != "cuda":
            return True, ""
    if t.memory == "cuda":
        from ... import names
        from ...buffers import cuda_device_count

        count, why = cuda_device_count()
        if count == 0:
            return False, f"not available on this machine ({why})"
        if not names.SUPPORT_CUDA:
            return False, "not available in this build (SUPPORT_CUDA is False)"
        if t.engine == "mooncake":
            return (True, "") if mooncake_has_cuda() else (
                False, "the installed Mooncake engine is not a CUDA build (mooncake-transfer-engine-cuda13)")
    try:
        from ...config import EngineConfig

        EngineConfig.from_env(**_engine_config(t, opts.streams))
    except Exception as exc:  # noqa: BLE001 -- an unknown setting or value: the build lacks this transport
        text = str(exc)
        return False, text if text.startswith("not available") else f"not available in this build ({text})"
    return True, ""


# ---------------------------------------------------------------------------------- measuring


class _Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        print(f"[{self.done:>3}/{self.total}] {time.monotonic() - self.t0:6.1f}s  {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        print(f"          {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stderr_to(log: IO[str] | None):
    """Children started inside inherit ``log`` as their stderr (Mooncake's glog ignores its env knobs)."""
    if log is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _launch(t: Transport, opts: BenchOptions) -> tuple[dict[str, str], list[str]]:
    """The environment and the argv prefix a transport's worker processes start with."""
    env = {"MC_FORCE_TCP": "1"}  # Mooncake: the TCP transport only (ignored by flagcx_mc)
    if t.name not in COMPARED_BUILDS or not opts.compare_build:
        return env, []
    # Started in that tree with it first on the path, so `python -m` imports its flagcx_mc (and
    # whatever the path held before, for its dependencies).
    build = os.path.abspath(opts.compare_build)
    path = os.pathsep.join(p for p in (build, os.environ.get("PYTHONPATH", "")) if p)
    return env | {"PYTHONPATH": path}, ["env", "-C", build]


def _start(t: Transport, opts: BenchOptions, log: IO[str] | None, net: _Net | None = None):
    """Target and initiator processes of one transport, each with one region for its largest shape
    (over a link: each in its namespace, bound to its address)."""
    env, launcher = _launch(t, opts)
    config = _engine_config(t, opts.streams) if t.engine == "flagcx_mc" else None
    size = max(cache_bytes(t.layout, b, n) for b, n in shapes_for(t, opts))
    initiator_prefix, target_prefix = net.link.prefixes if net is not None else ([], [])
    where: tuple[dict, dict] = ({"argv_prefix": target_prefix + launcher}, {"argv_prefix": initiator_prefix + launcher})
    if net is not None:
        where[0]["host"], where[1]["host"] = net.link.target_addr, net.link.initiator_addr
    with stderr_to(log):
        target = WorkerProcess(engine=t.engine, size=size, memory=t.target_memory or t.memory, config=config,
                               env=env, **where[0])
        try:
            initiator = WorkerProcess(engine=t.engine, size=size, memory=t.memory, config=config, env=env,
                                      **where[1])
        except BaseException:
            target.close()
            raise
    return target, initiator


def _prepare_row(t: Transport, op: str, block: int, count: int, target, initiator) -> str:
    """Random source, zeroed destination; returns the digest the destination must show (``_landed``)."""
    span = cache_bytes(t.layout, block, count)
    source, dest = (initiator, target) if op == "write" else (target, initiator)
    source.call("fill", region=0, offset=0, length=span)
    dest.call("set", region=0, byte=0, offset=0, length=span)
    return _landed(t, block, count, source, "local" if source is initiator else "remote")


def _landed(t: Transport, block: int, count: int, holder, side: str) -> str:
    """Digest of the batch's blocks on one side (``side``: the initiator's "local" or the
    target's "remote" offsets), in the plan's order."""
    if t.layout == "contiguous":
        return holder.call("digest", region=0, offset=0, length=block * count)["digest"]
    return holder.call("digest_blocks", side=side, layout=t.layout, block=block, count=count)["digest"]


def _run_trial(t: Transport, op: str, block: int, count: int, reps: int, target, initiator) -> dict:
    """One untimed batch, then one timed loop of ``reps`` batches: ``{"rc", "trials": [one],
    "where"?}`` from the worker.  The untimed batch gets the engine's threads, sockets and GPU
    context going again after the other engines' and the limits' turns."""
    timeout = 60.0 + block * count * (reps + 1) / 20e6  # 20 MB/s would be far below any engine
    extra = {} if t.layout == "contiguous" and t.callers == 1 else {"layout": t.layout, "callers": t.callers}
    return initiator.call("run", timeout=timeout, op=op, target=target.session, remote=target.addr(0),
                          block=block, count=count, reps=reps, trials=1, warmup=1, **extra)


def _finish_row(t: Transport, op: str, block: int, count: int, expect: str, runs: list[dict], target,
                initiator) -> dict:
    """Checksum the destination after the trials; the row reports the fastest trial."""
    span = block * count
    holder = target if op == "write" else initiator
    got = _landed(t, block, count, holder, "remote" if holder is target else "local")
    trials = [x for r in runs for x in r["trials"]]
    failed = next((r for r in runs if r["rc"] != 0), None)
    error = None
    if failed is not None:
        error = f"return code {failed['rc']} in {failed.get('where', 'timed loop')}"
    elif got != expect:
        error = "content differs from the source"
    elif not target.call("guards")["intact"]:
        error = "bytes written outside the target range"
    trial_gbps = [span * x["reps"] / x["seconds"] / 1e9 if x["seconds"] > 0 else 0.0 for x in trials]
    best: dict = trials[trial_gbps.index(max(trial_gbps))] if trial_gbps else {"reps": 0, "seconds": 0.0,
                                                                               "cpu_seconds": 0.0}
    moved = span * best["reps"]
    counters = best.get("link_counters")
    link = {} if counters is None else {"link_per_call": {k: v / best["calls"] for k, v in counters.items()}}
    return link | {
        "transport": t.name, "engine": t.engine, "memory": t.memory, "op": op, "block": block, "count": count,
        "layout": t.layout, "callers": t.callers, "target_memory": t.target_memory or t.memory,
        "reps": best["reps"], "bytes": moved, "seconds": best["seconds"],
        "gbps": max(trial_gbps, default=0.0), "trials_gbps": trial_gbps,
        "cpu_seconds": best["cpu_seconds"],
        "cpu_s_per_gib": best["cpu_seconds"] / (moved / (1 << 30)) if moved else None,
        "verified": error is None, "error": error, "ratios": {},
    }


def _measure_latency(t: Transport, n: int, target, initiator, op: str) -> dict:
    """``n`` synchronous calls of 4 KiB, one at a time, each timed; the bytes checked after."""
    size = 4 * KiB
    if op == "write":
        expect = initiator.call("fill", offset=0, length=size)["digest"]
        target.call("set", region=0, byte=0, offset=0, length=size)
    else:
        expect = target.call("fill", region=0, offset=0, length=size)["digest"]
        initiator.call("set", byte=0, offset=0, length=size)
    # `op` only for reads: a compared build from before reads were timed takes the writes' call.
    r = initiator.call("latency", timeout=60.0 + n * 0.01, target=target.session, remote=target.addr(0), size=size,
                       n=n, **({"op": op} if op != "write" else {}))
    landed = (target.call("digest", region=0, offset=0, length=size) if op == "write"
              else initiator.call("digest", offset=0, length=size))["digest"]
    verified = r["rc"] == 0 and landed == expect
    out = {"transport": t.name, "engine": t.engine, "op": op, "size": size, "verified": verified,
           "error": None if verified else f"return code {r['rc']}" if r["rc"] else "content differs"}
    out.update({k: r.get(k) for k in ("n", "p50_us", "p99_us", "mean_us", "min_us", "max_us", "cpu_seconds")})
    return out


def _run_all(running: list[Transport], opts: BenchOptions, shapes, limits: list[str], progress: _Progress,
             result: dict, log: IO[str] | None, net: _Net | None = None) -> None:
    """Start every transport's processes, then measure shape by shape (``_measure_shape``: the
    physical limits and the transports trial by trial in turn), then the latency test.

    Interleaving keeps every comparison at one shape a few seconds apart, which matters on a
    machine shared with other work.  Idle engines (Mooncake's too) use no CPU.
    """
    procs: dict[str, tuple] = {}

    def stop(t: Transport, exc: BaseException) -> None:
        if t.engine == "mooncake" and ("ImportError" in str(exc) or "ModuleNotFoundError" in str(exc)):
            result["transports"][t.name].update(available=False, reason=f"mooncake.engine cannot be imported ({exc})")
        else:
            result["errors"].append(f"{t.name}: {exc}")
        progress.note(f"{t.name} stopped: {exc}")
        if log is not None:
            log.seek(0)
            for line in log.read().splitlines()[-20:]:
                progress.note(f"  child: {line}")
        for proc in procs.pop(t.name, ()):
            proc.close()

    try:
        for t in running:
            try:
                procs[t.name] = _start(t, opts, log, net)
            except (EngineProcessError, OSError) as exc:
                stop(t, exc)
        for op in opts.ops:
            for block, count in shapes:
                _measure_shape(op, block, count, [t for t in running if t.name in procs and
                                                  (block, count) in shapes_for(t, opts)],
                               procs, limits, opts, progress, result, stop, net)
        for t in running:
            if t.name not in procs or opts.latency_n <= 0:  # --latency-n 0: no latency test
                continue
            target, initiator = procs[t.name]
            for op in ("write", "read"):
                try:
                    lat = _measure_latency(t, opts.latency_n, target, initiator, op)
                except (EngineProcessError, OSError) as exc:
                    stop(t, exc)
                    break
                result["latency"].append(lat)
                progress.step(f"{t.name:<14} latency 4 KiB sync {op} x{lat['n']}: p50 {lat['p50_us'] or 0:.1f} us, "
                              f"p99 {lat['p99_us'] or 0:.1f} us  {'verified' if lat['verified'] else 'NOT VERIFIED'}")
    finally:
        for target, initiator in procs.values():
            initiator.close()
            target.close()


class StealClock:
    """Hypervisor steal, from /proc/stat: the share of CPU time this VM's CPUs were ready to run
    but the host ran something else.  A batch-synchronous engine loses far more to it than a
    streaming raw socket (each batch waits for its slowest thread), so the bench records it per
    shape and names it beside a target that misses.  None where /proc/stat is not readable."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.start = self.ticks()

    def ticks(self) -> tuple[int, int] | None:
        """(steal, all) ticks of the first line: user nice system idle iowait irq softirq steal."""
        try:
            with open(self.path) as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (fields[7], sum(fields)) if len(fields) == 8 else None

    def share(self) -> float | None:
        """Steal over all CPU time since this clock started."""
        now = self.ticks()
        if now is None or self.start is None or now[1] <= self.start[1]:
            return None
        return (now[0] - self.start[0]) / (now[1] - self.start[1])


@dataclasses.dataclass
class _Attempt:
    """One pass of a shape's trial rounds: each limit's and each transport's trials, and the
    hypervisor steal while they ran."""
    limit_gbps: dict[str, list[float]]
    runs: dict[str, list[dict]]
    steal: float | None

    def failed(self) -> bool:
        return any(r["rc"] != 0 for runs in self.runs.values() for r in runs)


def _trial_rounds(op: str, block: int, count: int, live: list[Transport], procs: dict[str, tuple],
                  limits: list[str], opts: BenchOptions, result: dict, stop, net: _Net | None = None) -> _Attempt:
    """Round k measures each limit once, then runs each transport's k-th timed loop.  Over a link,
    each trial also carries the namespaces' TCP counters of its calls (warm-up included)."""
    span = block * count
    reps = reps_of(opts, span)
    limit_bytes = _limit_bytes(span, reps)
    limit_gbps: dict[str, list[float]] = {name: [] for name in limits if name not in result["baselines_missing"]}
    runs: dict[str, list[dict]] = {t.name: [] for t in live}
    steal = StealClock()
    for _ in range(opts.trials):
        for name in [n for n in limit_gbps if not bl.derived_from(n)]:
            try:
                if name in bl.LINK_BASELINES:
                    if net is None:
                        raise bl.BaselineUnavailable("measured over a shaped link only (--link)")
                    limit_gbps[name].append(net.plain.measure(op, limit_bytes))
                else:
                    limit_gbps[name].append(bl.measure(name, block, span, limit_bytes, streams=opts.streams))
            except bl.BaselineUnavailable as exc:
                result["baselines_missing"][name] = str(exc)
                del limit_gbps[name]
        for t in live:
            if t.name not in procs or (runs[t.name] and runs[t.name][-1]["rc"] != 0):
                continue
            try:
                before = net.link.counters() if net is not None else None
                run = _run_trial(t, op, block, count, reps, *procs[t.name])
                if net is not None and before is not None and run["trials"]:
                    after = net.link.counters()
                    run["trials"][0].update(link_counters={k: after[k] - before[k] for k in after}, calls=reps + 1)
                runs[t.name].append(run)
            except (EngineProcessError, OSError) as exc:
                stop(t, exc)
    for name, parts in ((n, bl.derived_from(n)) for n in list(limit_gbps)):
        if not parts:
            continue
        if all(p in limit_gbps for p in parts):  # the smallest of the parts, round by round
            limit_gbps[name] = [min(vals) for vals in zip(*(limit_gbps[p] for p in parts), strict=True)]
        else:
            result["baselines_missing"][name] = "needs " + ", ".join(p for p in parts if p not in limit_gbps)
            del limit_gbps[name]
    return _Attempt(limit_gbps, runs, steal.share())


def _limit_bytes(span: int, reps: int) -> int:
    return max(span * reps, 64 * MiB)


def _measure_shape(op: str, block: int, count: int, live: list[Transport], procs: dict[str, tuple],
                   limits: list[str], opts: BenchOptions, progress: _Progress, result: dict, stop,
                   net: _Net | None = None) -> None:
    """Every limit and every transport at one shape and op, trial by trial in turn (``_trial_rounds``).
    Load that comes and goes on a shared machine then falls on both sides of every ratio alike;
    each side reports its best.  Hypervisor steal does not fall alike (a batch-synchronous engine
    waits for its slowest thread, a raw socket streams on), so a shape that ran with
    ``opts.steal_retry_at`` or more is measured again, up to ``opts.steal_retries`` times, and the
    calmest pass is kept; every pass's steal stays in the JSON (``steal_attempts``).  A pass in
    which a transfer failed is never measured over."""
    span = block * count
    reps = reps_of(opts, span)
    expects: dict[str, str] = {}
    for t in live:
        try:
            expects[t.name] = _prepare_row(t, op, block, count, *procs[t.name])
        except (EngineProcessError, OSError) as exc:
            stop(t, exc)
    live = [t for t in live if t.name in expects]
    attempts: list[_Attempt] = []
    for attempt in range(1 + max(0, opts.steal_retries)):
        attempts.append(_trial_rounds(op, block, count, live, procs, limits, opts, result, stop, net))
        share = attempts[-1].steal
        if attempts[-1].failed() or share is None or share < opts.steal_retry_at or attempt == opts.steal_retries:
            break
        progress.note(f"{op} {fmt_size(block)} x{count}: hypervisor steal {share:.0%} during the trials, "
                      f"measuring this shape again")
    kept = attempts[-1] if attempts[-1].failed() else min(attempts, key=lambda a: a.steal or 0.0)
    limit_gbps, runs, steal_share = kept.limit_gbps, kept.runs, kept.steal
    steal_attempts = [a.steal for a in attempts]
    for name in limits:
        if name in result["baselines_missing"]:
            progress.step(f"baseline {name}: not available ({result['baselines_missing'][name]})")
            continue
        gbps = max(limit_gbps[name])
        result["baselines"].append({"name": name, "op": op, "block": block, "count": count,
                                    "bytes": _limit_bytes(span, reps), "gbps": gbps,
                                    "trials_gbps": limit_gbps[name], "steal": steal_share,
                                    "steal_attempts": steal_attempts,
                                    "streams": opts.plain_streams if name in bl.LINK_BASELINES else
                                    opts.streams if name in ("raw socket", "socket calls") else None})
        progress.step(f"baseline {name:<10} {fmt_size(block):>7} x{count:<5} {gbps:7.2f} GB/s  (beside {op})")
    for t in live:
        if t.name not in procs:
            continue
        try:
            row = _finish_row(t, op, block, count, expects[t.name], runs[t.name], *procs[t.name])
        except (EngineProcessError, OSError) as exc:
            stop(t, exc)
            continue
        row["steal"], row["steal_attempts"] = steal_share, steal_attempts
        result["rows"].append(row)
        status = "verified" if row["verified"] else f"NOT VERIFIED: {row['error']}"
        progress.step(f"{t.name:<14} {op:<5} {fmt_size(block):>7} x{count:<5} {row['gbps']:7.2f} GB/s  "
                      f"{row['cpu_s_per_gib'] or 0:6.3f} CPU s/GiB  {status}")


def _host_info() -> dict:
    import flagcx_mc

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mooncake_version = None
    try:
        from importlib.metadata import packages_distributions, version

        dists = packages_distributions().get("mooncake", [])
        mooncake_version = f"{dists[0]} {version(dists[0])}" if dists else None
    except Exception:  # noqa: BLE001, S110 -- metadata is informative only
        pass
    # Loopback connections of flagcx_mc and of the raw-socket limit use the local congestion
    # control; Mooncake's use the host's default.
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "flagcx_mc": flagcx_mc.__version__, "mooncake": mooncake_version,
            "loadavg_at_start": list(os.getloadavg()), "tcp_congestion_control": host_congestion_control(),
            "local_congestion_control": local_congestion_control()}


def run_bench(opts: BenchOptions) -> int:
    """Run the sweep, print the tables (and targets), write JSON (and PNG); 0 only if every
    transfer was verified and no target was missed."""
    chosen = [t for t in TRANSPORTS if t.name in opts.transports]
    unknown = set(opts.transports) - {t.name for t in TRANSPORTS}
    if unknown:
        print(f"unknown transport(s): {', '.join(sorted(unknown))}; known: {', '.join(t.name for t in TRANSPORTS)}",
              file=sys.stderr)
        return 2
    if opts.link is not None:
        why = shaped.unavailable()
        if why:
            print(f"flagcx-mc bench --link: {why}", file=sys.stderr)
            return 2
    result: dict = {"schema": SCHEMA,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": _host_info(), "errors": [],
              "options": {"blocks": opts.blocks, "batches": opts.batches, "paged_blocks": opts.paged_blocks,
                          "paged_count": opts.paged_count, "ops": opts.ops, "streams": opts.streams,
                          "transports": opts.transports, "repeat": opts.repeat, "target_bytes": opts.target_bytes,
                          "trials": opts.trials, "steal_retries": opts.steal_retries,
                          "steal_retry_at": opts.steal_retry_at,
                          "latency_n": opts.latency_n, "quick": opts.quick, "mooncake": opts.mooncake,
                          "targets": opts.targets_path, "compare_build": opts.compare_build, "incast": opts.incast,
                          "link": None if opts.link is None else {"rate": opts.link.rate, "loss": opts.link.loss,
                                                                  "kind": opts.link.kind, "text": str(opts.link),
                                                                  "plain_streams": opts.plain_streams}}}
    transports = {}
    for t in chosen:
        ok, reason = availability(t, opts)
        if ok and opts.link is not None and t.name not in LINK_TRANSPORTS:
            ok, reason = False, f"over a shaped link only {', '.join(LINK_TRANSPORTS)} run"
        transports[t.name] = {"available": ok, "reason": reason, "summary": t.summary, "limit": t.limit}
        if not ok:
            print(f"{t.name}: {reason}", file=sys.stderr)
    running = [t for t in chosen if transports[t.name]["available"]]
    shapes = sorted({shape for t in running for shape in shapes_for(t, opts)})
    limit_of = {t.name: "plain streams" if opts.link is not None else t.limit for t in TRANSPORTS}
    wanted = {limit_of[t.name] for t in running} | {x for t in running for x in bl.also_against(limit_of[t.name])}
    limits = [b for b in bl.BASELINES if b != "mooncake" and b in wanted]
    progress = _Progress(len(opts.ops) * (len(limits) * len(shapes) + sum(len(shapes_for(t, opts)) for t in running))
                         + 2 * len(running))  # the latency test: writes, then reads
    result.update(transports=transports, baselines=[], baselines_missing={}, rows=[], latency=[])
    with contextlib.ExitStack() as stack:
        log = None if opts.verbose else stack.enter_context(tempfile.TemporaryFile("w+"))
        steal = StealClock()
        net = None
        if opts.link is not None and running:
            net = _Net(opts.link, opts.plain_streams)
            stack.callback(net.close)
            progress.note(f"shaped link {opts.link}: initiator {net.link.initiator_addr} ({net.link.initiator_ns}), "
                          f"target {net.link.target_addr} ({net.link.target_ns})")
        _run_all(running, opts, shapes, limits, progress, result, log, net)
        if net is not None and opts.incast > 1:
            result["incast"] = _run_incast(running, opts, net, progress, log)
        result["host"]["steal_share"] = steal.share()
    rows, latencies, baselines = result["rows"], result["latency"], result["baselines"]
    order = {t.name: i for i, t in enumerate(TRANSPORTS)}
    rows.sort(key=lambda r: (order[r["transport"]], opts.ops.index(r["op"]), r["block"], r["count"]))
    add_ratios(rows, baselines, limit_of)
    result["targets"] = evaluate_targets(opts.targets, result) if opts.targets else []
    result["verified"] = (all(r["verified"] for r in rows) and all(x["verified"] for x in latencies)
                          and all(x["verified"] for x in result.get("incast", [])))
    print_report(result)
    for path in (opts.png_path, opts.json_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if opts.png_path:
        skipped = draw_png(result, opts.png_path)
        print(f"PNG skipped: {skipped}" if skipped else f"plot written to {opts.png_path}")
        result["png"] = None if skipped else opts.png_path
    if opts.json_path:
        write_json(result, opts.json_path)
        print(f"results written to {opts.json_path}")
    return verdict(result)
