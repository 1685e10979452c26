"""Side-channel ports that never collide, and the bootstrap registry that publishes them.

The scheme (default).  Every worker binds its listener with port ``*``: the kernel hands out a
free port, so no two workers on one host can get the same one, whatever their data-, pipeline-
and tensor-parallel ranks and whichever instance (prefill or decode) they belong to.  Each worker
then registers ``WorkerKey(instance, dp, pp, tp) -> tcp://host:port`` in its instance's
``BootstrapRegistry`` (itself bound to a free port; its address is the one thing passed around,
as vLLM passes ``remote_bootstrap_addr``), and decode workers look the table up.

Fixed ports, for deployments that must open them in a firewall: ``fixed_port`` gives worker
(dp, pp, tp) the port ``base + (dp * pp_size + pp) * tp_size + tp``, so every rank of an instance
has its own port, pipeline stages included (``base + tp_rank`` gives both stages of PP 2 the same
port, the collision of vLLM's Mooncake and NIXL connectors); instances sharing a host need
disjoint ``[base, base + port_span(...))`` ranges, which ``check_disjoint`` verifies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from ..errors import FlagcxMcError, InvalidArgumentError
from .messages import (
    Ack,
    ErrorReply,
    Lookup,
    MessageError,
    Register,
    WorkerKey,
    Workers,
    decode,
    encode,
    new_id,
)

__all__ = [
    "WorkerKey",
    "RegistryError",
    "fixed_port",
    "port_span",
    "check_disjoint",
    "tcp_endpoint",
    "bind_free",
    "BootstrapRegistry",
    "register_worker",
    "lookup_workers",
]

log = logging.getLogger(__name__)

_POLL_INTERVAL = 0.05


class RegistryError(FlagcxMcError):
    """The bootstrap registry refused a request, or did not answer in time."""


def port_span(dp_size: int, pp_size: int, tp_size: int) -> int:
    """Ports one instance uses from its base in the fixed scheme."""
    for name, value in (("dp_size", dp_size), ("pp_size", pp_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
    return dp_size * pp_size * tp_size


def fixed_port(base: int, dp: int, pp: int, tp: int, *, pp_size: int, tp_size: int, dp_size: int = 1 << 16) -> int:
    """Port of worker (dp, pp, tp) in the fixed scheme: ``base + (dp * pp_size + pp) * tp_size + tp``.

    Raises:
        InvalidArgumentError: a rank outside its group, or a port outside 1024..65535.
    """
    port_span(dp_size, pp_size, tp_size)
    for name, rank, size in (("dp", dp, dp_size), ("pp", pp, pp_size), ("tp", tp, tp_size)):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidArgumentError(f"{name} rank {rank!r} is outside 0..{size - 1}")
    port = base + (dp * pp_size + pp) * tp_size + tp
    if not 1024 <= base <= port <= 65535:
        raise InvalidArgumentError(f"port {port} (base {base}) is outside 1024..65535")
    return port


def check_disjoint(ranges: Sequence[tuple[int, int]]) -> None:
    """Check that fixed-port ranges ``(base, span)`` of instances sharing a host do not overlap.

    Raises:
        InvalidArgumentError: two ranges overlap.
    """
    ordered = sorted(ranges)
    for (b0, n0), (b1, n1) in zip(ordered, ordered[1:], strict=False):  # neighbours
        if b1 < b0 + n0:
            raise InvalidArgumentError(f"ports {b0}..{b0 + n0 - 1} and {b1}..{b1 + n1 - 1} overlap")


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def bind_free(sock: zmq.Socket, host: str = "127.0.0.1", advertise: str | None = None) -> str:
    """Bind ``sock`` to a port the kernel picks on ``host``; return the endpoint peers should dial.

    Args:
        host: interface to bind (``0.0.0.0`` for all).
        advertise: host name or address to publish instead of ``host`` (needed with ``0.0.0.0``).
    """
    bare = host.strip("[]")
    if ":" in bare:
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(tcp_endpoint(bare, "*"))
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = int(bound.rsplit(":", 1)[1])
    return tcp_endpoint((advertise or bare).strip("[]"), port)


def bound_router(ctx: zmq.asyncio.Context, host: str, advertise: str | None, max_message: int,
                 configure: Callable[[zmq.Socket], None] = lambda sock: None) -> tuple[zmq.asyncio.Socket, str]:
    """A ROUTER socket (linger 0, messages capped at ``max_message`` bytes, then ``configure``)
    bound to a free port on ``host``, and the endpoint to publish; closed again if any step fails."""
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        configure(sock)
        return sock, bind_free(sock, host, advertise)
    except BaseException:
        sock.close(0)
        raise


class BootstrapRegistry:
    """A small table of worker endpoints, served over ZMQ (one ROUTER socket).

    A worker registering again under the same key (a restart) replaces its entry; an endpoint
    already held by another key is refused, since two live workers cannot share one.
    """

    def __init__(self, *, context: zmq.asyncio.Context | None = None) -> None:
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._table: dict[WorkerKey, str] = {}
        self.endpoint = ""

    async def start(self, host: str = "127.0.0.1", advertise: str | None = None) -> str:
        """Bind to a free port on ``host`` and serve; returns the registry's endpoint."""
        self._sock, self.endpoint = bound_router(self._ctx, host, advertise, 1 << 20)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        return self.endpoint

    @property
    def table(self) -> dict[WorkerKey, str]:
        return dict(self._table)

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            reply = self._answer(frames[-1]) if len(frames) == 2 else ErrorReply(None, "expected one frame")
            try:
                await self._sock.send_multipart([frames[0], encode(reply)])
            except zmq.ZMQError as exc:  # the asker's timeout covers it; keep serving the others
                log.warning("registry %s: could not answer: %s", self.endpoint, exc)

    def _answer(self, payload: bytes):
        try:
            msg = decode(payload)
        except MessageError as exc:
            return ErrorReply(exc.msg_id, exc.reason)
        if isinstance(msg, Register):
            for key, endpoint in self._table.items():
                if endpoint == msg.endpoint and key != msg.worker:
                    return ErrorReply(msg.msg_id, f"endpoint {endpoint} is already registered by {key}")
            self._table[msg.worker] = msg.endpoint
            log.info("registry: %s -> %s", msg.worker, msg.endpoint)
            return Ack(msg.msg_id)
        if isinstance(msg, Lookup):
            found = sorted((k for k in self._table if k.instance == msg.instance), key=lambda k: (k.dp, k.pp, k.tp))
            return Workers(msg.msg_id, tuple((k, self._table[k]) for k in found))
        return ErrorReply(msg.msg_id, f"a registry does not answer {msg.type!r} messages")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._own_context:
            self._ctx.destroy(0)

    async def __aenter__(self) -> BootstrapRegistry:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Client:
    """One DEALER socket to a registry, for one caller's sequence of requests."""

    def __init__(self, registry: str, context: zmq.asyncio.Context | None) -> None:
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        self._sock.connect(registry)
        self._registry = registry

    async def ask(self, msg, timeout: float):
        await self._sock.send(encode(msg))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._sock.poll(remaining * 1000):  # flags default to POLLIN
                raise RegistryError(f"registry {self._registry} did not answer within {timeout} s")
            try:
                reply = decode(await self._sock.recv())
            except MessageError as exc:
                raise RegistryError(f"unreadable reply from registry {self._registry}: {exc}") from None
            if reply.msg_id != msg.msg_id:
                continue  # the answer to an earlier request that timed out
            if isinstance(reply, ErrorReply):
                raise RegistryError(f"registry {self._registry} refused: {reply.reason}")
            return reply

    def close(self) -> None:
        self._sock.close(0)
        if self._own_context:
            self._ctx.destroy(0)


async def register_worker(registry: str, worker: WorkerKey, endpoint: str, *, timeout: float = 10.0,
                          context: zmq.asyncio.Context | None = None) -> None:
    """Publish ``worker``'s listener ``endpoint`` in the registry at ``registry``.

    Raises:
        RegistryError: refused (endpoint held by another worker) or no answer within ``timeout``.
    """
    client = _Client(registry, context)
    try:
        reply = await client.ask(Register(new_id(), worker, endpoint), timeout)
        if not isinstance(reply, Ack):
            raise RegistryError(f"unexpected {reply.type!r} reply to register")
    finally:
        client.close()


async def lookup_workers(registry: str, instance: str, *, expect: int = 0, timeout: float = 10.0,
                         context: zmq.asyncio.Context | None = None) -> dict[WorkerKey, str]:
    """The endpoints ``instance``'s workers registered, waiting until at least ``expect`` are there.

    Raises:
        RegistryError: fewer than ``expect`` workers within ``timeout``, or no answer.
    """
    client = _Client(registry, context)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    table: dict[WorkerKey, str] | None = None

    def too_few() -> RegistryError:
        return RegistryError(f"{len(table or {})} of {expect} workers of {instance!r} registered within {timeout} s")

    try:
        while True:
            if table is not None and loop.time() >= deadline:
                raise too_few()  # the registry answered before: the time ran out waiting for workers
            try:
                reply = await client.ask(Lookup(new_id(), instance), max(deadline - loop.time(), 0.001))
            except RegistryError:
                if table is None:
                    raise  # it never answered
                raise too_few() from None
            if not isinstance(reply, Workers):
                raise RegistryError(f"unexpected {reply.type!r} reply to lookup")
            table = dict(reply.workers)
            if len(table) >= expect:
                return table
            await asyncio.sleep(_POLL_INTERVAL)
    finally:
        client.close()
