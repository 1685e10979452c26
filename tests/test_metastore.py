"""Metadata stores: Mooncake's key layout, metadata_server strings, HTTP and Redis backends,
and the HTTP metadata server (in process, against raw bytes, and as a command)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import orjson
import pytest
from support.servers import PACKAGE_PARENT, free_port  # noqa: E402

from flagcx_mc.config import EngineConfig
from flagcx_mc.errors import (
    EndpointError,
    EngineStateError,
    HandshakeTimeoutError,
    InvalidArgumentError,
    MalformedJsonError,
    MetadataError,
    NotSupportedError,
    PeerConnectionError,
    RemoteProtocolError,
)
from flagcx_mc.metadata import redis_store
from flagcx_mc.metadata.connect import open_store, parse_metadata_server
from flagcx_mc.metadata.http_store import HttpMetadataStore, MetadataHttpError
from flagcx_mc.metadata.keys import key_prefix, rpc_meta_key, segment_key
from flagcx_mc.metadata.redis_store import RedisMetadataStore
from flagcx_mc.metadata.server import MetadataServer

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(30)

DESC = {
    "name": "127.0.0.1:15000",
    "protocol": "tcp",
    "tcp_data_port": 16000,
    "tcp_proto_version": 2,
    "timestamp": "2026-01-01 00:00:00.000000",
    "buffers": [{"name": "127.0.0.1:15000", "addr": (1 << 64) - 4096, "length": 4096}],
}


async def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes, half-close, and return everything the server sends until it closes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        writer.write_eof()
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


# --- key layout -----------------------------------------------------------------------------


def test_keys_without_cluster_id():
    assert key_prefix() == "mooncake/"
    assert segment_key("10.0.0.5:15873") == "mooncake/ram/10.0.0.5:15873"
    assert rpc_meta_key("10.0.0.5:15873") == "mooncake/rpc_meta/10.0.0.5:15873"
    assert segment_key("cpu/seg") == "mooncake/cpu/seg"  # a name with "/" is already a path
    assert segment_key("h:1", "") == "mooncake/ram/h:1"


@pytest.mark.parametrize("cluster", ["prod", "prod/"])
def test_keys_with_cluster_id(monkeypatch, cluster):
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", cluster)
    cluster_id = EngineConfig.from_env().metadata_cluster_id  # the engine reads the variable
    assert cluster_id == cluster
    assert key_prefix(cluster_id) == "mooncake/prod/"
    assert segment_key("h:1", cluster_id) == "mooncake/prod/ram/h:1"
    assert rpc_meta_key("h:1", cluster_id) == "mooncake/prod/rpc_meta/h:1"
    assert segment_key("a/b", cluster_id) == "mooncake/prod/a/b"


def test_keys_never_read_the_environment(monkeypatch):
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "env")
    assert segment_key("n", cluster_id="c") == "mooncake/c/ram/n"
    assert rpc_meta_key("n") == "mooncake/rpc_meta/n"
    assert EngineConfig.from_env(metadata_cluster_id="kw").metadata_cluster_id == "kw"


@pytest.mark.parametrize("bad", ["", None, 5])
def test_key_names_must_be_non_empty(bad):
    with pytest.raises(InvalidArgumentError):
        segment_key(bad)
    with pytest.raises(InvalidArgumentError):
        rpc_meta_key(bad)


# --- metadata_server strings --------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, metadata_type, expected",
    [
        ("P2PHANDSHAKE", "", ("p2p", "")),
        ("P2PHANDSHAKE", "http", ("p2p", "")),
        ("http://10.0.0.1:8080/metadata", "", ("http", "http://10.0.0.1:8080/metadata")),
        ("https://meta.example/metadata", "", ("http", "https://meta.example/metadata")),
        ("HTTP://h:1/metadata", "", ("http", "http://h:1/metadata")),
        ("http://[::1]:8080/metadata", "", ("http", "http://[::1]:8080/metadata")),
        ("redis://10.0.0.1:6379", "", ("redis", "redis://10.0.0.1:6379")),
        ("redis://10.0.0.1", "", ("redis", "redis://10.0.0.1")),
        ("etcd://10.0.0.1:2379", "", ("etcd", "etcd://10.0.0.1:2379")),
        ("10.0.0.1:2379", "", ("etcd", "etcd://10.0.0.1:2379")),  # no scheme: etcd
        ("h:8080/metadata", "http", ("http", "http://h:8080/metadata")),  # initialize_ext
        ("h:6379", "redis", ("redis", "redis://h:6379")),
        ("redis://h:6379", "http", ("redis", "redis://h:6379")),  # a scheme beats metadata_type
    ],
)
def test_parse_metadata_server(url, metadata_type, expected):
    assert parse_metadata_server(url, metadata_type) == expected


@pytest.mark.parametrize(
    "url, metadata_type",
    [
        ("", ""),
        (None, ""),
        ("ftp://h:1", ""),
        ("h:1", "p2p"),
        ("http://", ""),
        ("http:///metadata", ""),
        ("http://h:port/metadata", ""),
        ("http://user:pw@h:1/metadata", ""),
        ("redis://", ""),
        ("redis://h:1/2", ""),
        ("redis://u:p@h:1", ""),
        ("etcd://", ""),
        ("etcd://h:port", ""),
        ("etcd://h:1/v3", ""),
        ("etcd://u@h:1", ""),
        ("etcd://h:1;;:2", ""),
    ],
)
def test_parse_metadata_server_rejects(url, metadata_type):
    with pytest.raises(InvalidArgumentError):
        parse_metadata_server(url, metadata_type)


def test_open_store_kinds():
    store = open_store(*parse_metadata_server("http://127.0.0.1:1/metadata"))
    assert isinstance(store, HttpMetadataStore) and store.url == "http://127.0.0.1:1/metadata"
    etcd = open_store(*parse_metadata_server("10.0.0.1:2379"))
    assert isinstance(etcd, EtcdMetadataStore) and etcd.url == "etcd://10.0.0.1:2379"
    with pytest.raises(InvalidArgumentError, match="P2PHANDSHAKE"):
        open_store(*parse_metadata_server("P2PHANDSHAKE"))
    with pytest.raises(InvalidArgumentError):
        open_store("zk", "zk://h:1")


@pytest.mark.parametrize("timeout", [0, -1.0, True, "3"])
def test_http_store_rejects_bad_timeout(timeout):
    with pytest.raises(InvalidArgumentError):
        HttpMetadataStore("http://127.0.0.1:1/metadata", timeout=timeout)


# --- HTTP store against our server --------------------------------------------------------------


@pytest.fixture
async def server():
    async with MetadataServer(HOST, 0) as srv:
        yield srv


@pytest.fixture
async def store(server, monkeypatch):
    monkeypatch.delenv("MC_METADATA_HTTP_TOKEN", raising=False)
    async with HttpMetadataStore(server.url, timeout=5.0) as st:
        yield st


@pytest.mark.uvloop  # the HTTP client and server on uvloop too (tests/conftest.py)
async def test_http_round_trip(server, store):
    key = segment_key(DESC["name"])
    assert await store.get(key) is None
    await store.put(key, DESC)
    assert await store.get(key) == DESC
    replaced = {**DESC, "buffers": []}
    await store.put(key, replaced)  # segment keys may be overwritten
    assert await store.get(key) == replaced
    assert server.keys() == [key]
    await store.delete(key)
    assert await store.get(key) is None
    await store.delete(key)  # already gone: still fine
    assert server.keys() == []


async def test_http_keys_are_escaped(server, store):
    keys = ["a b", "x&key=y", "q?r#s", "ü/€", "100%", "+plus", "mooncake/ram/[::1]:15000"]
    for key in keys:
        await store.put(key, {"k": key})
    assert server.keys() == sorted(keys)
    for key in keys:
        assert await store.get(key) == {"k": key}


async def test_duplicate_rpc_meta_is_refused(server, store):
    key = rpc_meta_key("10.0.0.5:15873")
    loc = {"ip_or_host_name": "10.0.0.5", "rpc_port": 15873}
    await store.put(key, loc)
    await store.put(key, loc)  # the same location again is idempotent
    with pytest.raises(MetadataHttpError, match="Duplicate rpc_meta") as info:
        await store.put(key, {**loc, "rpc_port": 15874})
    assert info.value.status == 400 and isinstance(info.value, MetadataError) and info.value.code == -200
    assert await store.get(key) == loc
    await store.delete(key)
    await store.put(key, {**loc, "rpc_port": 15874})
    assert (await store.get(key))["rpc_port"] == 15874


async def test_http_store_argument_errors(store):
    with pytest.raises(InvalidArgumentError):
        await store.put("k", [1, 2])
    with pytest.raises(InvalidArgumentError):
        await store.put("k", {"a": object()})
    for bad in ["", " k", "k\n"]:
        with pytest.raises(InvalidArgumentError):
            await store.get(bad)


async def test_stored_value_that_is_not_an_object(server, store):
    for body in (b"not json", b"[1, 2]"):
        head = f"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        assert _status(await _raw(server.port, head.encode() + body)) == 200
        with pytest.raises(MalformedJsonError):
            await store.get("k")


async def test_closed_store_refuses(server):
    st = HttpMetadataStore(server.url)
    await st.close()
    await st.close()
    with pytest.raises(EngineStateError):
        await st.get("k")


async def test_bearer_token(monkeypatch):
    monkeypatch.delenv("MC_METADATA_HTTP_TOKEN", raising=False)
    async with MetadataServer(HOST, 0, token="s3cret") as srv:
        for token in (None, "wrong"):
            with pytest.raises(MetadataHttpError) as info:
                await HttpMetadataStore(srv.url, token=token).get("k")
            assert info.value.status == 401
        monkeypatch.setenv("MC_METADATA_HTTP_TOKEN", "s3cret")
        st = open_store("http", srv.url, settings=EngineConfig.from_env().store_settings())
        await st.put("k", {"v": 1})
        assert await st.get("k") == {"v": 1}


async def test_server_budgets(monkeypatch):
    monkeypatch.delenv("MC_METADATA_HTTP_TOKEN", raising=False)
    async with MetadataServer(HOST, 0, max_keys=2, max_total_bytes=100, max_body=64) as srv:
        st = HttpMetadataStore(srv.url)
        await st.put("k1", {"a": "x" * 40})
        await st.put("k2", {"a": "x" * 40})
        with pytest.raises(MetadataHttpError) as info:
            await st.put("k3", {"a": 1})
        assert info.value.status == 507
        with pytest.raises(MetadataHttpError) as info:
            await st.put("k1", {"a": "x" * 50})  # within max_body, beyond max_total_bytes
        assert info.value.status == 507
        with pytest.raises(MetadataHttpError) as info:
            await st.put("k1", {"a": "x" * 100})
        assert info.value.status == 413
        assert await st.get("k1") == {"a": "x" * 40}


_H = b"Host: x\r\n"


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /metadata HTTP/1.1\r\n" + _H + b"\r\n", 400),  # no key
        (b"GET /metadata?key=%20%20 HTTP/1.1\r\n" + _H + b"\r\n", 400),  # blank key
        (b"GET /metadata?key=%FF HTTP/1.1\r\n" + _H + b"\r\n", 400),  # not UTF-8
        (b"GET /other?key=k HTTP/1.1\r\n" + _H + b"\r\n", 404),
        (b"GET /metadata?key=missing HTTP/1.1\r\n" + _H + b"\r\n", 404),
        (b"DELETE /metadata?key=missing HTTP/1.1\r\n" + _H + b"\r\n", 404),
        (b"POST /metadata?key=k HTTP/1.1\r\n" + _H + b"Content-Length: 0\r\n\r\n", 405),
        (b"GET /metadata?key=k HTTP/1.0\r\n\r\n", 404),  # HTTP/1.0 needs no Host
        (b"HELLO\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # TLS on a plain port
        (b"GET /metadata?key=k HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /metadata?key=k HTTP/1.1\r\nHost x\r\n\r\n", 400),  # no colon
        (b"GET /metadata?key=k HTTP/1.1\nHost: x\r\n\r\n", 404),  # bare LF ends a line (RFC 9112 2.2)
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b" folded: y\r\n\r\n", 404),  # unfolded (RFC 9112 5.2)
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"X: a\x01b\r\n\r\n", 404),  # kept (RFC 9110 5.5)
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"X: a\rb\r\n\r\n", 400),  # bare CR
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"X: a\x00b\r\n\r\n", 400),  # NUL
        (b"GET /metadata?key=k HTTP/2.0\r\n" + _H + b"\r\n", 505),
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H * 2 + b"\r\n", 400),  # two Host fields (RFC 9112 3.2)
        (b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"".join(b"X-%d: y\r\n" % i for i in range(100)) + b"\r\n", 431),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Content-Length: -1\r\n\r\n", 400),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Transfer-Encoding: gzip\r\n\r\n", 501),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Content-Length: 16777217\r\n\r\n", 413),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Expect: magic\r\nContent-Length: 2\r\n\r\n", 417),
        (b"PUT /metadata?key=k HTTP/1.1\r\n" + _H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ],
)
async def test_server_answers_bad_requests_and_keeps_serving(server, store, request_bytes, status):
    response = await _raw(server.port, request_bytes)
    assert response.startswith(b"HTTP/1.1 ") and _status(response) == status, response
    await store.put("k", {"still": "serving"})
    assert await store.get("k") == {"still": "serving"}


async def test_oversized_head_is_cut_off(server, store):
    big = b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"X-Big: " + b"a" * (80 * 1024) + b"\r\n\r\n"
    try:
        response = await _raw(server.port, big)
    except ConnectionResetError:  # unread input at close may reset before we read the 431
        response = b""
    assert response == b"" or _status(response) == 431
    assert await store.get("k") is None


@pytest.mark.uvloop  # the HTTP client and server on uvloop too (tests/conftest.py)
async def test_keep_alive_and_pipelining(server):
    body = b'{"p": 1}'
    requests = (
        b"PUT /metadata?key=p HTTP/1.1\r\n" + _H + b"Content-Length: %d\r\n\r\n" % len(body) + body
        + b"\r\n"  # a stray CRLF between requests is tolerated
        + b"GET /metadata?key=p HTTP/1.1\r\n" + _H + b"\r\n"
        + b"DELETE /metadata?key=p HTTP/1.1\r\n" + _H + b"Connection: close\r\n\r\n"
    )
    response = await _raw(server.port, requests)
    assert response.count(b"HTTP/1.1 200 OK") == 3
    assert b'\r\n\r\n{"p": 1}HTTP/1.1' in response and response.endswith(b"metadata deleted")


async def test_expect_100_continue(server, store):
    body = orjson.dumps({"big": "x" * 5000})
    reader, writer = await asyncio.open_connection(HOST, server.port)
    try:
        writer.write(
            b"PUT /metadata?key=e HTTP/1.1\r\n" + _H
            + b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert _status(await asyncio.wait_for(reader.read(), 5)) == 200
    finally:
        writer.close()
    assert await store.get("e") == {"big": "x" * 5000}


async def test_chunked_put(server, store):
    request = (
        b"PUT /metadata?key=c HTTP/1.1\r\n" + _H + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"4;ext=1\r\n{\"c\"\r\n4\r\n: 1}\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    assert _status(await _raw(server.port, request)) == 200
    assert await store.get("c") == {"c": 1}


@pytest.mark.uvloop  # the HTTP client and server on uvloop too (tests/conftest.py)
async def test_close_drops_idle_connections():
    srv = MetadataServer(HOST, 0)
    port = await srv.start()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"GET /metadata?key=k HTTP/1.1\r\n" + _H + b"\r\n")  # keep-alive
        await asyncio.wait_for(reader.readuntil(b"metadata not found"), 5)
        started = time.monotonic()
        await asyncio.wait_for(srv.close(), 5)
        assert time.monotonic() - started < 2
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()
    with pytest.raises(EngineStateError):
        await srv.start()


async def test_server_start_errors():
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        with pytest.raises(EndpointError):
            await MetadataServer(HOST, busy.getsockname()[1]).start()
    for kwargs in ({"port": -1}, {"port": 70000}, {"max_body": 0}, {"idle_timeout": 0}):
        with pytest.raises(InvalidArgumentError):
            MetadataServer(HOST, **{"port": 0, **kwargs})


# --- HTTP store against misbehaving servers --------------------------------------------------------


class _FakeServer:
    """Accepts, reads one request head, then answers with canned bytes (or never)."""

    def __init__(self, answer: bytes | None, close: bool = True) -> None:
        self.answer = answer
        self.close_after = close
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._on_connect, HOST, 0)
        return f"http://{HOST}:{self.server.sockets[0].getsockname()[1]}/metadata"

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if self.answer is not None:
            writer.write(self.answer)
            if self.close_after:
                writer.close()


@pytest.mark.uvloop  # the HTTP client and server on uvloop too (tests/conftest.py)
async def test_timeout_is_bounded():
    async with _FakeServer(None) as url:
        st = HttpMetadataStore(url, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(HandshakeTimeoutError):
            await st.get("k")
        assert time.monotonic() - started < 2.0


@pytest.mark.uvloop  # the HTTP client and server on uvloop too (tests/conftest.py)
async def test_connection_refused():
    st = HttpMetadataStore(f"http://{HOST}:{free_port()}/metadata", timeout=2.0)
    with pytest.raises(PeerConnectionError):
        await st.put("k", {"a": 1})


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{}", PeerConnectionError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{}", RemoteProtocolError),
        (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom", MetadataHttpError),
        (b"", PeerConnectionError),
    ],
)
async def test_bad_answers(answer, error):
    async with _FakeServer(answer) as url:
        with pytest.raises(error):
            await HttpMetadataStore(url, timeout=2.0).get("k")


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"v\": 1}",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"v\": 1}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"v\r\n5\r\n\": 1}\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"v\": 1}",  # ends at EOF
    ],
)
async def test_response_framings(answer):
    async with _FakeServer(answer) as url:
        assert await HttpMetadataStore(url, timeout=2.0).get("k") == {"v": 1}


# --- the server as a command ---------------------------------------------------------------------


def _start_server_process(*args: str) -> tuple[subprocess.Popen, int]:
    env = {k: v for k, v in os.environ.items() if k != "MC_METADATA_HTTP_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flagcx_mc.metadata.server", "--host", HOST, "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=PACKAGE_PARENT, env=env,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 15)
    line = proc.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"metadata server did not print its port: {line!r} {err.decode()[-2000:]}")
    return proc, int(line)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_command(sig):
    proc, port = _start_server_process()
    try:
        url = f"http://{HOST}:{port}/metadata?key=mooncake%2Fram%2Fh%3A1"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        put = urllib.request.Request(url, data=b'{"a": 1}', method="PUT", headers={"Content-Type": "application/json"})
        with opener.open(put, timeout=5) as resp:
            assert resp.status == 200
        with opener.open(url, timeout=5) as resp:
            assert resp.status == 200 and orjson.loads(resp.read()) == {"a": 1}
        with opener.open(urllib.request.Request(url, method="DELETE"), timeout=5) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(url, timeout=5)
        assert info.value.code == 404
        info.value.close()
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_server_command_port_in_use():
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "flagcx_mc.metadata.server", "--host", HOST, "--port", str(busy.getsockname()[1])],
            capture_output=True, text=True, cwd=PACKAGE_PARENT, timeout=20,
        )
    assert proc.returncode == 1 and "cannot bind" in proc.stderr and proc.stdout == ""


# --- Redis ------------------------------------------------------------------------------------------

from support.servers import REDIS_PASSWORD  # noqa: E402
from support.servers import need_redis_package as _need_redis_package  # noqa: E402


@pytest.fixture
def redis_env(monkeypatch):
    for name in ("MC_REDIS_USERNAME", "MC_REDIS_PASSWORD", "MC_REDIS_DB_INDEX"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_redis_round_trip(redis_port, redis_env):
    import redis.asyncio as aioredis

    redis_env.setenv("MC_REDIS_PASSWORD", REDIS_PASSWORD)
    redis_env.setenv("MC_REDIS_DB_INDEX", "3")
    key = segment_key(f"seg-{uuid.uuid4().hex}")
    settings = EngineConfig.from_env().store_settings()
    async with open_store(*parse_metadata_server(f"{HOST}:{redis_port}", "redis"), settings=settings) as st:
        assert isinstance(st, RedisMetadataStore)
        assert await st.get(key) is None
        await st.put(key, DESC)
        assert await st.get(key) == DESC
        raw = aioredis.Redis(host=HOST, port=redis_port, password=REDIS_PASSWORD, db=3)
        raw0 = aioredis.Redis(host=HOST, port=redis_port, password=REDIS_PASSWORD, db=0)
        try:
            assert orjson.loads(await raw.get(key)) == DESC  # plain JSON text, as Mooncake stores it
            assert await raw0.get(key) is None  # MC_REDIS_DB_INDEX picked database 3
            await raw.set(key, b"[1]")
            with pytest.raises(MalformedJsonError):
                await st.get(key)
        finally:
            await raw.aclose()
            await raw0.aclose()
        await st.delete(key)
        assert await st.get(key) is None
        await st.delete(key)
    with pytest.raises(EngineStateError):
        await st.get(key)


async def test_redis_credentials(redis_port, redis_env):
    url = f"redis://{HOST}:{redis_port}"
    async with RedisMetadataStore(url) as st:  # no password
        with pytest.raises(MetadataError, match="authentication"):
            await st.get("k")
    redis_env.setenv("MC_REDIS_PASSWORD", "wrong")
    async with RedisMetadataStore(url, settings=EngineConfig.from_env().store_settings()) as st:
        with pytest.raises(MetadataError, match="authentication"):
            await st.get("k")
    redis_env.setenv("MC_REDIS_PASSWORD", REDIS_PASSWORD)
    redis_env.setenv("MC_REDIS_USERNAME", "default")
    redis_env.setenv("MC_REDIS_DB_INDEX", "999")  # out of range: database 0, as in Mooncake
    key = rpc_meta_key(f"h-{uuid.uuid4().hex}:1")
    async with RedisMetadataStore(url, settings=EngineConfig.from_env().store_settings()) as st:
        await st.put(key, {"ip_or_host_name": "h", "rpc_port": 1})
        assert await st.get(key) == {"ip_or_host_name": "h", "rpc_port": 1}
        await st.delete(key)


async def test_redis_unreachable(redis_env):
    _need_redis_package()
    async with RedisMetadataStore(f"redis://{HOST}:{free_port()}", timeout=2.0) as st:
        started = time.monotonic()
        with pytest.raises(PeerConnectionError):
            await st.get("k")
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("text, index", [(None, 0), ("3", 3), ("255", 255), ("256", 0), ("-1", 0), ("x", 0)])
def test_redis_db_index(redis_env, text, index):
    if text is not None:
        redis_env.setenv("MC_REDIS_DB_INDEX", text)
    assert redis_store.redis_db_index(text) == index
    assert EngineConfig.from_env().redis_db_index == index


def test_redis_package_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(NotSupportedError, match=r"pip install 'flagcx_mc\[redis\]'"):
        RedisMetadataStore(f"redis://{HOST}:6379")


# --- etcd -------------------------------------------------------------------------------------------

from flagcx_mc.metadata.etcd_store import EtcdMetadataStore, split_etcd_url  # noqa: E402


def test_etcd_endpoints_are_split_as_mooncake_takes_them():
    assert split_etcd_url("etcd://10.0.0.1") == [("10.0.0.1", 2379)]
    assert split_etcd_url("ETCD://a:1;b:2,[::1]:3;") == [("a", 1), ("b", 2), ("::1", 3)]


async def _etcd_raw(port: int, op: str, request: dict) -> dict:
    """etcd's own JSON API, asked directly (what a Mooncake node's etcd client sees)."""
    from flagcx_mc.metadata.http_store import http_request

    status, answer = await http_request(HOST, port, "POST", f"/v3/kv/{op}", orjson.dumps(request),
                                        url="etcd", timeout=5.0, what=op)
    assert status == 200
    return orjson.loads(answer)


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()


async def test_etcd_round_trip(etcd_port):
    import base64

    key = segment_key(f"seg-{uuid.uuid4().hex}")
    async with open_store(*parse_metadata_server(f"{HOST}:{etcd_port}")) as st:
        assert isinstance(st, EtcdMetadataStore)
        assert await st.get(key) is None
        await st.put(key, DESC)
        assert await st.get(key) == DESC
        raw = await _etcd_raw(etcd_port, "range", {"key": _b64(key.encode())})
        assert orjson.loads(base64.b64decode(raw["kvs"][0]["value"])) == DESC  # JSON text, as Mooncake keeps it
        # A value written by another client (Mooncake ends its JSON with a newline) reads back.
        await _etcd_raw(etcd_port, "put", {"key": _b64(key.encode()), "value": _b64(orjson.dumps(DESC) + b"\n")})
        assert await st.get(key) == DESC
        await _etcd_raw(etcd_port, "put", {"key": _b64(key.encode()), "value": _b64(b"[1]")})
        with pytest.raises(MalformedJsonError):
            await st.get(key)
        await st.delete(key)
        assert await st.get(key) is None
        assert (await _etcd_raw(etcd_port, "range", {"key": _b64(key.encode())})).get("kvs") is None
        await st.delete(key)  # absent: still fine
        with pytest.raises(InvalidArgumentError):
            await st.put(" padded", DESC)
    with pytest.raises(EngineStateError):
        await st.get(key)


async def test_etcd_tries_the_next_endpoint_and_reports_when_none_answers(etcd_port):
    dead = free_port()
    key = rpc_meta_key(f"h-{uuid.uuid4().hex}:1")
    async with EtcdMetadataStore(f"etcd://{HOST}:{dead};{HOST}:{etcd_port}") as st:
        await st.put(key, {"ip_or_host_name": "h", "rpc_port": 1})
        assert await st.get(key) == {"ip_or_host_name": "h", "rpc_port": 1}
        await st.delete(key)
    async with EtcdMetadataStore(f"etcd://{HOST}:{dead}", timeout=2.0) as st:
        with pytest.raises(PeerConnectionError):
            await st.get(key)


async def test_etcd_answers_that_are_not_etcds_are_refused():
    """A server on the port that is not etcd: an error status, or a 200 that is not etcd's JSON."""
    server = MetadataServer(HOST, 0)  # answers /v3/kv/... with 404: not etcd
    await server.start()
    try:
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        async with EtcdMetadataStore(f"etcd://{HOST}:{port}") as st:
            with pytest.raises(MetadataError, match="HTTP 4"):
                await st.get("k")
    finally:
        await server.close()

    answers = iter([b"<html>not etcd</html>", b"[1, 2]", b'{"kvs": [{"key": "aw==", "value": "%%%"}]}'])

    async def plain(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = next(answers)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    other = await asyncio.start_server(plain, HOST, 0)
    try:
        port = other.sockets[0].getsockname()[1]
        async with EtcdMetadataStore(f"etcd://{HOST}:{port}") as st:
            for expected in ("not valid JSON", "not an object", "bad value"):
                with pytest.raises(RemoteProtocolError, match=expected):
                    await st.get("k")
    finally:
        other.close()
        await other.wait_closed()
