"""Engine settings: the one place that reads defaults, Mooncake's environment variables and
flagcx_mc's own, and keyword overrides (which win over both).

Every engine takes an ``EngineConfig`` at creation and hands its parts to what needs them
(the C core gets its options struct, the handshake server its port range and frame cap), so two
engines in one process can differ and nothing below reads the environment.  Mooncake's
variables are honoured as Mooncake reads them: ``MC_TRANSFER_TIMEOUT`` (seconds, at least 5,
default 30, plus one nanosecond per byte moved), ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``,
``MC_HANDSHAKE_MAX_LENGTH``, ``MC_TCP_BIND_ADDRESS``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from .control.codec import DEFAULT_MAX_LENGTH, MAX_MAX_LENGTH, MIN_MAX_LENGTH
from .control.handshake import DEFAULT_RPC_PORT_RANGE
from .errors import InvalidArgumentError
from .metadata.redis_store import redis_db_index
from .metadata.store import StoreSettings

__all__ = ["GPU_COPY_MODES", "PREFAULT_MODES", "EngineConfig", "ProcessSettings", "default_streams",
           "handshake_max_length", "mooncake_transfer_timeout", "prefault_mode", "rpc_port_range"]

log = logging.getLogger(__name__)

# How GPU blocks are staged through pinned host memory for TCP (fmc_options.gpu_copy): the copy
# kernel for scatters into GPU memory of runs under 32 KiB and gathers out of it under 16 KiB,
# the driver's batched copy for longer ones (auto), the kernel for every run (kernel), the
# driver's batched copy (batch), one copy per run (single).  Runs of
# adjacent blocks are one copy in every mode.
GPU_COPY_MODES = ("auto", "kernel", "batch", "single")


def _env_parsed(name: str, parse: Callable[[str], Any], expected: str) -> Any:
    """``parse`` of a variable's value; ``None`` when unset, empty, or refused by ``parse``
    (then logged with what was ``expected``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return parse(raw)
    except (ValueError, InvalidArgumentError):
        log.warning("ignoring %s=%r: %s", name, raw, expected)
        return None


def _env_number(name: str, kind: Callable[[str], Any] = float) -> Any:
    return _env_parsed(name, kind, "not a number")


def _env_clamped(name: str, low: int, high: int) -> int | None:
    """An integer variable brought into [low, high], as the core always read these."""
    value = _env_number(name, int)
    return None if value is None else min(high, max(low, int(value)))  # an int already (kind=int)


def mooncake_transfer_timeout() -> float:
    """Seconds, as Mooncake derives it from MC_TRANSFER_TIMEOUT: max(5, value), default 30."""
    value = _env_number("MC_TRANSFER_TIMEOUT", int)
    return float(max(5, value)) if value is not None else 30.0


# Linux's default ephemeral range; Mooncake refuses RPC ranges that touch it so that a random
# handshake port cannot collide with outgoing connections.
_EPHEMERAL_LOW = 32768
_EPHEMERAL_HIGH = 60999


def _port_from_env(primary: str, legacy: str, default: int) -> int:
    for name in (primary, legacy):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value.strip())
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return default


def rpc_port_range() -> tuple[int, int]:
    """The inclusive range random handshake ports are drawn from, as Mooncake reads it.

    ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (each falling back to the legacy
    ``MC_MIN_PRC_PORT``/``MC_MAX_PRC_PORT`` spelling), default 15000..17000.  A value that is
    not an int, is outside 1024..65535, inverts the range or overlaps the ephemeral range
    32768..60999 makes the whole range fall back to the default.
    """
    low, high = DEFAULT_RPC_PORT_RANGE
    try:
        lo = _port_from_env("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT", low)
        hi = _port_from_env("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT", high)
        _check_rpc_port_range(lo, hi)
    except ValueError as exc:
        log.warning("ignoring RPC port range from environment (%s); using %d..%d", exc, low, high)
        return low, high
    return lo, hi


def _check_rpc_port_range(lo: int, hi: int) -> None:
    if not (1024 <= lo <= 65535 and 1024 <= hi <= 65535):
        raise ValueError(f"range {lo}..{hi} is outside 1024..65535")
    if lo > hi:
        raise ValueError(f"minimum {lo} is above maximum {hi}")
    if lo <= _EPHEMERAL_HIGH and hi >= _EPHEMERAL_LOW:
        raise ValueError(f"range {lo}..{hi} overlaps the ephemeral ports {_EPHEMERAL_LOW}..{_EPHEMERAL_HIGH}")


def handshake_max_length() -> int:
    """``MC_HANDSHAKE_MAX_LENGTH`` (bytes), clamped to 1 MiB..128 MiB like Mooncake; unset or
    unparsable gives 1 MiB."""
    raw = os.environ.get("MC_HANDSHAKE_MAX_LENGTH")
    if raw is None:
        return DEFAULT_MAX_LENGTH
    try:
        value = int(raw.strip())
    except ValueError:
        log.warning("ignoring MC_HANDSHAKE_MAX_LENGTH=%r: not an integer", raw)
        return DEFAULT_MAX_LENGTH
    return min(max(value, MIN_MAX_LENGTH), MAX_MAX_LENGTH)


def _env_flag(name: str) -> bool | None:
    """A switch: ``0`` (or anything starting with it), ``false``, ``no`` or ``off`` turns it off,
    any other value on; ``None`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    return not (value.startswith("0") or value in ("false", "no", "off"))


PREFAULT_MODES = ("off", "touched", "all")


def prefault_mode(value: object) -> str:
    """The prefault setting as one of ``PREFAULT_MODES``.

    ``"touched"`` (also ``True``, ``1``, ``on``): huge pages for future faults, and pages touched
    before registration collapsed into huge pages; commits nothing.  ``"all"`` (also ``2``): that,
    and the whole region faulted in at registration (commits it).  ``"off"`` (also ``False``,
    ``0``): neither."""
    if isinstance(value, bool):
        return "touched" if value else "off"
    text = str(value).strip().lower() if isinstance(value, (int, str)) else None
    aliases = {"1": "touched", "true": "touched", "yes": "touched", "on": "touched",
               "0": "off", "false": "off", "no": "off", "2": "all"}
    mode = aliases.get(text, text) if text is not None else None
    if mode not in PREFAULT_MODES:
        raise InvalidArgumentError(f"prefault must be one of {', '.join(PREFAULT_MODES)} (or 1/0), not {value!r}")
    return mode


def _env_prefault(name: str) -> str | None:
    """``prefault_mode`` of a variable; ``None`` when unset, empty or not a mode (warned)."""
    return _env_parsed(name, prefault_mode, f"not one of {', '.join(PREFAULT_MODES)} (or 1/0)")


_CC_DIR = "/proc/sys/net/ipv4"
LOCAL_CC_DEFAULT = "reno"  # what the core uses within this host when FLAGCX_MC_LOCAL_CC is unset


def _kernel_tcp_setting(name: str) -> str | None:
    """A /proc/sys/net/ipv4 value, or None where there is none (not Linux, no procfs)."""
    try:
        with open(os.path.join(_CC_DIR, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def host_congestion_control() -> str | None:
    """The host's default TCP congestion control (what connections to other hosts use)."""
    return _kernel_tcp_setting("tcp_congestion_control")


def local_congestion_control() -> str | None:
    """The congestion control the core asks for on connections within this host."""
    return os.environ.get("FLAGCX_MC_LOCAL_CC", LOCAL_CC_DEFAULT) or host_congestion_control()


def check_local_congestion_control(name: str | None = None) -> str | None:
    """Why FLAGCX_MC_LOCAL_CC (or the congestion control `name`) cannot take effect, or None.

    The core sets it on each connection within this host and ignores a refusal (the connection
    then keeps the host's default), so a misspelt or unavailable name is reported here, where it
    can be logged.
    """
    if name is None:
        name = os.environ.get("FLAGCX_MC_LOCAL_CC")
    if not name:
        return None
    available_raw = _kernel_tcp_setting("tcp_available_congestion_control")
    allowed_raw = _kernel_tcp_setting("tcp_allowed_congestion_control")
    if available_raw is None or allowed_raw is None:
        return None  # nothing to check against
    available, allowed = available_raw.split(), allowed_raw.split()
    if name not in available:
        return f"FLAGCX_MC_LOCAL_CC={name!r} is not an available congestion control ({' '.join(available)})"
    if name not in allowed and os.geteuid() != 0:
        return f"FLAGCX_MC_LOCAL_CC={name!r} is not allowed to unprivileged processes ({' '.join(allowed)})"
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), or the machine's where that is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_streams() -> int:
    """Data connections per peer: half the CPUs this process may run on, from 4 up to 8.

    On a target each stream's bytes are received by one thread (and on an initiator each
    stream's read answers), so streams are how a transfer uses cores: on a 16-core host, 8
    streams moved 1.3-2.2x the bytes of 4 for blocks of 16 KiB and more; 16 added little more
    while doubling the threads per peer.  Two cores still get 4: fewer left idle gaps.
    """
    return min(8, max(4, usable_cpus() // 2))


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """Settings of the whole process rather than of one engine, handed to the core once, when
    the binding is imported: ``FLAGCX_MC_LIBCUDA`` (the CUDA driver library to load instead of
    ``libcuda.so.1``), ``FMC_TRACE_FILE`` and ``FMC_TRACE_EVENTS`` (where a core built with
    ``-DFMC_TRACE`` writes its event trace at exit, ``<file>.<pid>``, and how many events it
    keeps; ignored by other builds), ``FLAGCX_MC_SERVE_THREADS`` (the most threads that serve
    inbound data connections, shared by every engine of the process) and
    ``FLAGCX_MC_IO_THREADS`` (the most threads that run the send and receive sides of every
    engine's outbound streams, not counting those waiting on a stalled peer).  For both, 0 or
    unset: twice the CPUs the process may use, at least 4, and at least 8 while the process has at
    most four connections on that side (one peer's streams)."""

    cuda_driver: str | None = None
    trace_file: str | None = None
    trace_events: int = 0  # 0: the core's default (1M)
    serve_threads: int = 0  # 0: the core's default
    io_threads: int = 0  # 0: the core's default

    @classmethod
    def from_env(cls) -> ProcessSettings:
        events = _env_number("FMC_TRACE_EVENTS", int)
        return cls(cuda_driver=os.environ.get("FLAGCX_MC_LIBCUDA") or None,
                   trace_file=os.environ.get("FMC_TRACE_FILE") or None,
                   trace_events=events if events is not None and events > 0 else 0,
                   serve_threads=_thread_cap("FLAGCX_MC_SERVE_THREADS"),
                   io_threads=_thread_cap("FLAGCX_MC_IO_THREADS"))


def _thread_cap(name: str) -> int:
    """A pool's cap from the environment: 0 (the core's default) unless a positive number."""
    n = _env_number(name, int)
    return min(4096, int(n)) if n is not None and n > 0 else 0


# TCP_RTO_MIN_US and TCP_DELACK_MAX_US: Linux takes 1 ms (rounded up to its timer tick, and
# refused below about one tick) to 200 ms, its default floor.
TCP_TIMER_MIN_US = 1000
TCP_TIMER_MAX_US = 200_000


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine; ``from_env`` applies the environment, then keyword overrides."""

    transfer_timeout: float = 30.0       # seconds, before the per-byte allowance
    handshake_timeout: float = 5.0       # seconds for one handshake round trip or data connect
    idle_session_timeout: float = 120.0  # seconds unused after which a session's connections close; 0: never
    streams_per_peer: int = dataclasses.field(default_factory=default_streams)  # data connections per peer
    stream_budget: int = 0               # data connections of all open sessions together; 0: 4 x CPUs (see streams_for)
    slice_size: int = 1 << 20            # bytes per wire request; tasks are cut to this
    wait_threads: int = 64               # executor threads that wait for completions (async API)
    secret: bytes | None = dataclasses.field(default=None, repr=False)  # shared secret (auth.py)
    transport: str = "auto"              # auto: same-host copies where possible, else TCP; or tcp / same-host
    rpc_port_range: tuple[int, int] = DEFAULT_RPC_PORT_RANGE  # handshake ports drawn from (inclusive)
    data_port_range: tuple[int, int] | None = None  # the data listener's; None: rpc_port_range, as Mooncake
    handshake_max_length: int = DEFAULT_MAX_LENGTH  # largest handshake frame sent or accepted, bytes
    advertise_host: str | None = None  # host peers reach us at with a metadata server (MC_TCP_BIND_ADDRESS)
    accept_mooncake_wire: bool = True    # serve initiators speaking Mooncake's TCP framing (no authentication)
    # Metadata servers (Mooncake's variables):
    metadata_cluster_id: str = ""        # MC_METADATA_CLUSTER_ID: prefixes every key
    metadata_http_token: str | None = dataclasses.field(default=None, repr=False)  # MC_METADATA_HTTP_TOKEN
    redis_username: str | None = None    # MC_REDIS_USERNAME (with the password only)
    redis_password: str | None = dataclasses.field(default=None, repr=False)  # MC_REDIS_PASSWORD
    redis_db_index: int = 0              # MC_REDIS_DB_INDEX (0..255; anything else warns and gives 0)
    # Settings of the C core, per engine (fmc_options):
    local_cc: str = LOCAL_CC_DEFAULT     # congestion control within this host; "" keeps the host's default
    prefault: str = "touched"            # registration and huge pages: touched, all or off (prefault_mode)
    vectors: bool = True                 # send runs of small slices as vector requests where targets take them
    spin_us: int = 30                    # poll this long (µs) before sleeping after small transfers; 0: never
    copy_threads: int = 0                # threads copying one large same-host call; 0: this process's CPUs (at most 4)
    zerocopy: bool = True                # vmsplice + splice for large write payloads and read answers
    gpu_copy: str = "auto"               # staging scattered GPU blocks for TCP: auto, kernel, batch or single
    gpu_staging: int = 64 << 20          # bytes of pinned staging chunks GPU memory crosses TCP through
    rto_min_us: int = 5000               # TCP_RTO_MIN_US of data connections (Linux 6.15+); 0: the kernel's 200 ms
    delack_max_us: int = 5000            # TCP_DELACK_MAX_US of data connections (Linux 6.15+); 0: the kernel's

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefault", prefault_mode(self.prefault))  # True/False/1/0 accepted too

    @classmethod
    def from_env(cls, **overrides) -> EngineConfig:
        values: dict = dict(
            transfer_timeout=mooncake_transfer_timeout(),
            rpc_port_range=rpc_port_range(),
            handshake_max_length=handshake_max_length(),
        )
        own = {
            "transfer_timeout": _env_number("FLAGCX_MC_TRANSFER_TIMEOUT"),
            "handshake_timeout": _env_number("FLAGCX_MC_HANDSHAKE_TIMEOUT"),
            "idle_session_timeout": _env_number("FLAGCX_MC_IDLE_SESSION_TIMEOUT"),
            "streams_per_peer": _env_number("FLAGCX_MC_STREAMS", int),
            "stream_budget": _env_number("FLAGCX_MC_STREAM_BUDGET", int),
            "slice_size": _env_number("FLAGCX_MC_SLICE_SIZE", int),
            "wait_threads": _env_number("FLAGCX_MC_WAIT_THREADS", int),
            "transport": os.environ.get("FLAGCX_MC_TRANSPORT") or None,
            "advertise_host": os.environ.get("MC_TCP_BIND_ADDRESS", "").strip() or None,
            "accept_mooncake_wire": _env_flag("FLAGCX_MC_ACCEPT_MOONCAKE_WIRE"),
            "metadata_cluster_id": os.environ.get("MC_METADATA_CLUSTER_ID") or None,
            "metadata_http_token": os.environ.get("MC_METADATA_HTTP_TOKEN") or None,
            "redis_username": os.environ.get("MC_REDIS_USERNAME") or None,
            "redis_password": os.environ.get("MC_REDIS_PASSWORD") or None,
            "redis_db_index": redis_db_index(os.environ.get("MC_REDIS_DB_INDEX")) or None,
            "local_cc": os.environ.get("FLAGCX_MC_LOCAL_CC"),  # "" is a value: the host's default
            "prefault": _env_prefault("FLAGCX_MC_PREFAULT"),
            "vectors": _env_flag("FLAGCX_MC_VECTORS"),
            "spin_us": _env_clamped("FLAGCX_MC_SPIN_US", 0, 10000),
            "copy_threads": _env_clamped("FLAGCX_MC_COPY_THREADS", 1, 4),
            "zerocopy": _env_flag("FLAGCX_MC_ZEROCOPY"),
            "gpu_copy": os.environ.get("FLAGCX_MC_GPU_COPY") or None,
            "gpu_staging": _env_number("FLAGCX_MC_GPU_STAGING", int),
            "rto_min_us": _env_number("FLAGCX_MC_RTO_MIN_US", int),
            "delack_max_us": _env_number("FLAGCX_MC_DELACK_MAX_US", int),
        }
        values.update({k: v for k, v in own.items() if v is not None})
        env_secret = os.environ.get("FLAGCX_MC_SECRET")
        if env_secret:
            values["secret"] = env_secret
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values.get("secret"), str):
            values["secret"] = values["secret"].encode()
        for name in ("rpc_port_range", "data_port_range"):
            if isinstance(values.get(name), list):  # JSON has no tuples
                values[name] = tuple(values[name])
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidArgumentError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        config = cls(**values)
        config.validate()
        problem = check_local_congestion_control(config.local_cc)
        if problem:
            log.warning("%s; connections within this host keep the host's default", problem)
        return config

    def streams_for(self, in_use: int) -> int:
        """Data connections for a session opened while the engine's other sessions hold ``in_use``:
        half of what is left of ``stream_budget`` (4 x the CPUs this process may use by default),
        at most ``streams_per_peer`` and at least one.  A process that talks to a few peers gives
        each all its streams (streams are how one peer's transfer uses the cores); one that talks
        to hundreds gives each one, so that its connections stay within about the budget plus
        one per peer, not ``streams_per_peer`` per peer."""
        budget = self.stream_budget or 4 * usable_cpus()
        return max(1, min(self.streams_per_peer, (budget - in_use) // 2))

    def validate(self) -> None:
        if not self.transfer_timeout > 0 or not self.handshake_timeout > 0:
            raise InvalidArgumentError("timeouts must be positive")
        if not (isinstance(self.idle_session_timeout, (int, float)) and self.idle_session_timeout >= 0):
            raise InvalidArgumentError("idle_session_timeout must be 0 (never) or a positive number of seconds")
        if not 1 <= self.streams_per_peer <= 64:
            raise InvalidArgumentError("streams_per_peer must be in 1..64")
        if type(self.stream_budget) is not int or self.stream_budget < 0:
            raise InvalidArgumentError("stream_budget must be 0 (4 x the CPUs) or a positive number of connections")
        if not (4 << 10) <= self.slice_size <= (64 << 20):
            raise InvalidArgumentError("slice_size must be in [4 KiB, 64 MiB]")
        if self.wait_threads < 1:
            raise InvalidArgumentError("wait_threads must be positive")
        if self.transport not in ("auto", "tcp", "same-host"):
            raise InvalidArgumentError("transport must be 'auto', 'tcp' or 'same-host'")
        if not isinstance(self.local_cc, str) or len(self.local_cc.encode()) > 15:
            raise InvalidArgumentError("local_cc must be a congestion control name of up to 15 bytes")
        if not 0 <= self.spin_us <= 10000:
            raise InvalidArgumentError("spin_us must be in 0..10000")
        if not 0 <= self.copy_threads <= 4:
            raise InvalidArgumentError("copy_threads must be in 0..4 (0: the CPUs this process may run on)")
        if self.gpu_copy not in GPU_COPY_MODES:
            raise InvalidArgumentError(f"gpu_copy must be one of {', '.join(GPU_COPY_MODES)}, not {self.gpu_copy!r}")
        if not (4 << 20) <= self.gpu_staging <= (16 << 30):
            raise InvalidArgumentError("gpu_staging must be in [4 MiB, 16 GiB]")
        for name in ("rto_min_us", "delack_max_us"):
            value = getattr(self, name)
            if type(value) is not int or not (value == 0 or TCP_TIMER_MIN_US <= value <= TCP_TIMER_MAX_US):
                raise InvalidArgumentError(
                    f"{name} must be 0 (the kernel's) or {TCP_TIMER_MIN_US}..{TCP_TIMER_MAX_US} microseconds, "
                    f"not {value!r}")
        if self.secret is not None and not (isinstance(self.secret, bytes) and 1 <= len(self.secret) <= 256):
            raise InvalidArgumentError("secret must be 1 to 256 bytes")
        for name in ("rpc_port_range", "data_port_range"):
            ports = getattr(self, name)
            if ports is None and name == "data_port_range":
                continue
            if not (isinstance(ports, tuple) and len(ports) == 2 and all(type(p) is int for p in ports)):
                raise InvalidArgumentError(f"{name} must be a (low, high) pair of ints, not {ports!r}")
            if not 1 <= ports[0] <= ports[1] <= 65535:
                raise InvalidArgumentError(f"{name} {ports[0]}..{ports[1]} is not a range within 1..65535")
        if not MIN_MAX_LENGTH <= self.handshake_max_length <= MAX_MAX_LENGTH:
            raise InvalidArgumentError(
                f"handshake_max_length must be in [{MIN_MAX_LENGTH}, {MAX_MAX_LENGTH}], "
                f"not {self.handshake_max_length}")
        if not isinstance(self.accept_mooncake_wire, bool):
            raise InvalidArgumentError("accept_mooncake_wire must be True or False")

    def store_settings(self) -> StoreSettings:
        """What this engine's metadata store is told (credentials, database, key prefix)."""
        return StoreSettings(cluster_id=self.metadata_cluster_id, http_token=self.metadata_http_token,
                             redis_username=self.redis_username, redis_password=self.redis_password,
                             redis_db_index=self.redis_db_index)

    def timeout_for(self, total_bytes: int) -> float:
        """Deadline of one transfer call: Mooncake's timeout plus 1 ns per byte."""
        return self.transfer_timeout + total_bytes * 1e-9
