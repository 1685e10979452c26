"""Handshake server/client over real sockets on 127.0.0.1, plus netaddr helpers."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from flagcx_mc.config import rpc_port_range
from flagcx_mc.control.codec import FrameDecoder, Message, MessageType, encode_message
from flagcx_mc.control.handshake import HandshakeServer, request
from flagcx_mc.errors import (
    DnsError,
    EndpointError,
    HandshakeRejectedError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    MalformedJsonError,
    PeerConnectionError,
    RemoteProtocolError,
)
from flagcx_mc.net.addresses import format_host_port, numeric_stream_addrinfo, parse_host_port

HOST = "127.0.0.1"
# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = [pytest.mark.timeout(20), pytest.mark.uvloop]


async def echo(msg: Message) -> dict:
    return {"type": int(msg.type), "echo": msg.payload}


async def boom(msg: Message) -> dict:
    raise RuntimeError("handler exploded")


async def hang(msg: Message) -> dict:
    await asyncio.sleep(30)
    return {}


HANDLERS = {
    MessageType.CONNECTION: echo,
    MessageType.METADATA: echo,
    MessageType.NOTIFY: boom,
    MessageType.PROBE: echo,
}


@contextlib.asynccontextmanager
async def serving(handlers=HANDLERS, **kwargs):
    """Run a server; fail if anything reached the loop's exception handler."""
    loop = asyncio.get_running_loop()
    leaked: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: leaked.append(ctx))
    server = HandshakeServer(handlers, **kwargs)
    await server.start(HOST, 0)
    try:
        yield server
    finally:
        await server.close()
        gc.collect()
        await asyncio.sleep(0)
        loop.set_exception_handler(None)
        assert leaked == []
        assert server.connection_count == 0


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    header = await reader.readexactly(8)
    body = await reader.readexactly(int.from_bytes(header, "little"))
    return body[0], body[1:]


async def assert_dropped(reader: asyncio.StreamReader, within: float) -> float:
    """Wait for EOF or reset and return how long it took."""
    start = time.monotonic()
    with contextlib.suppress(ConnectionError):
        data = await asyncio.wait_for(reader.read(1024), within)
        assert data == b""
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def raw_conn(port: int):
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mtype", [MessageType.CONNECTION, MessageType.METADATA, MessageType.PROBE])
async def test_request_reply_each_type(mtype):
    async with serving() as server:
        reply = await request(HOST, server.port, mtype, {"k": [1, 2]})
        assert reply == {"type": int(mtype), "echo": {"k": [1, 2]}}


async def test_reply_type_equals_request_type_on_the_wire():
    async with serving() as server, raw_conn(server.port) as (reader, writer):
        for mtype in (MessageType.PROBE, MessageType.CONNECTION, MessageType.NOTIFY, MessageType.METADATA):
            writer.write(encode_message(mtype, {}))  # several requests on one connection
        for mtype in (MessageType.PROBE, MessageType.CONNECTION, MessageType.NOTIFY, MessageType.METADATA):
            type_byte, _ = await asyncio.wait_for(read_frame(reader), 5)
            assert type_byte == mtype


async def test_half_closed_client_gets_reply_then_eof():
    async with serving() as server, raw_conn(server.port) as (reader, writer):
        writer.write(encode_message(MessageType.METADATA, {"name": "x"}))
        writer.write_eof()  # Mooncake style: one request, then the client waits
        type_byte, body = await asyncio.wait_for(read_frame(reader), 5)
        assert type_byte == MessageType.METADATA and body.endswith(b"\n")
        assert await assert_dropped(reader, 5) < 5


async def test_handler_exception_rejects_and_server_survives(caplog):
    async with serving() as server:
        with pytest.raises(HandshakeRejectedError, match="handler exploded") as info:
            await request(HOST, server.port, MessageType.NOTIFY, {"name": "a", "notify_msg": "m"})
        assert f"{HOST}:{server.port}" in str(info.value)
        assert any("handler failed" in r.getMessage() for r in caplog.records)
        assert (await request(HOST, server.port, MessageType.PROBE, {}))["type"] == 3


async def test_unsupported_type_is_rejected_with_same_type():
    async with serving({MessageType.PROBE: echo}) as server:
        with pytest.raises(HandshakeRejectedError, match="unsupported message type 1"):
            await request(HOST, server.port, MessageType.METADATA, {})


BAD_STREAMS = {
    "garbage": b"\xde\xad\xbe\xef" * 8,
    "zero-length": bytes(8),
    "oversized": (1 << 30).to_bytes(8, "little"),
    "bad-json": (6).to_bytes(8, "little") + b"\x01{nope",
    "json-array": (4).to_bytes(8, "little") + b"\x01[]\n",
    "unknown-type": (4).to_bytes(8, "little") + b"\x09{}\n",
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
async def test_malformed_input_drops_only_that_connection(case, caplog):
    caplog.set_level(logging.WARNING, "flagcx_mc.control.handshake")
    async with serving(max_length=1 << 20) as server:
        async with raw_conn(server.port) as (good_r, good_w):
            async with raw_conn(server.port) as (reader, writer):
                writer.write(BAD_STREAMS[case])
                assert await assert_dropped(reader, 3) < 3
            assert any("dropping" in r.getMessage() for r in caplog.records)
            good_w.write(encode_message(MessageType.PROBE, {}))  # a bystander is unaffected
            assert (await asyncio.wait_for(read_frame(good_r), 5))[0] == MessageType.PROBE
        assert (await request(HOST, server.port, MessageType.PROBE, {}))["type"] == 3


@pytest.mark.parametrize("sent", [b"", (40).to_bytes(8, "little") + b"\x01{"], ids=["idle", "mid-frame"])
async def test_stalled_connection_dropped_after_read_timeout(sent):
    async with serving(read_timeout=0.3) as server, raw_conn(server.port) as (reader, writer):
        writer.write(sent)
        elapsed = await assert_dropped(reader, 3)
        assert 0.2 < elapsed < 2.5
        assert (await request(HOST, server.port, MessageType.PROBE, {}))["type"] == 3


async def test_dribbling_peer_cannot_extend_the_frame_deadline():
    async with serving(read_timeout=0.4) as server, raw_conn(server.port) as (reader, writer):
        start = time.monotonic()
        writer.write((1000).to_bytes(8, "little") + b"\x01")  # a legal header, then a trickle
        with contextlib.suppress(ConnectionError):
            for _ in range(30):  # one byte every 0.1 s: each read is quick, the frame is not
                writer.write(b" ")
                await asyncio.sleep(0.1)
                if reader.at_eof() or reader.exception() is not None:  # closed, or reset (bytes unread)
                    break
        await assert_dropped(reader, 3)
        assert time.monotonic() - start < 2.0


async def _served(reader, writer, mtype=MessageType.PROBE, payload=None) -> None:
    writer.write(encode_message(mtype, payload or {}))
    await asyncio.wait_for(read_frame(reader), 5)


async def test_at_the_cap_a_new_peer_is_served_and_the_idle_connection_gives_way():
    """Connections that hold a slot without useful work cannot lock new peers out."""
    async with serving(max_connections=2) as server:
        async with raw_conn(server.port) as (r1, w1), raw_conn(server.port) as (r2, w2):
            await _served(r1, w1)                                  # only a Probe: no claim to the slot
            await _served(r2, w2, MessageType.METADATA, {"x": 1})  # a served request
            assert server.connection_count == 2
            reply = await request(HOST, server.port, MessageType.METADATA, {"new": True})
            assert reply["echo"] == {"new": True}
            assert await assert_dropped(r1, 3) < 1.0               # the probing one made room
            await _served(r2, w2, MessageType.METADATA, {"x": 2})  # the useful one kept its place


async def test_many_idle_connections_never_keep_a_new_peer_out():
    async with serving(max_connections=8) as server:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(8):
                await stack.enter_async_context(raw_conn(server.port))
            await asyncio.sleep(0.05)
            assert server.connection_count == 8
            for i in range(5):
                assert (await request(HOST, server.port, MessageType.METADATA, {"i": i}))["echo"] == {"i": i}
            assert server.connection_count <= 8


async def test_probes_do_not_hold_a_connection_open():
    """A peer probing every 0.1 s is still closed read_timeout after its last useful request."""
    async with serving(read_timeout=0.5) as server, raw_conn(server.port) as (reader, writer):
        start = time.monotonic()
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            while time.monotonic() - start < 3:
                await _served(reader, writer)
                await asyncio.sleep(0.1)
        assert time.monotonic() - start < 1.5


async def test_close_drops_live_connections_and_busy_handlers():
    async with serving({MessageType.PROBE: hang}) as server:
        port = server.port
        async with raw_conn(port) as (reader, writer):
            writer.write(encode_message(MessageType.PROBE, {}))
            await asyncio.sleep(0.05)
            assert server.connection_count == 1
            start = time.monotonic()
            await server.close()
            assert time.monotonic() - start < 2.0
            assert await assert_dropped(reader, 2) < 2
    with pytest.raises(PeerConnectionError):
        await request(HOST, port, MessageType.PROBE, {}, timeout=2)


async def test_request_to_closed_port_fails_fast():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(PeerConnectionError, match=f"{HOST}:{port}"):
        await request(HOST, port, MessageType.PROBE, {}, timeout=5)
    assert time.monotonic() - start < 2.0


async def test_unknown_host_is_dns_error():
    with pytest.raises(DnsError, match="no-such-host.invalid:1234"):
        await request("no-such-host.invalid", 1234, MessageType.PROBE, {}, timeout=10)


async def test_request_times_out_on_silent_peer():
    async with serving({MessageType.PROBE: hang}) as server:
        start = time.monotonic()
        with pytest.raises(HandshakeTimeoutError, match=f"{HOST}:{server.port}"):
            await request(HOST, server.port, MessageType.PROBE, {}, timeout=0.3)
        assert time.monotonic() - start < 2.0


@contextlib.asynccontextmanager
async def fake_peer(reply: bytes):
    """A peer that reads one frame and answers with ``reply`` bytes, then closes."""

    async def on_conn(reader, writer):
        try:
            FrameDecoder().feed(await reader.read(1024))
            writer.write(reply)
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(on_conn, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (encode_message(MessageType.METADATA, {}), RemoteProtocolError, "METADATA frame"),
        ((6).to_bytes(8, "little") + b"\x03{nope", MalformedJsonError, "bad reply"),
        ((4).to_bytes(8, "little") + b"\x03[]\n", MalformedJsonError, "not an object"),
        (bytes(8), RemoteProtocolError, "zero"),
        (encode_message(MessageType.PROBE, {})[:-2], PeerConnectionError, "before a full reply"),
        (b"", PeerConnectionError, "before a full reply"),
        (encode_message(MessageType.PROBE, {"error": ""}), None, None),
    ],
    ids=["wrong-type", "bad-json", "array", "zero-length", "truncated", "no-reply", "empty-error"],
)
async def test_client_rejects_bad_replies(reply, error, match):
    async with fake_peer(reply) as port:
        if error is None:
            assert await request(HOST, port, MessageType.PROBE, {}, timeout=3) == {"error": ""}
            return
        with pytest.raises(error, match=match) as info:
            await request(HOST, port, MessageType.PROBE, {}, timeout=3)
        assert f"{HOST}:{port}" in str(info.value)


def _find_bindable_port() -> int:
    for port in range(23000, 32000, 37):
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
                return port
            except OSError:
                continue
    pytest.skip("no bindable port in 23000..32000")


async def test_start_none_picks_port_in_given_range():
    base = _find_bindable_port()
    server = HandshakeServer(HANDLERS)
    try:
        port = await server.start(HOST, None, port_range=(base, base + 3))
        assert base <= port <= base + 3 and server.port == port
        assert (await request(HOST, port, MessageType.PROBE, {}))["type"] == 3
    finally:
        await server.close()


async def test_start_fails_with_endpoint_error_when_port_taken():
    with socket.socket() as taken:
        taken.bind((HOST, _find_bindable_port()))
        taken.listen()
        port = taken.getsockname()[1]
        for wanted in (None, port):
            server = HandshakeServer(HANDLERS)
            with pytest.raises(EndpointError):
                await server.start(HOST, wanted, port_range=(port, port))
            await server.close()


async def test_start_binds_only_the_given_host():
    async with serving() as server:
        with socket.socket() as probe:  # another address on the same port is still free
            probe.bind(("127.0.0.2", server.port))
            assert probe.getsockname() == ("127.0.0.2", server.port)
        with socket.socket() as probe, pytest.raises(OSError):  # the given one is taken
            probe.bind((HOST, server.port))


# ---- netaddr -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("host:80", None, ("host", 80)),
        ("1.2.3.4:5", None, ("1.2.3.4", 5)),
        ("[::1]:5", None, ("::1", 5)),
        ("[fe80::1%eth0]:65535", None, ("fe80::1%eth0", 65535)),
        ("host", 12001, ("host", 12001)),
        ("[::1]", 7, ("::1", 7)),
        ("::1", 7, ("::1", 7)),
    ],
)
def test_parse_host_port(text, default, expected):
    assert parse_host_port(text, default) == expected


@pytest.mark.parametrize(
    ("text", "default"),
    [
        ("host", None), ("[::1]", None), ("::1", None), ("host:0", None), ("host:65536", None),
        ("host:-1", None), ("host:x", None), ("host:", None), (":80", None), ("", 5),
        ("[::1", None), ("[::1]x", None), ("[nothex]:5", None), ("a:b:c", 5), ("h h:1", None),
        ("host", 0), ("host", 70000), ("host:٣", None),
    ],
)
def test_parse_host_port_rejects(text, default):
    with pytest.raises(InvalidArgumentError):
        parse_host_port(text, default)


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [("10.0.0.5", 15873, "10.0.0.5:15873"), ("fe80::1", 1, "[fe80::1]:1"), ("h", 2, "h:2"), ("[::1]", 3, "[::1]:3")],
)
def test_format_host_port_round_trips(host, port, expected):
    assert format_host_port(host, port) == expected
    assert parse_host_port(expected) == (host.strip("[]"), port)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.5", "::1", "fe80::1", "localhost", "fe80::1%lo"])
def test_numeric_addresses_resolve_as_getaddrinfo_would_and_names_go_to_the_resolver(host):
    """A numeric address gets the answer the resolver would give for a TCP connect; a name and a
    scoped IPv6 address get None (the resolver's turn)."""
    ours = numeric_stream_addrinfo(host, 4242)
    if host in ("localhost", "fe80::1%lo"):
        assert ours is None
        return
    theirs = socket.getaddrinfo(host, 4242, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    assert ours == [(f, t, p, "", a) for f, t, p, _, a in theirs]


def test_opening_sessions_to_numeric_peers_starts_no_resolver_threads(tmp_path):
    """An engine on uvloop that opens a session to a numeric peer moves verified bytes without
    starting libuv's resolver thread pool (4 threads that would count against the process's
    thread bound for nothing)."""
    script = """
import os
from flagcx_mc import HostBuffer, TransferEngine
a, b = TransferEngine(), TransferEngine()
for e in (a, b):
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src, dst = HostBuffer(1 << 20), HostBuffer(1 << 20)
assert a.register_memory(src.addr, src.size) == 0 and b.register_memory(dst.addr, dst.size) == 0
digest = src.fill_random()
assert a.transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", src.addr, dst.addr, src.size) == 0
assert dst.digest() == digest
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sum(n == "libuv-worker" for n in names))
"""
    pytest.importorskip("uvloop")
    # cwd elsewhere: the installed package, not the checkout's unbuilt sources
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FLAGCX_MC_TRANSPORT": "tcp"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", out.stdout


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20010"}, (20000, 20010)),
        ({"MC_MIN_PRC_PORT": "20000", "MC_MAX_PRC_PORT": "20010"}, (20000, 20010)),
        ({"MC_MIN_RPC_PORT": "21000", "MC_MIN_PRC_PORT": "20000", "MC_MAX_PRC_PORT": "22000"}, (21000, 22000)),
        ({"MC_MIN_RPC_PORT": "abc"}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "80"}, (15000, 17000)),
        ({"MC_MAX_RPC_PORT": "70000"}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "15500"}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "30000", "MC_MAX_RPC_PORT": "32768"}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "60999", "MC_MAX_RPC_PORT": "62000"}, (15000, 17000)),
        ({"MC_MIN_RPC_PORT": "61000", "MC_MAX_RPC_PORT": "62000"}, (61000, 62000)),
    ],
)
def test_rpc_port_range(monkeypatch, caplog, env, expected):
    for name in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", "MC_MIN_PRC_PORT", "MC_MAX_PRC_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert rpc_port_range() == expected
    fell_back = bool(env) and expected == (15000, 17000)
    assert any("ignoring RPC port range" in r.getMessage() for r in caplog.records) == fell_back
