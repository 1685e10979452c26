"""The only importer of the compiled C core: thin wrappers that convert arguments and codes.

Every call into ``lib`` releases the GIL (cffi does so for each call), so the blocking calls here
(``CorePeer.connect``, ``CorePeer.transfer``, ``CoreBatch.wait``) may run in any thread.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from . import errors
from .metadata.descriptor import MAX_GPU_CHUNKS, GpuShare, gpu_uuid_bytes, gpu_uuid_text

if TYPE_CHECKING:
    from .config import EngineConfig
try:
    from ._fmc_cffi import ffi, lib
except ImportError as exc:  # a source tree without the compiled core
    raise ImportError(
        f"flagcx_mc's C core is not built here ({exc}); install the package with `pip install .` "
        "(or `pip install -e .` in a checkout)"
    ) from exc

__all__ = ["CoreEngine", "CorePeer", "CoreBatch", "OP_READ", "OP_WRITE", "core_version", "last_error"]

log = logging.getLogger(__name__)

PROTO_NATIVE: int = lib.FMC_PROTO_NATIVE
PROTO_MOONCAKE: int = lib.FMC_PROTO_MOONCAKE
OP_READ: int = lib.FMC_OP_READ
OP_WRITE: int = lib.FMC_OP_WRITE
TASK_PENDING: int = lib.FMC_TASK_PENDING
_U64_MAX = (1 << 64) - 1


def _apply_process_settings() -> None:
    """Hand the core the settings of the whole process (it reads no environment itself): which
    CUDA driver to load, and where a trace build writes its events.  Once, at import, before any
    engine or buffer can need them."""
    from .config import ProcessSettings

    settings = ProcessSettings.from_env()
    if settings.cuda_driver and lib.fmc_cuda_set_library(settings.cuda_driver.encode()) != 0:
        log.warning("FLAGCX_MC_LIBCUDA=%r not used: %s", settings.cuda_driver, last_error())
    if settings.trace_file and lib.fmc_trace_configure(settings.trace_file.encode(), settings.trace_events) == 0:
        log.info("the core's event trace goes to %s.<pid>", settings.trace_file)
    lib.fmc_serve_pool_set_threads(settings.serve_threads)
    lib.fmc_io_pool_set_threads(settings.io_threads)


def _pool_counts(counts: Any) -> tuple[int, int, int]:
    workers, cap, recalls = ffi.new("int *"), ffi.new("int *"), ffi.new("uint64_t *")
    counts(workers, cap, recalls)
    return int(workers[0]), int(cap[0]), int(recalls[0])


def serve_pool() -> tuple[int, int, int]:
    """(threads, cap, recalls) of the process's pool that serves inbound data connections:
    recalls counts lingering threads called back to take connections waiting in its set."""
    return _pool_counts(lib.fmc_serve_pool_counts)


def io_pool() -> tuple[int, int, int]:
    """(threads, cap, recalls) of the process's pool that runs outbound streams' send and
    receive sides."""
    return _pool_counts(lib.fmc_io_pool_counts)


def core_version() -> str:
    """Version string baked into the C module at build time."""
    return ffi.string(lib.fmc_version()).decode()


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """The core's own HMAC-SHA256 (used by the data-plane handshake); exposed for tests."""
    out = ffi.new("uint8_t[32]")
    _raise_for(lib.fmc_hmac_sha256_public(key, len(key), message, len(message), out))
    return bytes(ffi.buffer(out, 32))


def last_error() -> str:
    """The message of the last failing core call in this thread."""
    return ffi.string(lib.fmc_last_error()).decode(errors="replace")


def device_uuid(ordinal: int) -> str:
    """The UUID of this process's GPU ``ordinal`` (``GPU-...``), or "" where there is none."""
    raw = ffi.new("uint8_t[16]")
    if ordinal < 0 or lib.fmc_cuda_device_uuid(ordinal, raw) != 0:
        return ""
    return gpu_uuid_text(bytes(ffi.buffer(raw, 16)))


def _uuid_arg(share: GpuShare):
    raw = gpu_uuid_bytes(share.uuid) if share.uuid else None
    return raw if raw is not None else ffi.NULL


def resolve_peer_device(share: GpuShare) -> int:
    """The ordinal, in this process, of the GPU that holds a peer's region, or -1 where this
    process does not see it: by UUID; by the peer's ordinal only for peers that send no UUID."""
    return int(lib.fmc_cuda_resolve_peer_device(_uuid_arg(share), share.device))


def mapping_device(share: GpuShare) -> int:
    """The device to map a same-host peer's GPU region on (``fmc_cuda_mapping_device``), or
    ``lib.FMC_MAP_NOT_VISIBLE`` / ``lib.FMC_MAP_NO_CONTEXT``."""
    return int(lib.fmc_cuda_mapping_device(_uuid_arg(share), share.device))


def cuda_contexts() -> tuple[list[int], list[str]]:
    """The GPUs this process holds a primary context on: ordinals and UUIDs (the driver is not
    loaded to answer)."""
    cap = 64
    ordinals = ffi.new("int32_t[]", cap)
    uuids = ffi.new("uint8_t[]", 16 * cap)
    n = min(int(lib.fmc_cuda_contexts(ordinals, uuids, cap)), cap)
    raw = bytes(ffi.buffer(uuids, 16 * n))
    return [int(ordinals[i]) for i in range(n)], [gpu_uuid_text(raw[16 * i:16 * i + 16]) for i in range(n)]


def as_u64(value: object, what: str) -> int:
    """``value`` as an unsigned 64-bit int (ints and int-like objects such as numpy integers);
    anything else, bools and negative numbers included, is an ``InvalidArgumentError``."""
    if isinstance(value, bool):
        raise errors.InvalidArgumentError(f"{what} must be an int, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise errors.InvalidArgumentError(f"{what} must be an int, not {type(value).__name__}") from None
    if not 0 <= number <= _U64_MAX:
        raise errors.InvalidArgumentError(f"{what} {number} is outside 0..2**64-1")
    return number


def as_u64_list(values: object, what: str) -> list[int]:
    """A list or tuple of unsigned 64-bit ints (``as_u64`` for each); a string, a scalar or any
    other iterable is an ``InvalidArgumentError``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, range)):
        if not (hasattr(values, "__len__") and hasattr(values, "__getitem__")):  # numpy arrays
            raise errors.InvalidArgumentError(f"{what} must be a list of ints, not {type(values).__name__}")
    # a list, tuple, range or sequence-like array (checked above): iterable
    return [as_u64(v, f"{what}[{i}]") for i, v in enumerate(cast("Sequence[object]", values))]


def _raise_for(rc: int, context: str = "") -> None:
    if rc < 0:
        message = last_error()
        if context:
            message = f"{context}: {message}" if message else context
        raise errors.error_for_code(rc, message)


class CoreEngine:
    """One engine of the C core: its registry and its data listener."""

    def __init__(self, bind_host: str, port_min: int = 0, port_max: int = 0,
                 config: EngineConfig | None = None) -> None:
        """``config`` carries the core's per-engine settings; without one, the environment's
        (``EngineConfig.from_env()``)."""
        if config is None:
            from .config import EngineConfig

            config = EngineConfig.from_env()
        opts = ffi.new("fmc_options *")
        lib.fmc_options_default(opts)
        opts.local_cc = config.local_cc.encode()
        opts.prefault = {"off": lib.FMC_PREFAULT_OFF, "touched": lib.FMC_PREFAULT_TOUCHED,
                         "all": lib.FMC_PREFAULT_ALL}[config.prefault]
        opts.vectors = int(bool(config.vectors))
        opts.spin_us = int(config.spin_us)
        opts.copy_threads = int(config.copy_threads)
        opts.zerocopy = int(bool(config.zerocopy))
        opts.gpu_copy = {"auto": lib.FMC_GPU_COPY_AUTO, "kernel": lib.FMC_GPU_COPY_KERNEL,
                         "batch": lib.FMC_GPU_COPY_BATCH, "single": lib.FMC_GPU_COPY_SINGLE}[config.gpu_copy]
        opts.gpu_staging = int(config.gpu_staging)
        opts.rto_min_us = int(config.rto_min_us)
        opts.delack_max_us = int(config.delack_max_us)
        out = ffi.new("fmc_engine **")
        rc = lib.fmc_engine_create(bind_host.encode(), port_min, port_max, opts, out)
        _raise_for(rc, f"cannot start the data listener on {bind_host}")
        self._ptr = out[0]

    @property
    def data_port(self) -> int:
        return int(lib.fmc_engine_data_port(self._ptr))

    @property
    def ptr(self):
        return self._ptr

    def register(self, addr: int, length: int) -> int:
        """Register [addr, addr+length); returns the region's random 32-bit key."""
        addr, length = as_u64(addr, "address"), as_u64(length, "length")
        key = ffi.new("uint32_t *")
        _raise_for(lib.fmc_register(self._ptr, addr, length, key))
        return int(key[0])

    def unregister(self, addr: int) -> None:
        addr = as_u64(addr, "address")
        _raise_for(lib.fmc_unregister(self._ptr, addr))

    def region_table(self) -> list[tuple[int, int, int]]:
        """The registered regions as (addr, length, key), in registration order."""
        cap = 64
        while True:
            addrs = ffi.new("uint64_t[]", cap)
            lens = ffi.new("uint64_t[]", cap)
            keys = ffi.new("uint32_t[]", cap)
            n = lib.fmc_region_table(self._ptr, addrs, lens, keys, cap)
            if n <= cap:
                return [(int(addrs[i]), int(lens[i]), int(keys[i])) for i in range(n)]
            cap = n * 2

    def region_slots(self) -> list[tuple[int, int]]:
        """(same-host slot, generation) of each region, in ``region_table`` order (slot -1: none)."""
        cap = 64
        while True:
            slots = ffi.new("int32_t[]", cap)
            gens = ffi.new("uint32_t[]", cap)
            n = lib.fmc_region_slots(self._ptr, slots, gens, cap)
            if n <= cap:
                return [(int(slots[i]), int(gens[i])) for i in range(n)]
            cap = n * 2

    def gpu_share(self, addr: int) -> GpuShare | None:
        """How same-host peers can map the registered region at ``addr``; None for host memory.

        A legacy CUDA IPC handle where the memory has one, else its VMM chunks as file
        descriptors; memory that has neither is still described as GPU memory (the reason is
        logged), so that peers move its bytes through staging instead of process_vm_*."""
        handle = ffi.new("uint8_t[64]")
        base = ffi.new("uint64_t *")
        dev = ffi.new("int *")
        rc = lib.fmc_region_cuda_ipc(self._ptr, addr, handle, base, dev)
        if rc == 0 and dev[0] < 0:
            return None
        uuid = device_uuid(int(dev[0]))
        if rc == 1:
            return GpuShare(int(dev[0]), uuid, ipc=bytes(ffi.buffer(handle, 64)).hex(), base=int(base[0]))
        ipc_reason = last_error()
        bases = ffi.new("uint64_t[]", MAX_GPU_CHUNKS)
        sizes = ffi.new("uint64_t[]", MAX_GPU_CHUNKS)
        fds = ffi.new("int32_t[]", MAX_GPU_CHUNKS)
        n = lib.fmc_region_cuda_vmm(self._ptr, addr, bases, sizes, fds, MAX_GPU_CHUNKS, dev)
        if 0 < n <= MAX_GPU_CHUNKS:
            return GpuShare(int(dev[0]), uuid,
                            vmm=tuple((int(bases[i]), int(sizes[i]), int(fds[i])) for i in range(n)))
        log.warning("GPU region at %#x cannot be shared with same-host peers (they will stage its bytes): "
                    "CUDA IPC: %s; VMM: %s", addr, ipc_reason, last_error())
        return GpuShare(int(dev[0]), uuid)

    @property
    def same_host_fd(self) -> int:
        """fd of the control block same-host peers map (-1 if this engine has none)."""
        return int(lib.fmc_engine_same_host_fd(self._ptr))

    @property
    def same_host_addr(self) -> int:
        """Address of that control block in this process (peers probe it with process_vm_readv)."""
        return int(lib.fmc_engine_same_host_addr(self._ptr))

    def stats(self) -> dict:
        s = ffi.new("fmc_stats *")
        lib.fmc_engine_get_stats(self._ptr, s)
        out: dict = {name: int(getattr(s, name)) for name, _ in ffi.typeof("fmc_stats").fields}
        out["cuda_contexts"], out["cuda_context_uuids"] = cuda_contexts()
        out["serve_threads"], out["serve_threads_cap"], out["serve_recalls"] = serve_pool()  # the process's, shared
        out["io_threads"], out["io_threads_cap"], out["io_recalls"] = io_pool()
        return out

    def drain_log(self) -> list[str]:
        """Messages the C threads left (refused requests, dropped connections)."""
        buf = ffi.new("char[]", 8192)
        n = lib.fmc_engine_drain_log(self._ptr, buf, 8192)
        if n <= 0:
            return []
        return ffi.unpack(buf, n).decode(errors="replace").splitlines()

    def set_secret(self, secret: bytes) -> None:
        """Require mutual shared-secret authentication on every native data connection (both
        ways) and stop serving Mooncake's key-less framing."""
        _raise_for(lib.fmc_engine_set_secret(self._ptr, secret, len(secret)))

    def accept_mooncake_wire(self, accept: bool) -> None:
        """Serve Mooncake's key-less TCP framing on the data port (on by default)."""
        lib.fmc_engine_accept_mooncake_wire(self._ptr, int(accept))

    def batches_ended(self) -> int:
        """How many of this engine's batches have ended so far (for ``wait_batch_end``)."""
        return int(lib.fmc_engine_batches_ended(self._ptr))

    def wait_batch_end(self, seen: int, timeout_ms: int) -> bool:
        """Wait (GIL released) until one of this engine's batches ends after ``batches_ended``
        returned ``seen``, or ``wake_end_waiters`` is called, at most ``timeout_ms``; False if
        the time ran out."""
        return bool(lib.fmc_engine_wait_batch_end(self._ptr, seen, int(timeout_ms)))

    def wake_end_waiters(self) -> None:
        lib.fmc_engine_wake_end_waiters(self._ptr)

    def close(self) -> None:
        if self._ptr is not None:
            for line in self.drain_log():
                log.warning("%s", line)
            lib.fmc_engine_destroy(self._ptr)
            self._ptr = None


class CorePeer:
    """A remote engine as the core sees it: region table plus connected data streams."""

    def __init__(self, engine: CoreEngine, host: str, data_port: int, streams: int, slice_size: int) -> None:
        out = ffi.new("fmc_peer **")
        rc = lib.fmc_peer_create(engine.ptr, host.encode(), data_port, streams, slice_size, out)
        _raise_for(rc)
        self._ptr = ffi.gc(out[0], lib.fmc_peer_release)
        self.host = host
        self.data_port = data_port
        self.streams = streams

    def set_regions(self, regions: Sequence[tuple[int, int, int]]) -> None:
        n = len(regions)
        addrs = ffi.new("uint64_t[]", [r[0] for r in regions] or [0])
        lens = ffi.new("uint64_t[]", [r[1] for r in regions] or [0])
        keys = ffi.new("uint32_t[]", [r[2] for r in regions] or [0])
        _raise_for(lib.fmc_peer_set_regions(self._ptr, addrs, lens, keys, n))

    def find_region(self, addr: int, length: int) -> tuple[int, int]:
        """Return (region base, key) of the remote region that wholly holds the range."""
        base = ffi.new("uint64_t *")
        key = ffi.new("uint32_t *")
        rc = lib.fmc_peer_find_region(self._ptr, addr, length, base, key)
        if rc < 0:
            raise errors.AddressNotRegisteredError(
                f"[{addr:#x}, +{length}) is not inside one region registered by {self.host}"
            )
        return int(base[0]), int(key[0])

    def set_protocol(self, proto: int) -> None:
        """Speak Mooncake's TCP framing (``PROTO_MOONCAKE``) instead of ours; before ``connect``."""
        _raise_for(lib.fmc_peer_set_protocol(self._ptr, proto))

    def set_owner_pid(self, pid: int) -> None:
        """The peer's process id when it runs on this host (before ``connect``): zero-copy sends
        to it are used only where the core can fence them through its end of the connection."""
        _raise_for(lib.fmc_peer_set_owner_pid(self._ptr, pid))

    def set_region_slots(self, regions: Sequence[tuple[int, int, int]]) -> None:
        """(addr, slot, gen) of remote regions, for the same-host path."""
        n = len(regions)
        addrs = ffi.new("uint64_t[]", [r[0] for r in regions] or [0])
        slots = ffi.new("int32_t[]", [r[1] for r in regions] or [0])
        gens = ffi.new("uint32_t[]", [r[2] for r in regions] or [0])
        _raise_for(lib.fmc_peer_set_region_slots(self._ptr, addrs, slots, gens, n))

    def enable_same_host(self, pid: int, ctrl_fd: int, ctrl_addr: int) -> None:
        """Copy with process_vm_writev/readv into process ``pid``; raises if the kernel refuses."""
        _raise_for(lib.fmc_peer_enable_same_host(self._ptr, pid, ctrl_fd, ctrl_addr))

    @property
    def same_host(self) -> bool:
        return bool(lib.fmc_peer_is_same_host(self._ptr))

    def set_region_shm(self, addr: int, memfd: int, size: int) -> None:
        """A remote region backed by a memfd the peer shares: map it here (same host only)."""
        _raise_for(lib.fmc_peer_set_region_shm(self._ptr, addr, memfd, size))

    @property
    def shared_regions(self) -> int:
        """How many of the peer's regions are mapped here (copied into with memcpy)."""
        return int(lib.fmc_peer_shared_region_count(self._ptr))

    def set_region_gpu(self, addr: int, share: GpuShare) -> str:
        """A remote GPU region: remember it is GPU memory and, same host, map it here (CUDA IPC
        handle or VMM chunks) on a device this process uses (``mapping_device``).  Returns ""
        when mapped (or when the peer is on another host: nothing to map), else the reason its
        bytes go through staging over TCP instead; raises for a region the peer does not list
        or chunks that do not cover it."""
        local = share.device  # off the same-host path only a mark: "GPU memory"
        why = ""
        if self.same_host:
            local = mapping_device(share)
            if local == lib.FMC_MAP_NO_CONTEXT:
                why = "this process uses no GPU (it makes no CUDA context to map the peer's)"
            elif local < 0:
                why = f"the peer's GPU {share.uuid or share.device} is not visible in this process"
        if why:
            # Known to be GPU memory all the same: its bytes must never go to process_vm_*.
            _raise_for(lib.fmc_peer_set_region_device(self._ptr, addr, share.device))
            return why
        if share.vmm:
            bases, sizes, fds = zip(*share.vmm, strict=True)
            rc = lib.fmc_peer_set_region_vmm(self._ptr, addr, local, len(bases), ffi.new("uint64_t[]", bases),
                                             ffi.new("uint64_t[]", sizes), ffi.new("int32_t[]", fds))
        elif share.ipc:
            rc = lib.fmc_peer_set_region_ipc(self._ptr, addr, bytes.fromhex(share.ipc), share.base, local)
        else:
            rc = lib.fmc_peer_set_region_device(self._ptr, addr, local)
            if rc >= 0 and self.same_host:
                return "the peer cannot share that GPU memory"
        if rc >= 0:
            return ""
        reason = last_error()
        if rc != lib.FMC_ERR_ADDRESS_NOT_REGISTERED:
            lib.fmc_peer_set_region_device(self._ptr, addr, local)
        if rc in (lib.FMC_ERR_ADDRESS_NOT_REGISTERED, lib.FMC_ERR_INVALID_ARGUMENT):
            _raise_for(rc)
        return f"cannot map the peer's GPU memory: {reason}"

    def connect(self, timeout_ms: int) -> None:
        """Open the first data stream (blocking; run it off the event loop).  The core opens the
        others once a transfer too large for one stream comes."""
        _raise_for(lib.fmc_peer_connect(self._ptr, max(1, int(timeout_ms))))

    @property
    def streams_ready(self) -> int:
        """Data streams connected so far (of ``streams``)."""
        return int(lib.fmc_peer_streams_ready(self._ptr))

    @property
    def healthy(self) -> bool:
        return bool(lib.fmc_peer_is_healthy(self._ptr))

    def idle_ms(self) -> int:
        """Milliseconds since its last transfer started; -1 while a batch of it is alive."""
        return int(lib.fmc_peer_idle_ms(self._ptr))

    def transfer_packed(self, opcode: int, n: int, packed: bytes, timeout_ms: int) -> tuple[int, str]:
        """Submit and wait in one core call (GIL released); returns (rc, reason).  The three
        lists come as one pack3 buffer: no cffi views to build."""
        rc = lib.fmc_transfer_packed(self._ptr, opcode, n, packed, timeout_ms)
        return rc, (last_error() if rc < 0 else "")

    def set_call_stats(self, stats) -> None:
        """Where the core counts this peer's successful transfer calls (an fmc_call_stats * that
        the caller keeps alive for as long as the peer)."""
        lib.fmc_peer_set_call_stats(self._ptr, stats)

    def transfer_one(self, opcode: int, local: int, remote: int, length: int, timeout_ms: int) -> tuple[int, str]:
        """One range, as plain ints (checked by the caller): no arrays to build."""
        rc = lib.fmc_transfer_one(self._ptr, opcode, local, remote, length, timeout_ms)
        return rc, (last_error() if rc < 0 else "")

    def submit(self, opcode: int, n: int, local, remote, lens) -> CoreBatch:
        out = ffi.new("fmc_batch **")
        _raise_for(lib.fmc_batch_submit(self._ptr, opcode, n, local, remote, lens, out))
        return CoreBatch(out[0], n, (local, remote, lens))

    def start_one(self, opcode: int, local: int, remote: int, length: int, poll_us: int) -> tuple[int, str, Any]:
        """Start one range without blocking for more than ``poll_us`` (see ``fmc_transfer_start``):
        ``(rc, why, None)`` when it ended here, else ``(0, "", batch)`` still in flight.  For an
        event loop's thread: on one host the copy runs here, whatever its size."""
        out = ffi.new("fmc_batch **")
        rc = lib.fmc_transfer_start_one(self._ptr, opcode, local, remote, length, poll_us, out)
        return _started(rc, out, 1, None)

    def start_packed(self, opcode: int, n: int, packed: bytes, poll_us: int) -> tuple[int, str, Any]:
        """``start_one`` of pack3's buffer of ``n`` ranges."""
        out = ffi.new("fmc_batch **")
        rc = lib.fmc_transfer_start_packed(self._ptr, opcode, n, packed, poll_us, out)
        return _started(rc, out, n, packed)

    def start_group(self, opcode: int, n: int, packed: bytes, poll_us: int) -> tuple[int, str, Any]:
        """``start_packed`` of several calls' ranges in one batch; a success is not counted in
        the peer's call statistics (the caller counts each call)."""
        out = ffi.new("fmc_batch **")
        rc = lib.fmc_transfer_start_group(self._ptr, opcode, n, packed, poll_us, out)
        return _started(rc, out, n, packed)

    def close(self) -> None:
        lib.fmc_peer_close(self._ptr)


def _started(rc: int, out, n: int, keepalive) -> tuple[int, str, Any]:
    if rc < 0:
        return rc, last_error(), None
    return 0, "", (CoreBatch(out[0], n, keepalive) if out[0] != ffi.NULL else None)


class CoreBatch:
    """An asynchronous batch; freeing it cancels whatever is still in flight."""

    def __init__(self, ptr, ntasks: int, keepalive) -> None:
        self._ptr = ffi.gc(ptr, lib.fmc_batch_free)
        self.ntasks = ntasks
        self._keepalive = keepalive  # the C arrays must outlive submission

    def wait(self, timeout_ms: int) -> tuple[int, str]:
        rc = lib.fmc_batch_wait(self._ptr, int(timeout_ms))
        return rc, (last_error() if rc < 0 else "")

    def wait_done(self, timeout_ms: int) -> int:
        """``poll`` after waiting up to ``timeout_ms`` for the end; never cancels."""
        return int(lib.fmc_batch_wait_done(self._ptr, int(timeout_ms)))

    def poll(self) -> int:
        """1 done, 0 in progress, negative: failed with that code."""
        return int(lib.fmc_batch_poll(self._ptr))

    def task_status(self, index: int) -> int:
        return int(lib.fmc_batch_task_status(self._ptr, index))

    def cancel(self) -> None:
        """Stop the batch; returns once nothing touches its buffers (its tasks end with the
        timeout code).  Calls sharing a cut connection are sent again by the core."""
        lib.fmc_batch_cancel(self._ptr)

    def cancel_tasks(self, first: int, count: int) -> None:
        """``cancel`` of tasks ``[first, first + count)`` only (one call of a coalesced group)."""
        _raise_for(lib.fmc_batch_cancel_tasks(self._ptr, first, count))


_apply_process_settings()
