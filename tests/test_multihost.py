"""Engines on separate "hosts" (network namespaces joined by a bridge, see tests/support/netns.py): transfers
across hosts, 1% packet loss, added delay, a link cut mid-transfer, and the bind-address rule.

Every transfer is verified by content; a transfer that reports success with one wrong byte fails
the test.  All traffic stays inside the namespaces these tests create.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import select
import signal
import socket
import threading
import time

import pytest
from support.netns import Host, enter_netns, require_tool, run_tool

from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.control.codec import MessageType
from flagcx_mc.control.handshake import request

MIB = 1 << 20
ECONN, ETIMEOUT = -102, -105
NOTHING_THERE_V6 = {"refused", "EADDRNOTAVAIL", "ENETUNREACH", "EAFNOSUPPORT"}  # the last three: no IPv6


def rpc_port(node: NodeProcess) -> int:
    return int(node.session.rsplit(":", 1)[1])


def data_port(via: Host, addr: str, port: int) -> int:
    """The data port a peer advertises in its Metadata reply, asked from host ``via``."""
    reply = via.call(lambda: asyncio.run(request(addr, port, MessageType.METADATA, {}, timeout=5.0)))
    return int(reply["tcp_data_port"])


def post(node: NodeProcess, cmd: str, **kwargs) -> None:
    """Send a command to a node without waiting for its answer."""
    node.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
    node.proc.stdin.flush()


def answer(node: NodeProcess, timeout: float) -> dict:
    """The answer to a command sent with ``post``."""
    ready, _, _ = select.select([node.proc.stdout], [], [], timeout)
    assert ready, f"no answer within {timeout} s"
    return json.loads(node.proc.stdout.readline())


def write_and_check(src: NodeProcess, dst: NodeProcess, session: str, src_off: int, dst_off: int,
                    length: int, src_region: int = 0, dst_region: int = 0) -> dict:
    """Fill ``src`` with random bytes, write them to ``dst``; a success must be byte-exact."""
    digest = src.call("fill", region=src_region, offset=src_off, length=length)["digest"]
    reply = src.call("transfer", op="write", target=session,
                     items=[[src_region, src_off, dst.addr(dst_region, dst_off), length]])
    if reply["rc"] == 0:
        got = dst.call("digest", region=dst_region, offset=dst_off, length=length)["digest"]
        assert got == digest, "a write reported success but the target holds other bytes"
    return reply


def read_and_check(reader: NodeProcess, owner: NodeProcess, session: str, reader_off: int, owner_off: int,
                   length: int, reader_region: int = 0, owner_region: int = 0) -> dict:
    """Fill ``owner`` with random bytes and read them; a success must be byte-exact."""
    digest = owner.call("fill", region=owner_region, offset=owner_off, length=length)["digest"]
    reader.call("set", region=reader_region, byte=0, offset=reader_off, length=length)
    reply = reader.call("transfer", op="read", target=session,
                        items=[[reader_region, reader_off, owner.addr(owner_region, owner_off), length]])
    if reply["rc"] == 0:
        got = reader.call("digest", region=reader_region, offset=reader_off, length=length)["digest"]
        assert got == digest, "a read reported success but returned other bytes"
    return reply


class DelayProxy:
    """A user-space TCP proxy inside one host: each of ``ports`` on ``listen_addr`` is forwarded
    to the same port on ``target_addr``, every chunk held ``delay`` seconds in each direction."""

    _HIGH_WATER = 8 * MIB  # bytes a direction may hold before it stops reading

    def __init__(self, host: Host, listen_addr: str, target_addr: str, ports: list[int], delay: float) -> None:
        self.host, self.listen_addr, self.target_addr = host, listen_addr, target_addr
        self.ports, self.delay = ports, delay
        self.connections = 0
        self._answer_budget: int | None = None  # bytes the target's side may still pass; None: no limit
        self._budget_changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="delay-proxy", daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"proxy did not start: {self._error!r}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "proxy thread did not stop"

    def _main(self) -> None:
        try:
            enter_netns(self.host.ns)
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__ / seen as a failed test
            self._error = exc
            self._ready.set()

    def hold_answers_after(self, nbytes: int | None) -> None:
        """From now on pass only ``nbytes`` more bytes from the target's side, then hold the rest
        (``None``: pass everything again, held bytes first)."""
        assert self._loop is not None

        def change() -> None:
            self._answer_budget = nbytes
            assert self._budget_changed is not None
            self._budget_changed.set()

        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (change(), done.set()))
        assert done.wait(5)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._budget_changed = asyncio.Event()
        servers = [await asyncio.start_server(lambda r, w, p=port: self._forward(r, w, p), self.listen_addr, port)
                   for port in self.ports]
        self._ready.set()
        await self._stop.wait()
        for server in servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in servers:
            await server.wait_closed()

    async def _forward(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, port: int) -> None:
        self._tasks.add(asyncio.current_task())
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(self.target_addr, port)
        except OSError:
            client_w.transport.abort()
            return
        try:
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w, answers=True))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (client_w, server_w):
                w.transport.abort()  # one side ended or reset: drop both at once
            self._tasks.discard(asyncio.current_task())

    async def _pass(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write ``data`` on from the target's side, within the answer budget (waiting for more)."""
        while data:
            budget = self._answer_budget
            if budget == 0:
                assert self._budget_changed is not None
                self._budget_changed.clear()
                await self._budget_changed.wait()
                continue
            part = data if budget is None else data[:budget]
            if budget is not None:
                self._answer_budget = budget - len(part)
            writer.write(part)
            await writer.drain()
            data = data[len(part):]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answers: bool = False) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        held = 0
        room = asyncio.Event()
        room.set()

        async def pump_in() -> None:
            nonlocal held
            while True:
                await room.wait()
                data = await reader.read(256 << 10)
                queue.put_nowait((loop.time() + self.delay, data))
                if not data:
                    return
                held += len(data)
                if held > self._HIGH_WATER:
                    room.clear()

        async def pump_out() -> None:
            nonlocal held
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if answers:
                    await self._pass(writer, data)
                else:
                    writer.write(data)
                    await writer.drain()
                held -= len(data)
                if held <= self._HIGH_WATER:
                    room.set()

        await asyncio.gather(pump_in(), pump_out())


# ---------------------------------------------------------------------------------------------


def test_transfers_between_three_hosts_are_byte_exact(make_network):
    net = make_network(3)
    nodes = [net[i].node(regions=[16 * MIB, MIB], config={"transfer_timeout": 10.0}) for i in range(3)]
    try:
        assert [n.session.split(":")[0] for n in nodes] == [h.addr for h in net.hosts]
        target, a, b = nodes
        # Every host writes to and reads from every other one, at odd offsets and sizes.
        for src, dst in itertools.permutations(nodes, 2):
            for size, off in [(1, 3), (4096 + 5, 777), (5 * MIB + 17, 2 * MIB + 1)]:
                assert write_and_check(src, dst, dst.session, off, off + 1, size)["rc"] == 0
                assert read_and_check(src, dst, dst.session, off + 2, off + 3, size)["rc"] == 0
        # A batch that scatters one host's bytes over another, then a third host reads them back.
        digest = a.call("fill", region=0, offset=0, length=8 * MIB)["digest"]
        items = [[0, i * MIB, target.addr(0, (7 - i) * MIB), MIB] for i in range(8)]
        assert a.call("transfer", op="write", target=target.session, items=items)["rc"] == 0
        back = [[0, i * MIB, target.addr(0, (7 - i) * MIB), MIB] for i in range(8)]
        assert b.call("transfer", op="read", target=target.session, items=back)["rc"] == 0
        assert b.call("digest", region=0, offset=0, length=8 * MIB)["digest"] == digest
        for n in nodes:
            assert n.call("guards")["intact"]
            assert n.call("stats")["requests_refused"] == 0
    finally:
        for n in nodes:
            n.close()


def test_one_percent_loss_never_yields_a_wrong_success(make_network):
    require_tool("nft", "nftables")
    net = make_network(2)
    initiator = net[0].node(regions=[8 * MIB], config={"transfer_timeout": 10.0, "handshake_timeout": 5.0})
    target = net[1].node(regions=[8 * MIB])
    table = f"fmc_loss_{os.getpid()}"
    try:
        # Drop 1% of every TCP segment that reaches either host (data one way, acks the other).
        for host in net.hosts:
            host.nft(f"add table inet {table}\n"
                     f"add chain inet {table} input {{ type filter hook input priority 0; policy accept; }}\n"
                     f"add rule inet {table} input meta l4proto tcp numgen random mod 100 == 0 counter drop\n")
        results = []
        for i in range(12):
            size = [4 * MIB, MIB + 3, 6 * MIB][i % 3]
            results.append(write_and_check(initiator, target, target.session, i, 2 * i, size)["rc"])
            results.append(read_and_check(initiator, target, target.session, 3 * i, i, size)["rc"])
        listings = [host.run("nft", "list", "table", "inet", table).stdout for host in net.hosts]
        dropped = sum(int(n) for text in listings for n in re.findall(r"counter packets (\d+)", text))
        assert dropped > 0, "the loss rule dropped nothing: the test proved nothing"
        # Loss this light is TCP's job: everything succeeds (and each success was checked above).
        assert results.count(0) == len(results), results
        for host in net.hosts:
            host.nft(f"delete table inet {table}\n")
            assert table not in host.run("nft", "list", "tables").stdout
        assert target.call("guards")["intact"]
    finally:
        initiator.close()
        target.close()


def test_added_delay_through_a_proxy_is_slower_and_still_exact(make_network):
    net = make_network(3)
    initiator, proxy_host, target_host = net.hosts
    delay = 0.1
    target = target_host.node(regions=[16 * MIB])
    src = initiator.node(regions=[16 * MIB], config={"transfer_timeout": 10.0})
    try:
        port = rpc_port(target)
        ports = [port, data_port(proxy_host, target_host.addr, port)]
        via_proxy = f"{proxy_host.addr}:{port}"  # the proxy answers on the target's own port numbers
        with DelayProxy(proxy_host, proxy_host.addr, target_host.addr, ports, delay) as proxy:
            slow = [write_and_check(src, target, via_proxy, i * MIB, i * MIB + 1, 256 << 10) for i in range(4)]
            slow += [read_and_check(src, target, via_proxy, i * MIB, i * MIB + 2, 256 << 10) for i in range(4, 8)]
            big = write_and_check(src, target, via_proxy, 0, 5, 12 * MIB)
            # The handshake and the data streams went through it (the first with the session, more
            # in the background once the larger calls came).
            assert proxy.connections >= 2
        fast = [write_and_check(src, target, target.session, i * MIB, i * MIB + 1, 256 << 10) for i in range(4)]
        assert all(r["rc"] == 0 for r in slow + fast + [big]), slow + fast + [big]
        # A request and its answer each cross the proxy once: at least two delays per call.
        assert min(r["seconds"] for r in slow) >= 2 * delay
        assert max(r["seconds"] for r in fast) < 2 * delay
        assert target.call("guards")["intact"]
    finally:
        src.close()
        target.close()


Read = tuple[int, int, int]  # reader offset, owner offset, length


def _stalled_read_ends_at_its_deadline(make_network, region: int, config: dict, warm: list[Read], hold: int,
                                       stalled: Read, again: list[Read]) -> None:
    """Through a proxy between initiator and target: ``warm`` reads, then the proxy passes only
    ``hold`` more bytes of answers, so the ``stalled`` read stops midway; it must end with a
    timeout at its deadline, and once the proxy passes everything the ``again`` reads over the
    same streams are byte-exact."""
    timeout = config["transfer_timeout"]
    net = make_network(3)
    initiator, proxy_host, target_host = net.hosts
    target = target_host.node(regions=[region])
    src = initiator.node(regions=[region], config=config)
    try:
        port = rpc_port(target)
        ports = [port, data_port(proxy_host, target_host.addr, port)]
        via_proxy = f"{proxy_host.addr}:{port}"
        with DelayProxy(proxy_host, proxy_host.addr, target_host.addr, ports, 0.0) as proxy:
            for read in warm:
                assert read_and_check(src, target, via_proxy, *read)["rc"] == 0
            proxy.hold_answers_after(hold)
            reply = read_and_check(src, target, via_proxy, *stalled)
            assert reply["rc"] == ETIMEOUT, reply
            assert timeout - 0.2 <= reply["seconds"] <= timeout + 1.0, reply
            proxy.hold_answers_after(None)
            replies = [read_and_check(src, target, via_proxy, *read) for read in again]
            assert all(r["rc"] == 0 for r in replies), replies
        assert target.call("guards")["intact"]
    finally:
        src.close()
        target.close()


def test_a_small_read_whose_answer_stalls_midway_times_out_on_time_and_the_stream_heals(make_network):
    """A synchronous read's caller places a small answer itself as it arrives: when the answer
    stops halfway, the call still ends at its deadline (not when the target's bytes come), the
    stream is cut, and the next reads through it are byte-exact."""
    # The caller polls 10 ms for its answers (spin_us), long enough for the proxy to pass the header.
    config = {"transfer_timeout": 2.0, "streams_per_peer": 1, "spin_us": 10000}
    _stalled_read_ends_at_its_deadline(
        make_network, 16 * MIB, config,
        warm=[(0, 0, 256 << 10)],  # the stream up
        hold=100 << 10,  # the answer's header and part of its payload
        stalled=(MIB, MIB, 256 << 10),
        again=[(i * MIB, i * MIB + 3, 256 << 10) for i in range(2, 6)])


def test_a_bulk_read_whose_answers_stall_midway_times_out_on_time_and_the_streams_heal(make_network):
    """A synchronous read over several streams has its caller place one stream's share itself:
    when the answers stop partway, the call still ends at its deadline with a timeout, and the
    next reads over the same streams are byte-exact."""
    _stalled_read_ends_at_its_deadline(
        make_network, 64 * MIB, {"transfer_timeout": 2.0, "streams_per_peer": 4},
        warm=[(0, 0, 8 * MIB)] * 2,  # the first call has the session connect its other streams
        hold=2 * MIB,  # the streams' first answers begin, and stop partway
        stalled=(0, 0, 32 * MIB),
        again=[(i * MIB, i * 3 * MIB + 5, 8 * MIB) for i in range(3)])


def test_link_cut_mid_transfer_is_an_error_within_the_timeout_and_heals(make_network):
    timeout = 3.0
    net = make_network(2)
    initiator = net[0].node(regions=[64 * MIB], config={"transfer_timeout": timeout, "handshake_timeout": 2.0})
    target = net[1].node(regions=[64 * MIB])
    try:
        assert write_and_check(initiator, target, target.session, 0, 0, MIB)["rc"] == 0
        target.call("set", region=0, byte=0)
        initiator.call("set", region=0, byte=0x11)
        # Freeze the target so that the 64 MiB are certainly still in flight, cut its cable, let
        # it run again: it takes what reached its buffers, then nothing more arrives.
        os.kill(target.pid, signal.SIGSTOP)
        post(initiator, "transfer", op="write", target=target.session, items=[[0, 0, target.addr(0), 64 * MIB]])
        time.sleep(0.3)
        net[1].set_link(False)
        os.kill(target.pid, signal.SIGCONT)
        reply = answer(initiator, timeout + 5)
        assert reply["rc"] in (ETIMEOUT, ECONN), reply
        assert reply["seconds"] <= timeout + 1.0, reply
        landed = target.call("count_byte", region=0, byte=0x11)["count"]
        assert 0 < landed < 64 * MIB, "the cut did not happen mid-transfer"
        # The call is over: rewrite its source; while the link is down calls fail in bounded time.
        initiator.call("set", region=0, byte=0x22)
        start = time.monotonic()
        reply = initiator.call("transfer", op="write", target=target.session, items=[[0, 0, target.addr(0), MIB]])
        assert reply["rc"] < 0 and time.monotonic() - start <= 2.0 + 1.5, reply
        # Plugged back in: the next call opens a new session and is exact; no old byte moved.
        net[1].set_link(True)
        time.sleep(0.5)  # anything still queued somewhere would arrive now
        assert target.call("count_byte", region=0, byte=0x22)["count"] == 0
        assert write_and_check(initiator, target, target.session, 0, 32 * MIB, 8 * MIB)["rc"] == 0
        assert read_and_check(initiator, target, target.session, 16 * MIB, MIB, 8 * MIB)["rc"] == 0
        assert target.call("guards")["intact"]
    finally:
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGCONT)
        initiator.close()
        target.close()


def test_listeners_bind_only_the_given_address(make_network):
    net = make_network(2)
    host, other = net.hosts
    second = f"{host.addr.rsplit('.', 1)[0]}.101"
    host.add_address(f"{second}/24")
    node = host.node(regions=[MIB])
    try:
        ports = {"rpc": rpc_port(node), "data": data_port(other, host.addr, rpc_port(node))}
        # What the engine listens on, per the kernel: the given address and nothing else.
        mine = [(addr, port) for addr, port, pid in host.listening() if pid == node.pid]
        assert sorted(mine) == sorted((host.addr, p) for p in ports.values()), mine
        for what, port in ports.items():
            assert other.connect_status(host.addr, port) == "open", what
            # Not on the host's second address, nor on its loopbacks, from anywhere.
            assert other.connect_status(second, port) == "refused", what
            assert host.connect_status(second, port) == "refused", what
            assert host.connect_status("127.0.0.1", port) == "refused", what
            assert host.connect_status("::1", port) in NOTHING_THERE_V6, what
        # The engine still serves on its address.
        peer = other.node(regions=[MIB])
        try:
            assert write_and_check(peer, node, node.session, 0, 0, MIB)["rc"] == 0
        finally:
            peer.close()
    finally:
        node.close()


def test_a_crashed_initiator_hosts_connections_are_eventually_reaped(make_network):
    """A host that vanishes (no FIN, no RST) leaves connections the kernel keeps probing
    (keepalive, user timeout), so they end instead of holding fds and threads forever."""
    net = make_network(2)
    peer_host, target_host = net.hosts
    target = target_host.node(regions=[MIB])
    initiator = peer_host.node(regions=[MIB])
    try:
        base = target.call("stats")["server_connections"]
        assert write_and_check(initiator, target, target.session, 0, 0, MIB)["rc"] == 0
        time.sleep(0.2)  # acks settle: the connections are idle now
        net.crash(peer_host, [initiator])
        time.sleep(0.5)
        assert target.call("stats")["server_connections"] > base  # nobody told the target
        lines = target_host.run("ss", "-tnoH", "state", "established", "dst", peer_host.addr).stdout.splitlines()
        assert lines, "no connection to the crashed host left"
        # Only a connection the kernel still probes (keepalive) or retransmits on can ever end.
        untimed = [line for line in lines if "timer:(" not in line]
        assert not untimed, f"{len(untimed)} of {len(lines)} connections to a dead host would live forever"
    finally:
        initiator.kill()
        target.close()


# --- congestion control: none within one host, the host's own choice between hosts ------------


def congestion_controls(ss_output: str) -> list[str]:
    """The congestion-control name of each socket in ``ss -tinH`` output (one per socket)."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        known = set(f.read().split()) | {"reno", "cubic", "bbr"}
    return [word for word in ss_output.split() if word in known]


def data_connection_ccs(port: int, run=run_tool, side: str = "sport") -> list[str]:
    """Congestion controls of the established sockets whose ``side`` (sport/dport) is ``port``."""
    return congestion_controls(run("ss", "-tinH", "state", "established", f"( {side} = :{port} )").stdout)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host,local_cc", [("127.0.0.1", None), ("127.0.0.1", ""), ("::1", None)],
                         ids=["default-reno", "kept-host-default", "ipv6-reno"])
def test_connections_within_one_host_run_unpaced(host, local_cc):
    """Loopback data connections use reno (BBR's pacing costs throughput where there is no
    network); FLAGCX_MC_LOCAL_CC="" keeps the host's default. Both ends are checked (the target's
    accepted sockets and the initiator's connected ones), after a verified transfer."""
    require_tool("ss", "iproute2")
    if ":" in host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        host_default = f.read().strip()
    env = {} if local_cc is None else {"FLAGCX_MC_LOCAL_CC": local_cc}
    with NodeProcess(host=host, regions=[4 * MIB], env=env) as target, \
            NodeProcess(host=host, regions=[4 * MIB], env=env) as initiator:
        assert write_and_check(initiator, target, target.session, 0, 0, 4 * MIB)["rc"] == 0
        port = int(asyncio.run(request(host, rpc_port(target), MessageType.METADATA, {},
                                       timeout=5.0))["tcp_data_port"])
        served = data_connection_ccs(port)
        opened = data_connection_ccs(port, side="dport")
    assert len(served) >= 4 and len(opened) == len(served), (served, opened)  # 4 streams per peer
    expected = "reno" if local_cc is None else host_default
    assert set(served) == set(opened) == {expected}, (served, opened)


def test_connections_between_hosts_keep_the_hosts_congestion_control(make_network):
    require_tool("ss", "iproute2")
    net = make_network(2)
    target_host, peer_host = net.hosts
    host_default = target_host.run("cat", "/proc/sys/net/ipv4/tcp_congestion_control").stdout.strip()
    target = target_host.node(regions=[4 * MIB])
    initiator = peer_host.node(regions=[4 * MIB])
    try:
        assert write_and_check(initiator, target, target.session, 0, 0, 4 * MIB)["rc"] == 0
        port = data_port(peer_host, target_host.addr, rpc_port(target))
        served = data_connection_ccs(port, run=target_host.run)
        assert len(served) >= 4 and set(served) == {host_default}, (served, host_default)
    finally:
        initiator.close()
        target.close()


def test_an_unavailable_local_congestion_control_is_reported(monkeypatch, caplog):
    from flagcx_mc.config import EngineConfig, check_local_congestion_control

    monkeypatch.setenv("FLAGCX_MC_LOCAL_CC", "no-such-cc")
    assert "not an available congestion control" in check_local_congestion_control()
    with caplog.at_level("WARNING", logger="flagcx_mc.config"):
        EngineConfig.from_env()
    assert "FLAGCX_MC_LOCAL_CC='no-such-cc'" in caplog.text
    for fine in ("reno", ""):
        monkeypatch.setenv("FLAGCX_MC_LOCAL_CC", fine)
        assert check_local_congestion_control() is None
